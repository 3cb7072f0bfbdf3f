"""Sub-commands of `tokenpools`, one module per group."""
