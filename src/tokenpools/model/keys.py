"""API keys: only sha256 hashes are ever stored."""

from __future__ import annotations

import hashlib
import hmac
import re

PREFIX = "sha256:"
KEY_HASH_PATTERN = r"^sha256:[0-9a-f]{64}$"  # also the CRD's pattern and CEL rule
_HASH_RE = re.compile(KEY_HASH_PATTERN)


def hash_key(key: str) -> str:
    return PREFIX + hashlib.sha256(key.encode()).hexdigest()


def is_key_hash(value: str) -> bool:
    return bool(_HASH_RE.match(value))


def key_matches(key: str, stored_hash: str) -> bool:
    """Constant-time comparison of a presented key against a stored hash."""
    return hmac.compare_digest(hash_key(key), stored_hash)
