"""Block keys: block i of a sequence is keyed by a hash chained over every token up to its end, started from the
model identity, so equal keys mean the same model, KV dtype, layout and the same tokens at every earlier position.

    root = sha256("ktrun-prefix-cache/1" + identity JSON)
    key_i = sha256(key_{i-1} + tokens[i*B:(i+1)*B] as little-endian int32)
    state_key(key_i) = sha256("state" + key_i)   (the recurrent-state snapshot after block i's last token)
"""
from __future__ import annotations

import hashlib
import json
import struct

KEY_VERSION = "ktrun-prefix-cache/1"


def identity_digest(identity: dict[str, str]) -> bytes:
    """What must match for a block to be reused: the converted model, KV dtype, device kind, expert backend,
    block layout (see Engine._cache_identity)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()


def root_key(identity: bytes) -> bytes:
    return hashlib.sha256(KEY_VERSION.encode() + identity).digest()


def next_key(prev: bytes, block_tokens: list[int]) -> bytes:
    return hashlib.sha256(prev + struct.pack(f"<{len(block_tokens)}i", *block_tokens)).digest()


def chain_keys(root: bytes, tokens: list[int], block_size: int, n_blocks: int, prev: list[bytes] = ()) -> list[bytes]:
    """Keys of the first n_blocks full blocks of tokens, reusing the already known leading keys `prev`."""
    keys = list(prev[:n_blocks])
    for i in range(len(keys), n_blocks):
        keys.append(next_key(keys[-1] if keys else root, tokens[i * block_size:(i + 1) * block_size]))
    return keys


def state_key(block_key: bytes) -> bytes:
    """The key of the recurrent-state snapshot at the end of the block with this key."""
    return hashlib.sha256(b"state" + block_key).digest()
