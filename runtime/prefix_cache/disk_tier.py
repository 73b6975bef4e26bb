"""The disk tier: blocks as checksummed files in a folder (`--prefix-cache-dir`), under a byte budget, least
recently used first out, kept across server restarts. The file format is ktlayouts.kv_block_file.

- Written atomically (temporary name, fsync, rename): a crash leaves a whole file or a `.tmp-` file, which the next
  start deletes. Room is made before writing, so the folder never holds more than the budget, temporary file included.
- Recency is the file's mtime (bumped on every hit), so the LRU order survives a restart; at start the folder is
  scanned and trimmed to the budget.
- Any file that fails its checks (magic, checksum, safetensors header, key, model identity, shapes, dtype) is deleted
  and counted in `corrupt`; the caller recomputes the block.
- One server per folder: an exclusive lock on `<dir>/.lock` refuses a second one.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

import torch
from ktlayouts import kv_block_file as kvf
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .ram_tier import BlockData


class DiskTierError(OSError):
    """The prefix-cache folder cannot be used (not writable, or another server holds it)."""


class DiskTier:
    def __init__(self, root: str | Path, budget_bytes: int, identity_hex: str, layout_text: str,
                 shapes: list[tuple[int, ...]], n_token_kinds: int, dtype: torch.dtype):
        self.root = Path(root)
        self.budget = max(0, int(budget_bytes))
        self.identity, self.layout_text = identity_hex, layout_text
        self.shapes, self.dtype = [tuple(s) for s in shapes], dtype
        self.names = [f"t{i}" for i in range(n_token_kinds)] + [f"s{i}" for i in range(len(shapes) - n_token_kinds)]
        self.files: OrderedDict[bytes, int] = OrderedDict()          # key -> file size, oldest first
        self.bytes = self.peak_bytes = 0
        self.corrupt = self.reads = self.writes = self.write_errors = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.root / ".lock", "a+")  # noqa: SIM115 -- held for the tier's lifetime
        except OSError as e:
            raise DiskTierError(f"--prefix-cache-dir {self.root}: cannot use it: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise DiskTierError(f"--prefix-cache-dir {self.root}: in use by another ktrun server "
                                f"(lock held on {self.root / '.lock'})") from None
        self._scan()

    def _scan(self) -> None:
        found = []
        for sub in self.root.iterdir():
            if not (sub.is_dir() and len(sub.name) == 2):
                continue
            for p in sub.iterdir():
                if kvf.TMP_MARK in p.name:             # an interrupted write
                    p.unlink(missing_ok=True)
                    continue
                key = kvf.key_of(p.name)
                if key is not None and key[:2] == sub.name:
                    st = p.stat()
                    found.append((st.st_mtime_ns, bytes.fromhex(key), st.st_size))
        for _, key, size in sorted(found):
            self.files[key] = size
            self.bytes += size
        self._make_room(0)
        self.peak_bytes = self.bytes

    def _path(self, key: bytes) -> Path:
        return self.root / kvf.relpath(key.hex())

    def __contains__(self, key: bytes) -> bool:
        return key in self.files

    def __len__(self) -> int:
        return len(self.files)

    def _drop(self, key: bytes) -> None:
        size = self.files.pop(key, None)
        if size is not None:
            self.bytes -= size
            self._path(key).unlink(missing_ok=True)

    def _make_room(self, n: int) -> None:
        while self.files and self.bytes + n > self.budget:
            self._drop(next(iter(self.files)))

    # -- read ------------------------------------------------------------------------------------------------------
    def get(self, key: bytes) -> BlockData | None:
        """The block's tensors (CPU), or None when absent or corrupt (a corrupt file is deleted)."""
        if key not in self.files:
            return None
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:                      # removed behind our back: just a miss
            self.bytes -= self.files.pop(key)
            return None
        try:
            data = self._decode(raw, key, str(path))
        except (kvf.KVBlockFileError, ValueError, KeyError, TypeError, RuntimeError, json.JSONDecodeError) as e:
            print(f"ktrun: prefix cache: {path}: corrupt block ignored, recomputing it ({e})", file=sys.stderr,
                  flush=True)
            self.corrupt += 1
            self._drop(key)
            return None
        self.reads += 1
        self.files.move_to_end(key)
        try:
            os.utime(path)
        except OSError:
            pass
        return data

    def _decode(self, raw: bytes, key: bytes, where: str) -> BlockData:
        payload = kvf.unpack(raw, where)
        n = int.from_bytes(payload[:8], "little")
        if not 0 < n <= len(payload) - 8:
            raise kvf.KVBlockFileError(f"{where}: safetensors header length {n} out of range")
        meta = json.loads(payload[8:8 + n]).get("__metadata__") or {}
        for field, want in ((kvf.META_KEY, key.hex()), (kvf.META_IDENTITY, self.identity),
                            (kvf.META_LAYOUT, self.layout_text)):
            if meta.get(field) != want:
                raise kvf.KVBlockFileError(f"{where}: {field} is {meta.get(field)!r}, expected {want!r}")
        tensors = st_load(payload)
        data = []
        for name, shape in zip(self.names, self.shapes):
            t = tensors.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != self.dtype:
                got = None if t is None else (tuple(t.shape), t.dtype)
                raise kvf.KVBlockFileError(f"{where}: tensor {name} is {got}, expected {(shape, self.dtype)}")
            data.append(t)
        if len(tensors) != len(self.shapes):
            raise kvf.KVBlockFileError(f"{where}: {len(tensors)} tensors, expected {len(self.shapes)}")
        return data

    # -- write -----------------------------------------------------------------------------------------------------
    def put(self, key: bytes, data: BlockData) -> bool:
        """Store the block (unless already there); False when it cannot (over the budget alone, or an OS error)."""
        if key in self.files:
            self.files.move_to_end(key)
            return True
        meta = {kvf.META_KEY: key.hex(), kvf.META_IDENTITY: self.identity, kvf.META_LAYOUT: self.layout_text}
        raw = kvf.pack(st_save(dict(zip(self.names, (t.contiguous() for t in data))), meta))
        if len(raw) > self.budget:
            return False
        self._make_room(len(raw))
        path = self._path(key)
        tmp = path.with_name(f"{path.name}{kvf.TMP_MARK}{os.getpid()}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.write_errors += 1
            if self.write_errors == 1:
                print(f"ktrun: prefix cache: cannot write {path}: {e.strerror or e} (blocks stay in RAM only)",
                      file=sys.stderr, flush=True)
            return False
        self.files[key] = len(raw)
        self.bytes += len(raw)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.writes += 1
        return True

    def close(self) -> None:
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()

