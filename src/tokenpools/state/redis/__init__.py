"""The Redis store: one Lua script in four parts (lua/), its wire contract (wire.py), the
clients (connect.py), the calls and what is owed Redis (link.py), the store (store.py), and the
awaited hot path over one multiplexed connection (hot_path.py, mux.py)."""
