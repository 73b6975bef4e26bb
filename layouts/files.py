"""Whole-file helpers shared by everything that writes or checks our files (and the hub's)."""
from __future__ import annotations

import hashlib
from pathlib import Path

HASH_CHUNK = 8 << 20        # bytes read per hashing step


def sha256_file(path: str | Path, progress=None, chunk: int = HASH_CHUNK) -> str:
    """Hex sha256 of a file's bytes, as manifest.json and the hub's LFS pointers record it.
    progress: anything with update(nbytes) (a tqdm bar), called after each chunk."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress is not None:
                progress.update(len(block))
    return h.hexdigest()
