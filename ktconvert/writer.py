"""Streaming safetensors writer with every tensor 64-byte aligned in its file.

The header is written first (all shapes are known up front), then tensor data is written piece by piece with
pwrite at known offsets, so a stacked (E, ...) tensor can be filled one expert at a time and peak memory stays at
one expert. The file is written as NAME.partial and renamed to NAME (after fsync) only when complete.

safetensors requires the data offsets to be contiguous and to cover the whole buffer, so a tensor whose size is
not a multiple of 64 is followed by a U8 filler tensor `__pad__.N` (readers ignore those names). The JSON header
is padded with spaces so the data buffer starts at a multiple of 64.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ktlayouts.constants import FILE_ALIGN
from ktlayouts.converted_dir import PAD_PREFIX, PARTIAL_SUFFIX
from ktlayouts.files import sha256_file

DTYPE_SIZE = {"U8": 1, "I8": 1, "BF16": 2, "F16": 2, "I16": 2, "U16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str            # safetensors dtype string, e.g. "U8", "BF16", "F32"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def _pad_to(x: int, a: int = FILE_ALIGN) -> int:
    return (x + a - 1) // a * a


def build_header(specs: list[TensorSpec], metadata: dict[str, str] | None) -> tuple[bytes, dict[str, int], int]:
    """-> (8-byte length + JSON header padded so data starts 64-aligned, {name: absolute offset}, file size)."""
    entries, offsets, pos, n_pad = {}, {}, 0, 0
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for spec in specs:
        if spec.name in entries or spec.name.startswith(PAD_PREFIX):
            raise ValueError(f"tensor name {spec.name!r} is duplicated or reserved")
        entries[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [pos, pos + spec.nbytes]}
        offsets[spec.name] = pos
        pos += spec.nbytes
        if pos % FILE_ALIGN:
            end = _pad_to(pos)
            entries[f"{PAD_PREFIX}{n_pad}"] = {"dtype": "U8", "shape": [end - pos], "data_offsets": [pos, end]}
            n_pad, pos = n_pad + 1, end
    raw = json.dumps(entries, separators=(",", ":")).encode()
    header_len = _pad_to(8 + len(raw)) - 8
    header = struct.pack("<Q", header_len) + raw + b" " * (header_len - len(raw))
    base = len(header)
    return header, {k: base + v for k, v in offsets.items()}, base + pos


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AlignedWriter:
    """with AlignedWriter(path, specs, metadata) as w: w.write(name, array, index=e) ...; size, sha = w.commit()."""

    def __init__(self, path: str | Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.specs = {s.name: s for s in specs}
        header, self.offsets, self.size = build_header(specs, metadata)
        self.written = {s.name: 0 for s in specs}          # bytes written per tensor, to check completeness
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._pwrite(header, 0)
        except BaseException:
            self.abort()
            raise

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                n = os.pwrite(self.fd, view, offset)
            except OSError as e:       # name the file (ENOSPC / EFBIG carry none)
                raise OSError(e.errno, e.strerror, str(self.partial)) from None
            view, offset = view[n:], offset + n

    def write(self, name: str, array: np.ndarray, index: int | None = None) -> None:
        """Write the whole tensor, or with index=e its slice [e] along the first axis (a stacked expert)."""
        spec = self.specs[name]
        a = np.ascontiguousarray(array)
        offset = self.offsets[name]
        if index is None:
            want = spec.nbytes
        else:
            want = spec.nbytes // spec.shape[0]
            if not 0 <= index < spec.shape[0]:
                raise IndexError(f"{name}: slice {index} outside {spec.shape[0]}")
            offset += index * want
        if a.nbytes != want:
            raise ValueError(f"{self.path.name}:{name}: got {a.nbytes} bytes, expected {want}")
        self._pwrite(a.reshape(-1).view(np.uint8), offset)
        self.written[name] += want

    def commit(self) -> tuple[int, str]:
        """Check every byte was written, fsync, rename NAME.partial -> NAME; returns (size, sha256)."""
        short = [n for n, s in self.specs.items() if self.written[n] != s.nbytes]
        if short:
            self.abort()
            raise RuntimeError(f"{self.path}: tensors not fully written: {short}")
        # the padding regions are zeros: ftruncate to the full size leaves any unwritten tail as zeros
        os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        sha = sha256_file(self.partial)
        os.replace(self.partial, self.path)
        fsync_dir(self.path.parent)
        return self.size, sha

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.partial.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write data to path via path.partial + fsync + rename (+ fsync of the directory). A failed write (disk full)
    leaves no path.partial behind, and its OSError names `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if e.filename is None:        # write() / fsync() errors name no file
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    fsync_dir(path.parent)
