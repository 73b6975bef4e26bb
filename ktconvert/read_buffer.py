"""Tensors read together, decoded side by side into one float32 buffer that the next read reuses.

A conversion reads gigabytes in tensors of tens of MB. Fresh arrays each time were fresh pages for the kernel to
zero on first touch (arrays above glibc's 32 MiB mmap threshold are new mappings every time), most of an rtn
conversion's system time, and slow on a VM guest that hands freed memory back to its host. So each reader keeps
one buffer: the pipeline one per reading thread (pipeline._read_reused), the calibration forward one for a layer's
tensors and one for the expert it runs (ktconvert.gpu.calib). What a read returns is valid until the same buffer is
read into again.
"""
from __future__ import annotations

import numpy as np
import torch


def floats_for(src, names: list[str], limit: int | None = None) -> int:
    """Floats of the buffer that `names` (read together) are decoded into side by side; 0 where they are not (a
    source that cannot decode into a buffer (Source.read's out), another encoding, or more than `limit`)."""
    infos = [src.info(n) for n in names]
    if any(getattr(i, "dtype", None) not in getattr(src, "reads_into", ()) for i in infos):
        return 0
    n = sum(int(np.prod(i.shape)) for i in infos)
    return n if limit is None or n <= limit else 0


class ReadBuffer:
    """One reused float32 buffer (see the module docstring). limit: reads of more floats get new arrays."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.buf: np.ndarray | None = None

    def read(self, src, names: list[str], reserve: int = 0) -> list[torch.Tensor]:
        """The tensors as float32 (views of the buffer where the source can decode into it, else new arrays).
        reserve: floats to allocate at least when the buffer is (re)made."""
        need = floats_for(src, names, self.limit)
        if not need:
            return [src.read(n) for n in names]
        if self.buf is None or self.buf.size < need:
            self.buf = None                                  # the old one freed before the new one is touched
            self.buf = np.empty(max(need, reserve), np.float32)
        out, at = [], 0
        for n in names:
            shape = tuple(src.info(n).shape)
            size = int(np.prod(shape))
            out.append(src.read(n, out=self.buf[at:at + size].reshape(shape)))
            at += size
        return out
