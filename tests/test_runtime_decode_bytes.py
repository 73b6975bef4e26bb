"""`ktrun bench`'s roofline lines (weight bytes per decoded token, achieved GB/s vs the read bandwidth measured in
the same run) and the peak RSS of `ktrun generate` (<= the bare interpreter's + converted directory + KV cache + 100 MB), as subprocesses."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from ktlayouts.cpu_linear import linear_geometry
from ktlayouts.gpu_formats import gpu_format
from ktrun.ops.library import kernels_available
from runtime_helpers import KTRUN, PROMPT, converted

pytestmark = pytest.mark.skipif(not kernels_available(), reason="libktkernels not built (make kernels)")
GPU = {"gpu_method": "rtn-int4", "gpu_format": "marlin", "gpu_group_size": 64, "quantize_head": True}


def _bench(conv, *args) -> dict[str, str]:
    r = subprocess.run([*KTRUN, "bench", str(conv), "--pp", "8", "--tg", "4", "--reps", "1", *args],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(re.findall(r"^(\w+): (.+)$", r.stdout, re.MULTILINE)) | {"_out": r.stdout}


def _mb(text: str, part: str) -> float:
    return float(re.search(rf"{part} ([\d.]+) MB", text).group(1))


def test_bench_prints_bytes_per_token_and_bandwidth_fraction(tmp_path_factory):
    conv = converted(tmp_path_factory, "deepseek_v3", "int4-amx", **GPU)
    manifest = json.loads((conv / "manifest.json").read_text())
    cfg = json.loads((conv / "config.json").read_text())
    # independent counts from the manifest: top_k experts of every MoE layer; the head's cpu-linear tiles
    ex = manifest["experts"]
    expert_files = [f for f in manifest["files"].values() if f["kind"] == "expert"]
    per_expert = sum(t["nbytes"] for f in expert_files for t in f["tensors"].values()) / len(ex["moe_layers"]) \
        / ex["n_experts"]
    want_experts = len(ex["moe_layers"]) * cfg["num_experts_per_tok"] * per_expert
    head = next(t for f in manifest["files"].values() for n, t in f.get("tensors", {}).items()
                if n.startswith("lm_head.") and n.endswith(gpu_format(t["layout"]).primary))
    # the op's K is the hidden size rounded up to the group (Marlin stores it padded with zero-point codes)
    g = linear_geometry(cfg["vocab_size"], -(-cfg["hidden_size"] // 64) * 64, gpu_format(head["layout"]).bits, 64)
    want_head = int(np.prod(g.qweight_shape)) + 4 * int(np.prod(g.scales_shape))
    got = _bench(conv)
    read = got["weights_read_per_token"]
    assert abs(_mb(read, "experts") - want_experts / 1e6) < 2e-3, (read, want_experts)
    assert abs(_mb(read, "head") - want_head / 1e6) < 2e-3, (read, want_head)
    total = float(read.split()[0])
    assert abs(total - _mb(read, "experts") - _mb(read, "dense") - _mb(read, "head")) < 5e-3
    achieved = float(got["decode_weight_read"].split()[0])
    bw = float(got["read_bandwidth_measured"].split()[0])
    assert bw > 0 and abs(float(got["decode_fraction_of_bandwidth"]) - achieved / bw) < 2e-3
    # the dequantized-at-load path reads the same experts and head bytes... but float32 dense weights
    deq = _bench(conv, "--gpu-weights", "dequant")["weights_read_per_token"]
    assert _mb(deq, "experts") == _mb(read, "experts")
    assert _mb(deq, "dense") > 3 * _mb(read, "dense") - 0.5 and _mb(deq, "head") > 4 * _mb(read, "head")


def _dir_bytes(root) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(root) for f in fs)


_HWM = ("import atexit, sys; atexit.register(lambda: print('VmHWM', open('/proc/self/status').read()"
        ".split('VmHWM:')[1].split()[0], file=sys.stderr)); ")


def _vmhwm(stderr: str) -> int:
    return int(re.search(r"VmHWM (\d+)", stderr).group(1)) * 1024


def test_generate_peak_rss_within_directory_plus_kv_plus_100mb_over_the_interpreter(tmp_path_factory):
    conv = converted(tmp_path_factory, "deepseek_v3", "int4-amx", **GPU)
    cfg = json.loads((conv / "config.json").read_text())
    ctx = 512
    kv = cfg["num_hidden_layers"] * ctx * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4   # float32 latent
    # VmHWM of the ktrun process itself, printed at exit (ru_maxrss would carry pytest's RSS over fork + exec)
    r = subprocess.run([sys.executable, "-c", _HWM + "from ktrun.cli import main; main()", "generate", str(conv),
                        "--prompt", PROMPT, "--max-tokens", "16", "--ignore-eos", "--json", "--ctx", str(ctx)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(json.loads(r.stdout)["token_ids"]) == 16
    # the floor measured in the same run on this machine: an interpreter with the same libraries imported and
    # torch's thread pool started (its size follows the core count), holding no model
    floor_src = ("import numpy, tokenizers, torch, ktrun.cli, ktrun.engine, ktrun.experts.executors; "
                 "torch.ones(64, 64) @ torch.ones(64, 64)")
    base = subprocess.run([sys.executable, "-c", _HWM + floor_src], capture_output=True, text=True, timeout=300,
                          check=True)
    peak, floor = _vmhwm(r.stderr), _vmhwm(base.stderr)
    limit = floor + _dir_bytes(conv) + kv + 100 * 2**20
    assert peak <= limit, (f"peak RSS {peak / 2**20:.0f} MiB > {limit / 2**20:.0f} MiB "
                           f"(interpreter floor {floor / 2**20:.0f} MiB)")
