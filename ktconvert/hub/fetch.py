"""Fetch one hub file into a local directory: resumable across runs, verified, moved into place only when correct.

A file is downloaded into `<local_dir>/.ktconvert-partial/<name>.<key>.part` (key = the hub's sha256 for LFS files,
the git blob id otherwise), so a killed run leaves a partial file that the next run continues with an HTTP Range
request. Only after its sha256 (LFS) or git blob id (regular file) matches the hub's metadata is it renamed to its
final path. The transfer itself is `huggingface_hub.file_download.http_get` (Range, redirects, retries, hub error
mapping); `hf_hub_download` is not used because it deletes its temporary file on failure, so it cannot resume a
download across processes.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from huggingface_hub import hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers
from ktlayouts.files import sha256_file

PARTIAL_DIR = ".ktconvert-partial"
HASH_BLOCK = 8 << 20  # bytes read per hashing step


@dataclass(frozen=True)
class RemoteFile:
    """One file of a hub repository at a commit, as the tree listing describes it."""

    path: str  # '/'-separated, relative to the repo root, already checked by `safe_relpath`
    size: int  # bytes of the real content (the LFS object for LFS files)
    git_oid: str  # git blob id (of the LFS pointer for LFS files)
    sha256: str | None  # LFS object sha256; None for regular git files

    @property
    def key(self) -> str:
        return self.sha256 or self.git_oid


class VerifyError(Exception):
    """A downloaded file does not match the hub's metadata."""


def git_blob_oid(path: Path) -> str:
    """Git's blob id: sha1 over b'blob <size>\\0' + content."""
    h = hashlib.sha1()
    h.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def check_content(path: Path, rf: RemoteFile) -> str:
    """Raise VerifyError unless `path` holds exactly `rf`; return the file's sha256."""
    size = path.stat().st_size
    if size != rf.size:
        raise VerifyError(f"{rf.path}: size {size} bytes, hub says {rf.size} bytes")
    digest = sha256_file(path)
    if rf.sha256 is not None:
        if digest != rf.sha256:
            raise VerifyError(f"{rf.path}: sha256 {digest} does not match the hub's {rf.sha256}")
    else:
        oid = git_blob_oid(path)
        if oid != rf.git_oid:
            raise VerifyError(f"{rf.path}: git blob id {oid} does not match the hub's {rf.git_oid}")
    return digest


def partial_path(local_dir: Path, rf: RemoteFile) -> Path:
    return local_dir / PARTIAL_DIR / f"{quote(rf.path, safe='')}.{rf.key[:16]}.part"


class Cancelled(Exception):
    """Another download of the same pull failed or the user interrupted: stop this transfer."""


class _ForwardBar:
    """tqdm stand-in handed to `http_get`: forwards byte counts to the shared aggregate bar, stops on request."""

    bar = None  # set per download by `_bar_class`
    stop = None  # threading.Event or None

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        if self.stop is not None and self.stop.is_set():
            raise Cancelled()
        if self.bar is not None:
            self.bar.update(n)

    def close(self):
        pass


def _bar_class(bar, stop):
    return type("ForwardBar", (_ForwardBar,), {"bar": bar, "stop": stop})


def _transfer(repo_id: str, commit: str, rf: RemoteFile, part: Path, bar, stop) -> None:
    """Append the missing tail of `rf` to `part` (a Range request when part already holds bytes)."""
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if have > rf.size:  # cannot be a prefix of this file
        part.unlink()
        have = 0
    url = hf_hub_url(repo_id, rf.path, revision=commit)
    headers = build_hf_headers(library_name="ktconvert")
    with open(part, "ab") as f:
        http_get(url, f, resume_size=have, headers=headers, expected_size=rf.size, tqdm_class=_bar_class(bar, stop))


def fetch_file(repo_id: str, commit: str, rf: RemoteFile, local_dir: Path, bar=None, warn=print, stop=None) -> str:
    """Download (or finish downloading) `rf` into `local_dir`, verify it, move it in place; return its sha256.

    A verification failure removes the bad bytes, re-downloads the file once from the start and raises
    VerifyError (naming the file) if the second copy is wrong too; nothing is left at the final path then.
    """
    dest = local_dir / rf.path
    part = partial_path(local_dir, rf)
    for attempt in (1, 2):
        _transfer(repo_id, commit, rf, part, bar, stop)
        try:
            digest = check_content(part, rf)
        except VerifyError as e:
            part.unlink(missing_ok=True)
            if bar is not None:
                bar.update(-rf.size)
            if attempt == 2:
                raise VerifyError(f"{e} (second download, giving up)") from None
            warn(f"warning: {e}; downloading {rf.path} again")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, dest)
        return digest
    raise AssertionError("unreachable")
