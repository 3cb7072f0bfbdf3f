"""The usage ledger's SQL side: the buckets the store counts, written to SQLite or PostgreSQL
(database.py) by the gateway's flusher (flusher.py), read back grouped (report.py)."""
