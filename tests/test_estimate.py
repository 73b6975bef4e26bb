"""The conversion time estimate (ktconvert.estimate): printed by `ktconvert inspect --method` and by `quantize` at
start, in real subprocesses, and held against the wall time of the conversion it describes. The 25% claim is
bench_convert.py's (a quiet machine); here, under a test run's load, a loose bound."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ktconvert import estimate
from ktconvert.default_model.demo import DEFAULT_MODEL

LINE = re.compile(r"estimated conversion time on this machine: ([0-9.]+) (s|min|h)(?: = ([0-9]+) s)? \((.*)\)")


def _seconds(text: str) -> tuple[float, str]:
    m = LINE.search(text)
    assert m, text[-3000:]
    value = float(m.group(3)) if m.group(3) else float(m.group(1)) * {"s": 1, "min": 60, "h": 3600}[m.group(2)]
    return value, m.group(4)


def _ktconvert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ktconvert", *args], capture_output=True, text=True, timeout=600,
                          check=False)


def test_routing_share_and_durations():
    assert estimate.share_at_or_above(1024, 1024) == pytest.approx(0.5)
    assert estimate.share_at_or_above(80, 512) > 0.999           # the default model's down: GPTQ everywhere
    assert estimate.share_at_or_above(1024, 64) < 1e-6            # DeepSeek-V3's 256 experts: GPTQ nowhere
    assert estimate._dur(4.26) == "4.3 s" and estimate._dur(95) == "95 s" and estimate._dur(1800) == "30 min"
    assert estimate._dur(3 * 3600) == "3.0 h"
    assert 0 < estimate.process_age() < 24 * 3600


def test_inspect_prints_the_estimate(ckpt_dir):
    d = ckpt_dir("deepseek_v3")
    rtn = _ktconvert("inspect", str(d), "--method", "int4-amx", "--expert-quantizer", "rtn", "--gpu-method",
                     "rtn-int4")
    assert rtn.returncode == 0, rtn.stderr
    seconds, parts = _seconds(rtn.stdout)
    assert seconds > 0 and "experts" in parts and "dense" in parts and "forward" not in parts
    assert "architecture: deepseek_v3" in rtn.stdout                   # the usual report is still there
    cal = _ktconvert("inspect", str(d), "--method", "int4-amx", "--gpu-method", "gptq-int4")
    assert cal.returncode == 0, cal.stderr
    assert "forward" in _seconds(cal.stdout)[1]                        # a calibrated conversion runs a forward


def test_the_tile_forward_is_estimated_with_its_own_rate():
    """KTCONVERT_CALIB_MATMUL=kernels (experts calibrated on their own pass): the estimate times the int4 tiles'
    product and their quantizing and puts the prior's rows into the forward; torch's float32 rate as the reference."""
    from ktrun.ops.library import kernels_available

    if not kernels_available():
        pytest.skip("libktkernels not built")
    rate, per_weight = estimate._tile_rate(256, 160)
    assert rate > 0 and per_weight > 0
    env_run = subprocess.run([sys.executable, "-m", "ktconvert", "inspect", str(DEFAULT_MODEL), "--method",
                              "int4-amx", "--gpu-method", "rtn-int4"], capture_output=True, text=True, timeout=600,
                             check=False, env={**os.environ, "KTCONVERT_CALIB_MATMUL": "kernels"})
    assert env_run.returncode == 0, env_run.stderr
    assert "forward" in _seconds(env_run.stdout)[1]


def test_inspect_estimate_needs_a_checkpoint(ckpt_dir, tmp_path):
    out = tmp_path / "conv"
    done = _ktconvert("quantize", str(ckpt_dir("qwen3_moe")), "-o", str(out), "--gpu-method", "bf16",
                      "--expert-quantizer", "rtn", "--quiet")
    assert done.returncode == 0, done.stderr
    _seconds(done.stderr)                                              # quantize logged its estimate first
    bad = _ktconvert("inspect", str(out), "--method", "int4-amx")
    assert bad.returncode != 0 and "converted directory" in bad.stderr


def test_quantize_estimate_against_its_wall_time(tmp_path):
    """`make demo`'s conversion of the embedded default model: the estimate it prints against its wall time."""
    t = time.perf_counter()
    done = _ktconvert("quantize", str(DEFAULT_MODEL), "-o", str(tmp_path / "out"), "--method", "int4-amx",
                      "--gpu-method", "gptq-int4", "--quiet")
    wall = time.perf_counter() - t
    assert done.returncode == 0, done.stderr
    seconds, parts = _seconds(done.stderr)
    assert "forward" in parts and "startup" in parts
    assert 0.4 < seconds / wall < 2.5, (seconds, wall, parts)
    assert not list(Path(tmp_path / "out").glob(".ktconvert-estimate-*"))   # the write sample is gone


def test_the_samples_clock_leaves_out_the_imports_beside_them(monkeypatch):
    """The samples are CPU seconds of this process less those of transformers' imports running beside them on their
    own thread: a second of pure-Python work on that thread does not reach the clock, the same second on the
    calling thread does; a failed import is kept for the caller's own import to raise."""
    def spin(_src):
        end = time.thread_time() + 0.4
        while time.thread_time() < end:
            pass

    monkeypatch.setattr(estimate, "_import_calibration", spin)
    imports = estimate._Imports(None)
    clock = estimate._CpuClock(imports)
    t = clock()
    imports.start()
    imports.join()
    assert imports.final >= 0.4 and imports.error is None
    assert clock() - t < 0.1
    t = clock()
    spin(None)
    assert clock() - t >= 0.35

    def fail(_src):
        raise ImportError("no modeling module")

    monkeypatch.setattr(estimate, "_import_calibration", fail)
    broken = estimate._Imports(None)
    broken.start()
    broken.join()
    assert isinstance(broken.error, ImportError) and broken.final is not None
