"""Where the ledger lives. `memory` is the embedded default; a shared store comes later."""
