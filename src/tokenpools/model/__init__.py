"""Value types and the configuration schema. Pure: no I/O beyond `load_config`'s file read."""
