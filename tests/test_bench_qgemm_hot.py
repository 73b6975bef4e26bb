"""bench/bench_qgemm_hot.py as a real subprocess: it builds bench/qgemm_hot.cpp against the kernel body of this
checkout (so the bench keeps compiling as kernels/src changes) and prints its rate lines."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ktrun.ops.library import backend_supported

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_qgemm_hot.py"


@pytest.mark.skipif(not backend_supported("avx512") or shutil.which("g++") is None,
                    reason="needs an AVX-512 VNNI CPU and g++")
def test_hot_bench_prints_rates_and_the_memory_ratio():
    r = subprocess.run([sys.executable, str(BENCH), "--tokens", "1", "--rounds", "1", "--probe-mb", "64"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = dict(re.findall(r"^(\w+): ([\d.]+) ", r.stdout, re.MULTILINE))
    for case in ("int4_f16_g64", "int4_sub6_g32", "int8_f16_g32"):
        assert float(lines[f"qgemm_hot_{case}_T1"]) > 0
        assert float(lines[f"qgemm_hot_{case}_T1_over_memory"]) > 0
    assert float(lines["qgemm_hot_T1_sub6_g32_vs_f16_g64"]) > 0
    assert float(lines["read_bandwidth_1t"]) > 0
