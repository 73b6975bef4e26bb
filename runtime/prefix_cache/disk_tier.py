"""The disk tier: cache entries (KV blocks, recurrent-state snapshots) as checksummed files in a folder
(`--prefix-cache-dir`), under a byte budget, least recently used first out, kept across server restarts. The file
format is ktlayouts.kv_block_file (one suffix per entry kind).

- Written atomically (temporary name, fsync, rename): a crash leaves a whole file or a `.tmp-` file, which the next
  start deletes. Room is made before writing, so the folder never holds more than the budget, temporary file included.
- Recency is the files' mtimes (set in LRU order at shutdown, and new files are newest), so the LRU order survives a
  restart; at start the folder is scanned and trimmed to the budget.
- A prefix's blocks are read by a few threads at once (get_many), so the disk sees them together.
- Any file that fails its checks (magic, checksum, safetensors header, key, model identity, layout, shapes, dtypes)
  is deleted and counted in `corrupt`; the caller recomputes what it held.
- One server per folder: an exclusive lock on `<dir>/.lock` refuses a second one.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ktlayouts import kv_block_file as kvf
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .ram_tier import BlockData, EntryKind

READ_THREADS = 4


class DiskTierError(OSError):
    """The prefix-cache folder cannot be used (not writable, or another server holds it)."""


class DiskTier:
    def __init__(self, root: str | Path, budget_bytes: int, identity_hex: str, kinds: list[EntryKind]):
        """kinds: the entry kinds it holds (a KV block, a state snapshot), each with its own file suffix."""
        self.root = Path(root)
        self._root = str(self.root)
        self.budget = max(0, int(budget_bytes))
        self.identity = identity_hex
        self.by_suffix = {k.suffix: k for k in kinds}
        self.kind_of: dict[bytes, EntryKind] = {}
        self._count: dict[str, int] = {}                            # files by kind (read by /metrics' thread)
        self.files: OrderedDict[bytes, int] = OrderedDict()          # key -> file size, oldest first
        self.bytes = self.peak_bytes = 0
        self.corrupt = self.reads = self.writes = self.write_errors = 0
        self._readers: ThreadPoolExecutor | None = None
        self._touched = False                                       # hits since the recency was last saved
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
                key, kind = kvf.key_of(p.name), self.by_suffix.get(kvf.suffix_of(p.name))
                if key is not None and kind is not None and key[:2] == sub.name:
                    st = p.stat()
                    found.append((st.st_mtime_ns, bytes.fromhex(key), st.st_size, kind))
        for _, key, size, kind in sorted(found, key=lambda f: f[:3]):
            self._add(key, size, kind)
        self._make_room(0)
        self.peak_bytes = self.bytes

    def _path(self, key: bytes, kind: EntryKind | None = None) -> Path:
        return self.root / kvf.relpath(key.hex(), (kind or self.kind_of[key]).suffix)

    def count(self, kind: str) -> int:
        return self._count.get(kind, 0)

    def _add(self, key: bytes, size: int, kind: EntryKind) -> None:
        self.files[key] = size
        self.kind_of[key] = kind
        self._count[kind.name] = self._count.get(kind.name, 0) + 1
        self.bytes += size

    def _forget(self, key: bytes) -> None:
        self.bytes -= self.files.pop(key)
        self._count[self.kind_of.pop(key).name] -= 1

    def __contains__(self, key: bytes) -> bool:
        return key in self.files

    def __len__(self) -> int:
        return len(self.files)

    def _drop(self, key: bytes) -> None:
        if key in self.files:
            self._path(key).unlink(missing_ok=True)
            self._forget(key)

    def _make_room(self, n: int) -> None:
        while self.files and self.bytes + n > self.budget:
            self._drop(next(iter(self.files)))

    # -- read ------------------------------------------------------------------------------------------------------
    def get(self, key: bytes) -> BlockData | None:
        """The entry's tensors (CPU), or None when absent or corrupt (a corrupt file is deleted)."""
        return self._account(key, self._load(key)) if key in self.files else None

    def get_many(self, keys: list[bytes]) -> list[BlockData | None]:
        """get() for several blocks, read and checked by READ_THREADS threads at once (a prefix's blocks: the disk
        sees them together instead of one request at a time)."""
        keys = [k for k in keys if k in self.files]
        if len(keys) <= 1:
            return [self.get(k) for k in keys]
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ktrun-kv-disk")
        return [self._account(k, r) for k, r in zip(keys, self._readers.map(self._load, keys))]

    def _load(self, key: bytes):
        """Read and check one file (any thread): its tensors, or the exception that says why not."""
        kind = self.kind_of[key]
        path = os.path.join(self._root, kvf.relpath(key.hex(), kind.suffix))   # (str paths: pathlib ~0.1 ms a block)
        try:
            with open(path, "rb", buffering=0) as f:
                raw = f.read()
            return self._decode(raw, key, path, kind)
        except (OSError, SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as e:
            return e                                   # (KVBlockFileError is a ValueError)

    def _account(self, key: bytes, result) -> BlockData | None:
        """The bookkeeping of one read, on the caller's thread."""
        if key not in self.files:
            return None
        if isinstance(result, FileNotFoundError):      # removed behind our back: just a miss
            self._forget(key)
            return None
        if isinstance(result, BaseException):
            print(f"ktrun: prefix cache: {self._path(key)}: corrupt block ignored, recomputing it ({result})",
                  file=sys.stderr, flush=True)
            self.corrupt += 1
            self._drop(key)
            return None
        self.reads += 1
        self.files.move_to_end(key)
        self._touched = True
        return result

    def save_recency(self) -> None:
        """Give the files mtimes in LRU order (oldest first), so the next start sees the same order (hits do not
        touch files one by one: a metadata write per hit)."""
        if not self._touched:
            return
        t0 = time.time_ns() - len(self.files) * 1000
        for i, key in enumerate(self.files):
            try:
                os.utime(self._path(key), ns=(t0 + 1000 * i, t0 + 1000 * i))
            except OSError:
                pass
        self._touched = False

    def _decode(self, raw: bytes, key: bytes, where: str, kind: EntryKind) -> BlockData:
        payload = kvf.unpack(raw, where)
        n = int.from_bytes(payload[:8], "little")
        if not 0 < n <= len(payload) - 8:
            raise kvf.KVBlockFileError(f"{where}: safetensors header length {n} out of range")
        meta = json.loads(payload[8:8 + n]).get("__metadata__") or {}
        for field, want in ((kvf.META_KEY, key.hex()), (kvf.META_IDENTITY, self.identity),
                            (kvf.META_LAYOUT, kind.layout)):
            if meta.get(field) != want:
                raise kvf.KVBlockFileError(f"{where}: {field} is {meta.get(field)!r}, expected {want!r}")
        tensors = st_load(payload)
        data = []
        for name, shape, dtype in zip(kind.names, kind.shapes, kind.dtypes):
            t = tensors.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                got = None if t is None else (tuple(t.shape), t.dtype)
                raise kvf.KVBlockFileError(f"{where}: tensor {name} is {got}, expected {(shape, dtype)}")
            data.append(t)
        if len(tensors) != len(kind.names):
            raise kvf.KVBlockFileError(f"{where}: {len(tensors)} tensors, expected {len(kind.names)}")
        return data

    # -- write -----------------------------------------------------------------------------------------------------
    def put(self, key: bytes, data: BlockData, kind: EntryKind) -> bool:
        """Store the entry (unless already there); False when it cannot (over the budget alone, or an OS error)."""
        if key in self.files:
            self.files.move_to_end(key)
            return True
        meta = {kvf.META_KEY: key.hex(), kvf.META_IDENTITY: self.identity, kvf.META_LAYOUT: kind.layout}
        raw = kvf.pack(st_save(dict(zip(kind.names, (t.contiguous() for t in data))), meta))
        if len(raw) > self.budget:
            return False
        self._make_room(len(raw))
        path = self._path(key, kind)
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
        self._add(key, len(raw), kind)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.writes += 1
        return True

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown()
            self._readers = None
        self.save_recency()
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()

