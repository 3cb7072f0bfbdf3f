"""Counting a request's prompt tokens: the estimate, or a tokenizer file (no HTTP here; the
gateway adds counting by the backend, gateway/backend_tokens.py)."""
