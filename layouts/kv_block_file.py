"""Prefix-cache block files: the disk tier of `ktrun serve --prefix-cache-dir` holds one KV block per file.

    bytes 0..6     magic b"KTKVBLK"
    byte  7        container version (VERSION)
    bytes 8..39    sha256 of bytes 40.. (the payload)
    bytes 40..     payload: a standard safetensors file, one tensor per kind of the block (the runtime's BlockLayout
                   order: token kinds "t0", "t1", ... of shape (layers, block_size, *width), then state kinds "s0",
                   ... of shape (layers, *state)), in the KV dtype; its __metadata__ holds META_IDENTITY (hex digest
                   of the model identity), META_KEY (the block's key, hex) and META_LAYOUT (the layout's text form)

A block's key is the chained hash of every token up to the block's end plus the model identity (ktrun.prefix_cache
.keys), so a file's name says which block it is: `<dir>/<key[:2]>/<key>.kvblock`, 64 lowercase hex digits. Files are
written to `<name>.tmp-<pid>` in the same folder, fsynced, then renamed: a reader sees a whole file or none. A file
whose checksum, header or shapes disagree is corrupt: it is deleted and its block recomputed, never used.
"""
from __future__ import annotations

import hashlib
import re

MAGIC = b"KTKVBLK"
VERSION = 1
HEADER_BYTES = 40
SUFFIX = ".kvblock"
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


def relpath(key_hex: str) -> str:
    """Where the block with this key lives, relative to the cache folder."""
    if not _KEY_RE.match(key_hex):
        raise ValueError(f"block key {key_hex!r} is not 64 lowercase hex digits")
    return f"{key_hex[:2]}/{key_hex}{SUFFIX}"


def key_of(name: str) -> str | None:
    """The key of a block file name (`<key>.kvblock`), or None for any other name."""
    if not name.endswith(SUFFIX):
        return None
    key = name[: -len(SUFFIX)]
    return key if _KEY_RE.match(key) else None
