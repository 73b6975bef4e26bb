"""Hot experts from the command line, as real subprocesses: `ktconvert profile` (checked against transformers' own
router on the source checkpoint), `ktconvert quantize --profile` writing the placement, `ktconvert inspect` and
`ktrun bench` printing the profile summary, the memory plan and `gpu_hit_ratio`, and `ktrun serve` reporting the hit
ratio and swaps in /metrics."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ktlayouts.expert_placement import PLACEMENT_NAME, ExpertPlacement
from ktlayouts.expert_profile import ExpertProfile
from ktrun.experts.placement import Budget, hit_ratio, plan_placement
from runtime_helpers import KTRUN, transformers_model, transformers_tokenizer
from serve_helpers import ServerProcess, metric, request

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "ktconvert" / "data" / "default_model"
HELDOUT = (DEFAULT_MODEL / "heldout_eval.txt").read_text()
KTCONVERT = [sys.executable, "-m", "ktconvert"]


def run(argv, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([*map(str, argv)], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hotcli")
    (d / "fit.txt").write_text(HELDOUT[:6000])
    (d / "measure.txt").write_text(HELDOUT[20000:23000])        # < 2048 tokens: one sequence in bench and profile
    return d


@pytest.fixture(scope="module")
def conv(work) -> Path:
    out = work / "conv"
    r = run([*KTCONVERT, "quantize", DEFAULT_MODEL, "-o", out, "--method", "int4-amx", "--gpu-method", "bf16",
             "--quiet"])
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def fit_profile(work, conv) -> Path:
    out = work / "fit.json"
    r = run([*KTCONVERT, "profile", conv, "--prompts", work / "fit.txt", "-o", out, "--quiet"])
    assert r.returncode == 0, r.stderr
    return out


def test_profile_of_the_source_matches_transformers_routing(work):
    """`ktconvert profile` on the source checkpoint (ktrun's forward in float32 on the source tensors) counts the
    same routing transformers' DeepseekV3 router produces for the same tokens, chunk by chunk into the splits."""
    out = work / "source.json"
    r = run([*KTCONVERT, "profile", DEFAULT_MODEL, "--prompts", work / "fit.txt", "--max-tokens", 600,
             "--chunk-tokens", 200, "--heldout-every", 3, "-o", out])
    assert r.returncode == 0, r.stderr
    assert "profile: 600 tokens of fit.txt (fit 400, held-out 200)" in r.stdout and "entropy" in r.stdout
    prof = ExpertProfile.load(out)
    ids = transformers_tokenizer(DEFAULT_MODEL)((work / "fit.txt").read_text())["input_ids"][:600]
    model = transformers_model(DEFAULT_MODEL)
    seen: dict[int, tuple] = {}
    hooks = [layer.mlp.experts.register_forward_pre_hook(
        lambda _m, args, i=i: seen.__setitem__(i, (args[1].reshape(-1, 4).clone(), args[2].reshape(-1, 4).clone())))
        for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    assert sorted(seen) == list(prof.moe_layers)
    held = (np.arange(600) // 200) % 3 == 2
    for L, (topk, wts) in seen.items():
        for split, rows in (("fit", ~held), ("heldout", held)):
            want = np.bincount(topk.numpy()[rows].ravel(), minlength=16)
            got = prof.splits[split].counts[L]
            assert np.abs(got - want).sum() <= 0.01 * want.sum(), (L, split, got, want)
            mass = np.bincount(topk.numpy()[rows].ravel(), weights=wts.numpy()[rows].ravel(), minlength=16)
            assert np.allclose(prof.splits[split].mass[L], mass, rtol=0.02, atol=0.05)


def test_profile_options_and_errors(work, conv):
    out = work / "calib.json"
    r = run([*KTCONVERT, "profile", conv, "--calib", "--max-tokens", 300, "-o", out, "--quiet"])
    assert r.returncode == 0, r.stderr
    prof = ExpertProfile.load(out)
    assert prof.tokens() == 300 and prof.text["source"] == "calib" and len(prof.text["sha256"]) == 64
    (work / "p.jsonl").write_text('"def f(x):"\n{"prompt": "import os"}\n\n{"text": "class A:"}\n')
    r = run([*KTCONVERT, "profile", conv, "--prompts", work / "p.jsonl", "-o", work / "j.json", "--quiet"])
    assert r.returncode == 0, r.stderr and ExpertProfile.load(work / "j.json").tokens() > 3
    for argv, msg in [([], "exactly one of --prompts FILE and --calib"),
                      (["--calib", "--prompts", work / "p.jsonl"], "exactly one of"),
                      (["--prompts", work / "bad.jsonl"], "line 2 is neither a string nor an object")]:
        (work / "bad.jsonl").write_text('"ok"\n[1, 2]\n')
        r = run([*KTCONVERT, "profile", conv, *argv, "-o", work / "x.json"])
        assert r.returncode != 0 and msg in r.stderr, r.stderr
        assert not (work / "x.json").exists()


def test_quantize_writes_the_placement_and_ktrun_uses_it(work, conv, fit_profile):
    out = work / "placed"
    r = run([*KTCONVERT, "quantize", DEFAULT_MODEL, "-o", out, "--method", "int4-amx", "--gpu-method", "bf16",
             "--quiet", "--profile", fit_profile, "--gpu-experts-ratio", "0.25", "--placement", "per-layer"])
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["files"][PLACEMENT_NAME]["kind"] == "placement"
    placed = ExpertPlacement.load(out / PLACEMENT_NAME)
    assert placed.cells == 12 and placed.strategy == "per-layer" and placed.gpu_format == "marlin"
    want = plan_placement(ExpertProfile.load(fit_profile), 16, (1, 2, 3), Budget(ratio=0.25), "per-layer")
    assert placed.experts == want.experts
    assert run([*KTCONVERT, "verify", out]).returncode == 0
    r = run([*KTRUN, "bench", out, "--pp", 64, "--tg", 4, "--reps", 1])
    assert r.returncode == 0, r.stderr
    assert "hot experts: 12 of 48" in r.stdout and "per-layer" in r.stdout and "gpu_hit_ratio: " in r.stdout
    r = run([*KTRUN, "bench", out, "--pp", 64, "--tg", 4, "--reps", 1, "--gpu-experts", 0])
    assert "hot experts: none" in r.stdout and "gpu_hit_ratio" not in r.stdout
    r = run([*KTRUN, "generate", out, "--prompt", "def f(x):", "--max-tokens", 8, "--json"])
    assert r.returncode == 0 and len(json.loads(r.stdout)["token_ids"]) == 8, r.stderr
    # a profile of another model, or a placement without a profile, is refused before anything is written
    bad = ExpertProfile.empty("deepseek_v3", 8, 4, (1, 2, 3))
    bad.save(work / "other.json")
    r = run([*KTCONVERT, "quantize", DEFAULT_MODEL, "-o", work / "bad", "--gpu-method", "bf16", "--quiet",
             "--profile", work / "other.json", "--gpu-experts", 2])
    assert r.returncode != 0 and "other.json: measured with 8 routed experts" in r.stderr
    assert not (work / "bad" / "manifest.json").exists()
    r = run([*KTCONVERT, "quantize", DEFAULT_MODEL, "-o", work / "bad", "--gpu-experts", 2])
    assert r.returncode != 0 and "needs --profile P" in r.stderr


def test_bench_hit_ratio_on_a_prompt_file_is_the_profiles(work, conv, fit_profile):
    """`ktrun bench --prompt-file F` measures the hit ratio on F's tokens: the share of F's routed calls that a
    profile of F (measured independently, all on the CPU) puts on the placed experts."""
    measured = work / "measure.json"
    r = run([*KTCONVERT, "profile", conv, "--prompts", work / "measure.txt", "--chunk-tokens", 512,
             "--heldout-every", 0, "-o", measured, "--quiet"])
    assert r.returncode == 0, r.stderr
    r = run([*KTRUN, "bench", conv, "--profile", fit_profile, "--gpu-experts", 4, "--placement", "frequency",
             "--prompt-file", work / "measure.txt", "--tg", 0, "--reps", 1, "--per-layer"])
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines() if line.startswith("gpu_hit_ratio"))
    prof = ExpertProfile.load(measured)
    placement = plan_placement(ExpertProfile.load(fit_profile), 16, (1, 2, 3), Budget(per_layer=4), "frequency")
    want = hit_ratio(prof.counts(), placement.experts)
    assert abs(float(lines["gpu_hit_ratio"]) - want) < 0.01, (lines, want)
    assert abs(float(lines["gpu_hit_ratio_pp"]) - want) < 0.01
    for L in (1, 2, 3):
        c = prof.counts()[L]
        assert abs(float(lines[f"gpu_hit_ratio_layer_{L}"]) - c[list(placement.experts[L])].sum() / c.sum()) < 0.02
    assert "profile: " in r.stdout and "top 4 (25%)" in r.stdout          # the profile's summary


def test_inspect_prints_the_summary_and_the_hot_expert_plan(conv, fit_profile):
    r = run([*KTCONVERT, "inspect", conv, "--gpu-mem", "12MB", "--kv-mem", "1MB", "--profile", fit_profile])
    assert r.returncode == 0, r.stderr
    assert "entropy" in r.stdout and "hot experts on a 12.00 MB GPU" in r.stdout
    marlin = next(line for line in r.stdout.splitlines() if "int4-amx  marlin" in line)
    assert "experts (" in marlin and "hit ratio on the profile (in-sample): uniform" in marlin


def test_serve_reports_hit_ratio_and_swaps(conv, fit_profile):
    s = ServerProcess([*KTRUN, "serve", conv, "--port", "0", "--ctx", "256", "--profile", fit_profile,
                       "--gpu-experts", "3", "--dynamic-experts", "--dynamic-window", "32"], timeout=300)
    try:
        status, body, _ = request(s, "POST", "/v1/completions", {"model": "conv", "prompt": "def main():\n",
                                                                  "max_tokens": 24, "temperature": 0})
        assert status == 200, body
        assert 0 < metric(s, "ktrun_engine_gpu_hit_ratio") < 1
        assert metric(s, "ktrun_engine_routed_expert_calls") > 0
        assert metric(s, "ktrun_engine_gpu_experts_resident") == 9
        _, text, _ = request(s, "GET", "/metrics")
        assert "ktrun_engine_expert_swaps " in text and 'ktrun_engine_gpu_hit_ratio_by_layer{layer="1"}' in text
    finally:
        s.stop()
