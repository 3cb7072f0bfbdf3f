"""Hosts other than our own servers that drive the decision core."""
