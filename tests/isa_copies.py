"""The kernels' ISA copies side by side: a script run in a fresh process per backend this CPU runs
(KT_KERNEL_BACKEND=scalar, the baseline copy that is the SIMD copies' twin; avx2; avx512), its output kept."""
from __future__ import annotations

import os
import subprocess
import sys

from ktrun.ops.library import backend_supported


def outputs_per_isa(code: str, timeout: int = 120) -> dict[str, str]:
    """backend -> the stripped stdout of `python -c code` under that KT_KERNEL_BACKEND (a failing run fails)."""
    out = {}
    for backend in ("scalar", "avx2", "avx512"):
        if backend != "scalar" and not backend_supported(backend):
            continue
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KT_KERNEL_BACKEND": backend},
                           capture_output=True, text=True, timeout=timeout, check=False)
        assert r.returncode == 0, f"{backend}: {r.stderr}"
        out[backend] = r.stdout.strip()
    return out
