"""Chained block hashes for prefix caching.

The hash of block i covers the namespace, the hash of block i-1 and the
block's token ids, so equal hashes mean equal prefixes (not just equal
blocks). blake2b with a 128-bit digest makes an accidental collision (which
would silently serve another prefix's KV) astronomically unlikely
(~2^-64 at 2^32 cached blocks), so hits are not re-checked token by token.

The namespace (model revision, adapter, tenant isolation key) seeds the
chain: requests in different namespaces never share a block hash, hence
never share KV.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


@functools.lru_cache(maxsize=1024)
def namespace_root(namespace: str) -> bytes:
    """The parent hash of a sequence's first block in this namespace."""
    return hashlib.blake2b(namespace.encode(), digest_size=DIGEST_BYTES, person=b"kvserve-ns").digest()


# Hashers are copied from this empty one: a copy costs about a third of
# constructing blake2b(digest_size=...) anew, and every prompt block and
# every completed decode block is hashed (millions in a simulated hour).
# The methods are called through the type (no attribute lookup per call).
_EMPTY_HASHER = hashlib.blake2b(digest_size=DIGEST_BYTES)
_new_hasher = _EMPTY_HASHER.copy
_update = type(_EMPTY_HASHER).update
_digest = type(_EMPTY_HASHER).digest


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block chained to its parent's hash."""
    # Fixed-width 32-bit encoding: unambiguous, and one C call per block.
    return hash_encoded_block(parent, array("I", token_ids).tobytes())


def hash_encoded_block(parent: bytes, encoded: bytes) -> bytes:
    """hash_block of a block already encoded as array("I", token_ids).tobytes()."""
    h = _new_hasher()
    _update(h, parent)
    _update(h, encoded)
    return _digest(h)


@functools.lru_cache(maxsize=64)
def encoded_repeat(token_id: int, block_size: int) -> bytes:
    """The encoding hash_block hashes for a block of `block_size` copies of
    `token_id` (a decode run's blocks hold one repeated token)."""
    return array("I", [token_id] * block_size).tobytes()


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, namespace: str) -> list[bytes]:
    """Chained hashes of every full block of `token_ids` (a partial tail block
    has no hash: only full blocks are ever shared)."""
    hashes = []
    parent = namespace_root(namespace)
    # The bytes hash_block hashes, for every block at once (one C call).
    encoded = array("I", token_ids)
    data, block_bytes = encoded.tobytes(), block_size * encoded.itemsize
    new_hasher, update, digest = _new_hasher, _update, _digest
    for offset in range(0, (len(token_ids) // block_size) * block_bytes, block_bytes):
        h = new_hasher()
        update(h, parent)
        update(h, data[offset:offset + block_bytes])
        parent = digest(h)
        hashes.append(parent)
    return hashes
