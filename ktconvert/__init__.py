"""ktconvert: turn huge Mixture-of-Experts checkpoints into CPU expert files and GPU layers."""
import os

# torch's CPU allocator maps tensors of 2 MB and more on transparent huge pages (madvise) with this set. A conversion
# makes many short-lived tensors of tens of MB; on 4 KB pages their first touches were 7 M page faults and as much
# system time as user time (rtn conversion of bench/bench_convert.py's DeepSeek-V3-shaped checkpoint: 33 s -> 22 s
# wall). numpy does the same by default. Read once, at torch's first allocation: effective only if torch is not
# loaded yet (the CLI imports this package first).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# The calibration forward and the pack workers run torch from different threads at the same time: OpenMP threads
# that spin while idle would take the cores from each other (ktrun sets the same for its kernels).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
