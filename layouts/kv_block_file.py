"""Prefix-cache files: the disk tier of `ktrun serve --prefix-cache-dir` holds one KV block, or one recurrent-state
snapshot, per file.

    bytes 0..6     magic b"KTKVBLK"
    byte  7        container version (VERSION)
    bytes 8..39    sha256 of bytes 40.. (the payload)
    bytes 40..     payload: a standard safetensors file; its __metadata__ holds META_IDENTITY (hex digest of the model
                   identity), META_KEY (the entry's key, hex) and META_LAYOUT (the layout's text form). Tensors:
                   - a KV block (SUFFIX): token kinds "t0", "t1", ... of shape (layers, block_size, *width) in the KV
                     dtype (the runtime's BlockLayout order);
                   - a state snapshot (STATE_SUFFIX), for families with recurrent layers (linear attention): the state
                     after the last token of the block it ends, "r0", "r1", ... layer by layer (Qwen3-Next: each
                     DeltaNet layer's conv window (kernel-1, conv_dim) in the dense dtype, then its state (v_heads,
                     dk, dv) in float32; the runtime's StateLayout order).

A block's key is the chained hash of every token up to the block's end plus the model identity (ktrun.prefix_cache
.keys); the snapshot at a block's end has its own key derived from the block's (`state_key`). A file's name says
which entry it is: `<dir>/<key[:2]>/<key><suffix>`, 64 lowercase hex digits. Files are written to
`<name>.tmp-<pid>` in the same folder, fsynced, then renamed: a reader sees a whole file or none. A file whose
checksum, header, layout or shapes disagree is corrupt: it is deleted and what it held recomputed, never used.
"""
from __future__ import annotations

import hashlib
import re

MAGIC = b"KTKVBLK"
VERSION = 1
HEADER_BYTES = 40
SUFFIX = ".kvblock"
STATE_SUFFIX = ".kvstate"
SUFFIXES = (SUFFIX, STATE_SUFFIX)
TMP_MARK = ".tmp-"
META_IDENTITY = "kt.kv_block.identity"
META_KEY = "kt.kv_block.key"
META_LAYOUT = "kt.kv_block.layout"
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")


class KVBlockFileError(ValueError):
    """A block file that must not be used; the message says why."""


def pack(payload: bytes) -> bytes:
    """The file's bytes for a payload (a safetensors serialization)."""
    return MAGIC + bytes([VERSION]) + hashlib.sha256(payload).digest() + payload


def unpack(raw: bytes, where: str = "block file") -> bytes:
    """The payload of a file's bytes, after checking magic, version and checksum."""
    if len(raw) < HEADER_BYTES:
        raise KVBlockFileError(f"{where}: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
    if raw[:7] != MAGIC:
        raise KVBlockFileError(f"{where}: bad magic {raw[:7]!r}")
    if raw[7] != VERSION:
        raise KVBlockFileError(f"{where}: container version {raw[7]}, this ktrun reads {VERSION}")
    payload = raw[HEADER_BYTES:]
    if hashlib.sha256(payload).digest() != raw[8:HEADER_BYTES]:
        raise KVBlockFileError(f"{where}: checksum mismatch (sha256 of the payload differs from the header's)")
    return payload


def relpath(key_hex: str, suffix: str = SUFFIX) -> str:
    """Where the entry with this key lives, relative to the cache folder."""
    if not _KEY_RE.match(key_hex):
        raise ValueError(f"block key {key_hex!r} is not 64 lowercase hex digits")
    if suffix not in SUFFIXES:
        raise ValueError(f"file suffix {suffix!r} is none of {SUFFIXES}")
    return f"{key_hex[:2]}/{key_hex}{suffix}"


def suffix_of(name: str) -> str | None:
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def key_of(name: str) -> str | None:
    """The key of an entry's file name (`<key>.kvblock`, `<key>.kvstate`), or None for any other name."""
    suffix = suffix_of(name)
    if suffix is None:
        return None
    key = name[: -len(suffix)]
    return key if _KEY_RE.match(key) else None
