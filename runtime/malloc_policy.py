"""The command lines' glibc malloc settings: a process keeps the memory it frees, so the next array reuses warm pages.
Here in ktrun because both command lines set them: `ktrun` (keep_warm_heap) and `ktconvert` (keep_freed_memory,
keep_large_arrays); library users keep their allocator as it is.

A conversion allocates and frees arrays of tens of MB, tensor after tensor. By default glibc gives freed memory back
to the kernel (heap trimming above a dynamic threshold, one arena per thread, each trimmed on its own), and the next
tensor's arrays are fresh pages the kernel must zero on first touch. On a VM that hands freed guest memory back to
the host (free page reporting) a first touch is slower still: measured on this project's 2-core KVM guest, 0.4-0.9
GiB/s for memory freed a few seconds earlier against 10 GiB/s for warm pages. `ktconvert` sets, once at its start:
  M_ARENA_MAX 1             the pack workers share the main heap, so one worker's freed arrays serve the next
                            (large allocations: the lock is taken once per tens of MB);
  M_MMAP_THRESHOLD 32 MiB   arrays up to glibc's largest allowed threshold come from the heap (a fixed value also
                            stops the threshold from moving with every free);
  M_TRIM_THRESHOLD 2 GiB    freed heap memory stays with the process (its peak RSS is what it held anyway).
Arrays above 32 MiB are mmapped by glibc whatever the threshold: the converter reads its large tensors into buffers
it reuses (pipeline._read_reused). On bench_convert.py's DeepSeek-V3-shaped checkpoint (rtn experts, 2 workers, Zen
4 KVM guest) system time went from 4.9-6.4 s to 3.6-4.9 s, peak RSS from 1.7-1.8 to 1.4-1.6 GB.

A calibrated conversion also runs the calibration forward, whose activations (hundreds of MB per layer: the
attention's queries, keys and values of 2048 tokens) and per-matrix temporaries are torch's and the quantizers',
allocated and freed again and again above that threshold. For it the command line also sets
  M_MMAP_MAX 0              every array comes from the heap, so freed ones are reused warm (keep_large_arrays).
Measured on the DeepSeek-V3-shaped checkpoint (Zen 3 KVM guest, 2 cores): the calibrated default 109.8 -> 93.4 s wall,
system time 32.9 -> 17.5 s, peak RSS 5.56 -> 5.78 GB; not for rtn, where it changed nothing but the peak RSS (1.4-1.7
-> 1.9-2.0 GB, wall 23-24 vs 25 s).

`ktrun` (every subcommand, set by its command line group before the model loads) keeps its activations' arrays in
the heap the same way (keep_warm_heap: M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB; one arena per thread as glibc's default,
the server's threads allocate small things). A prompt's forward allocates and frees arrays above 32 MiB at every
layer (DeepSeek-V3's 512-token chunk: kv_b_proj's output 67 MB, q_b_proj's 50 MB, the attention's input to o_proj
34 MB), and each was a fresh mapping the kernel zeroed page by page, from the kernel pool's threads too. Measured on
the DeepSeek-V3-shaped int4 bench model (bench_vs_llamacpp.py's, Zen 4 KVM guest, 2 threads, the two policies
alternated in one process): pp512 149.9 -> 169.7 tok/s (medians of 8 prompts); Qwen3-30B-A3B's shape (hidden 2048,
smaller arrays) unchanged; the process's RSS after one such prompt 2035 -> 2241 MB (its freed arrays kept).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -3, -4, -8      # glibc <malloc.h>
KEEP = (1 << 31) - 1                 # M_TRIM_THRESHOLD 2 GiB (mallopt takes an int): freed heap memory stays
POLICY = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, KEEP))    # the converter's
LARGE_ARRAYS = ((M_MMAP_MAX, 0),)                                   # a calibrated conversion's, on top of POLICY
WARM_HEAP = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP))             # ktrun's

log = logging.getLogger(__name__)


def _glibc():
    """The process's glibc (ctypes), or None where the C library is not glibc."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
    except (AttributeError, ValueError, OSError):      # not a glibc system (or no confstr at all)
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _apply(settings) -> bool | None:
    """mallopt each (param, value); None where the C library is not glibc, else whether it took every one."""
    libc = _glibc()
    if libc is None:
        return None
    return all(libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1 for param, value in settings)


def keep_freed_memory() -> bool:
    """Apply POLICY through mallopt; False (nothing changed) where the C library is not glibc."""
    ok = _apply(POLICY)
    if ok is False:
        log.debug("mallopt refused part of the converter's malloc policy")
    return bool(ok)


def keep_large_arrays() -> bool:
    """M_MMAP_MAX 0 (no array mmapped by malloc: large ones reused from the heap too), for a calibrated conversion
    (module docstring); False where the C library is not glibc or refused it."""
    return bool(_apply(LARGE_ARRAYS))


def keep_warm_heap() -> bool:
    """`ktrun`'s policy (module docstring): every array from the heap, freed heap memory kept; False where the C
    library is not glibc or refused it."""
    return bool(_apply(WARM_HEAP))
