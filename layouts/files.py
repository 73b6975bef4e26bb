"""Whole-file helpers shared by everything that writes or checks our files (and the hub's): sha256, and the rule
that a folder's files resolve (links followed) inside that folder or its hub cache repo folder (resolve_inside)."""
from __future__ import annotations

import hashlib
import os
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


class OutsideRootError(ValueError):
    """A file that resolves (its symbolic links followed) outside the folders it may be read from."""


def hub_cache_root(folder: str | Path) -> Path | None:
    """The hub cache repo folder (.../models--ORG--NAME) of a hub snapshot folder (.../snapshots/REVISION), whose
    files are symbolic links into that repo folder's blobs/; None for any other folder."""
    for p in (Path(os.path.abspath(folder)), Path(folder).resolve()):
        if p.parent.name == "snapshots" and p.parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
            return p.parent.parent.resolve()
    return None


def allowed_roots(folder: str | Path) -> tuple[Path, ...]:
    """Where the files of `folder` may resolve to: the folder itself (resolved) and, for a hub cache snapshot, its
    hub cache repo folder."""
    hub = hub_cache_root(folder)
    return (Path(folder).resolve(),) + ((hub,) if hub is not None else ())


def resolve_inside(path: str | Path, roots: tuple[Path, ...]) -> Path:
    """`path` with every symbolic link followed; OutsideRootError naming both paths when that is not inside one of
    `roots` (from allowed_roots): a link to /etc/passwd named tokenizer_config.json must not be read or copied."""
    try:
        real = Path(path).resolve()
    except (OSError, RuntimeError) as e:           # a symbolic link loop
        raise OutsideRootError(f"{path}: cannot be resolved ({e})") from None
    if not any(real.is_relative_to(r) for r in roots):
        where = " or ".join(str(r) for r in roots)
        raise OutsideRootError(f"{path} is a link to {real}, outside {where}: refusing to read it (copy the file "
                               f"into the folder instead of linking to it)")
    return real
