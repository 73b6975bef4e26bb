"""Shared pytest fixtures: tiny hub-layout checkpoints built once per test session.

    def test_something(ckpt_dir, fp8_ckpt, ckpt_copy):
        src = ckpt_dir("mixtral")          # shared, read-only: never modify it
        fp8 = fp8_ckpt                     # deepseek_v3 in DeepSeek's FP8 release format
        mine = ckpt_copy("qwen3_moe")      # a private copy in tmp_path: corrupt it freely
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

# Each pytest-xdist worker (and every subprocess it starts: the environment is inherited) gets its share of the
# cores for torch's OpenMP pool, before torch is imported: 2 workers x 2 OpenMP threads on 2 cores spin against each
# other (measured on a 73-test slice: 120 s -> 22 s). An explicit OMP_NUM_THREADS wins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))
# The fixtures' conversions calibrate in float32 on every host: `auto` takes bf16 matmuls only where the CPU has bf16
# dot products, which would make every calibrated fixture (and the numeric bounds measured on it) depend on the CPU
# the suite runs on. The bf16 forward has its own tests (test_quantizers.py, test_gpu_calibration.py).
os.environ.setdefault("KTCONVERT_CALIB_MATMUL", "float32")

import pytest
from run_shared import built_once, run_dir

from ktconvert.testing import ARCHS, make_checkpoint


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """Callable arch -> Path of a run-wide BF16 checkpoint (default tiny dims, seed 0; built once for all xdist
    workers). Do not modify it."""
    def get(arch: str) -> Path:
        if arch not in ARCHS:
            raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
        return built_once(run_dir(tmp_path_factory) / f"ckpt_{arch}", lambda out: make_checkpoint(arch, out))

    return get


@pytest.fixture(scope="session")
def fp8_ckpt(tmp_path_factory) -> Path:
    """Session-wide deepseek_v3 checkpoint in FP8 release format (same seed/weights as ckpt_dir('deepseek_v3'))."""
    return built_once(run_dir(tmp_path_factory) / "ckpt_deepseek_v3_fp8",
                      lambda out: make_checkpoint("deepseek_v3", out, fp8=True))


@pytest.fixture(scope="session")
def default_converted(tmp_path_factory) -> Path:
    """The shipped default model (ktconvert/data/default_model) converted once per run by `ktconvert quantize`
    (int4 experts, RTN int4 GPU layers: no calibration, fast). Do not modify it."""
    import subprocess
    import sys

    import ktconvert

    src = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"

    def build(out: Path) -> None:
        subprocess.run([str(Path(sys.executable).parent / "ktconvert"), "quantize", str(src), "-o", str(out),
                        "--gpu-method", "rtn-int4", "--quiet"], check=True, capture_output=True)
    # one conversion for every xdist worker; the directory keeps its name (tests read the model's name from it)
    return built_once(run_dir(tmp_path_factory) / "default_converted" / "default-model", build)


@pytest.fixture
def ckpt_copy(ckpt_dir, fp8_ckpt, tmp_path):
    """Callable arch -> a private copy (in tmp_path) of the session checkpoint, safe to corrupt. 'deepseek_v3_fp8'
    copies the FP8 one."""
    def copy(arch: str) -> Path:
        src = fp8_ckpt if arch == "deepseek_v3_fp8" else ckpt_dir(arch)
        return Path(shutil.copytree(src, tmp_path / f"copy_{arch}"))

    return copy


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    """Parametrizes a test over every fixture architecture."""
    return request.param


@pytest.fixture(scope="module")
def kernel_pool():
    """A 2-worker kernel context (ktrun.ops.moe.MoEKernels) for a module's tests of ops on its pool."""
    from ktrun.ops.moe import MoEKernels

    k = MoEKernels(n_threads=2)
    yield k
    k.close()
