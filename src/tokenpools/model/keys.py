"""API keys: only sha256 hashes are ever stored."""

from __future__ import annotations

import hashlib
import hmac
import re

PREFIX = "sha256:"
KEY_HASH_PATTERN = r"^sha256:[0-9a-f]{64}$"  # also the CRD's pattern and CEL rule
_HASH_RE = re.compile(KEY_HASH_PATTERN)


def hash_key(key: str) -> str:
    # surrogateescape: a header's bytes that are not UTF-8 reach here as surrogates; they hash
    # (to nothing stored) instead of failing, and every valid key hashes as plain UTF-8
    return PREFIX + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def is_key_hash(value: str) -> bool:
    return bool(_HASH_RE.match(value))


def key_matches(key: str, stored_hash: str) -> bool:
    """Constant-time comparison of a presented key against a stored hash."""
    return hmac.compare_digest(hash_key(key), stored_hash)
