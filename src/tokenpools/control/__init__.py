"""The pure decision core: admission, priority, debt and burst, binding, eviction, autoscaling.

Nothing here performs I/O or reads a clock; `now` is always an argument.
"""
