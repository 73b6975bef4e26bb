"""bench/bench_vs_llamacpp.py in its tiny configuration, as a real subprocess: the checkpoints of both shapes, the
real converter, ktrun's timing and the roofline lines; with a llama.cpp / ik_llama.cpp build present (KTRUN_LLAMA_CPP /
KTRUN_IK_LLAMA_CPP or the documented places, bench/README.md), also the peer's own converter, quantizer and
llama-bench with the ratio lines."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_vs_llamacpp.py"
LLAMA = Path(os.environ.get("KTRUN_LLAMA_CPP", "/work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp"))
IK_LLAMA = Path(os.environ.get("KTRUN_IK_LLAMA_CPP", "/work/tools/ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp"))
LINE = re.compile(r"^([a-z0-9_]+): (\S+)(?: ± \S+)? (\S+)$")


def _run(tmp_path: Path, *extra: str) -> tuple[dict[str, tuple[float, str]], str]:
    cmd = [sys.executable, str(BENCH), "--tiny", "--workdir", str(tmp_path), "--rounds", "2", "--tg", "4",
           "--pp", "8,16", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = {}
    for line in r.stdout.splitlines():
        m = LINE.match(line)
        if m:
            lines[m.group(1)] = (float(m.group(2)), m.group(3))
    return lines, r.stdout


def test_tiny_bench_against_the_roofline(tmp_path):
    lines, out = _run(tmp_path, "--pairs", "int4,int8", "--shape", "v3,qwen3")
    for shape in ("v3", "qwen3"):
        assert lines[f"{shape}_read_bandwidth"][1] == "GB/s" and lines[f"{shape}_read_bandwidth"][0] > 0
        for pair in ("int4", "int8"):
            for test in ("tg4", "pp8", "pp16"):
                value, unit = lines[f"{shape}_{test}_ktrun_{pair}"]
                assert unit == "tok/s" and value > 0
            assert lines[f"{shape}_ktrun_{pair}_weight_bytes_per_token"][1] == "MB"
            assert 0 < lines[f"{shape}_ktrun_{pair}_roofline_over_step"][0] < 1.5
        # int8 codes are twice int4's: the expert bytes a step reads say so
        assert (lines[f"{shape}_ktrun_int8_expert_bytes_per_token"][0]
                > 1.5 * lines[f"{shape}_ktrun_int4_expert_bytes_per_token"][0])
    assert "[qwen3] model: qwen3_moe-shaped (tiny): hidden 256, GQA 4 / 2 heads of 64" in out
    assert "[v3] model: deepseek_v3-shaped (tiny): hidden 256, 4 MLA heads" in out
    assert not any("llamacpp" in k for k in lines)
    assert "must_show (issues 32, 37)" in out
    # the conversions were reused on a second run (manifest.json present), and the run still measures
    again, _ = _run(tmp_path, "--pairs", "int4", "--torch-threads", "1,2", "--depth", "24")
    assert {"v3_tg4_ktrun_int4_torch1", "v3_tg4_ktrun_int4_torch2", "v3_tg4_d24_ktrun_int4_torch1"} <= set(again)


def test_tiny_bench_default_against_the_default_without_its_int8_upgrades(tmp_path):
    """Issue 37's speed check: the default conversion and the same with --gpu-mix-budget 0, alternated in one run,
    and the ratio line; the two conversions differ in the measured upgrades only (their manifests say so)."""
    import json

    lines, out = _run(tmp_path, "--pairs", "default,default_mix0", "--shape", "qwen3")
    for pair in ("default", "default_mix0"):
        assert lines[f"qwen3_tg4_ktrun_{pair}"][0] > 0
    value, unit = lines["qwen3_tg4_ktrun_default_over_ktrun_default_mix0"]
    assert unit == "ratio" and value > 0
    assert "qwen3 tg4 default / default without the int8 upgrades" in out
    new = json.loads((tmp_path / "tiny-qwen3" / "ktrun-default" / "manifest.json").read_text())
    old = json.loads((tmp_path / "tiny-qwen3" / "ktrun-default_mix0" / "manifest.json").read_text())
    from ktconvert.gpu.options import DEFAULT_MIX_BUDGET

    assert new["gpu_mix"]["budget"] == DEFAULT_MIX_BUDGET and "gpu_mix" not in old


def _check_peer(lines: dict, out: str, peer: str, shapes: tuple[str, ...]) -> None:
    for shape in shapes:
        for test in ("tg4", "pp8", "pp16"):
            ours, theirs = lines[f"{shape}_{test}_ktrun_int4"][0], lines[f"{shape}_{test}_{peer}_q4_0"][0]
            ratio, unit = lines[f"{shape}_{test}_ktrun_int4_over_{peer}_q4_0"]
            assert unit == "ratio" and ratio == pytest.approx(ours / theirs, rel=0.02, abs=6e-4)   # 3 decimals
        assert lines[f"{shape}_{peer}_q4_0_weight_bytes_per_token"][0] > 0
        assert f"{shape}_{peer}_flags: " in out
        assert f"{shape} tg4 ktrun_int4 / " in out            # the must_show row against the faster peer


@pytest.mark.skipif(not (LLAMA / "build" / "bin" / "llama-bench").is_file(),
                    reason=f"no llama.cpp build at {LLAMA} (bench/README.md; or set KTRUN_LLAMA_CPP)")
def test_tiny_bench_against_llama_cpp(tmp_path):
    lines, out = _run(tmp_path, "--pairs", "int4", "--llama-bench", str(LLAMA / "build" / "bin" / "llama-bench"),
                      "--convert-script", str(LLAMA / "convert_hf_to_gguf.py"))
    _check_peer(lines, out, "llamacpp", ("v3",))
    assert (tmp_path / "tiny" / "llamacpp-Q4_0.gguf").is_file()


@pytest.mark.skipif(not (IK_LLAMA / "build" / "bin" / "llama-bench").is_file(),
                    reason=f"no ik_llama.cpp build at {IK_LLAMA} (bench/README.md; or set KTRUN_IK_LLAMA_CPP)")
def test_tiny_bench_against_ik_llama_cpp(tmp_path):
    """ik_llama.cpp with its own converter (its single-file convert_hf_to_gguf.py, taken from its tree) and its CPU
    flags, on both shapes."""
    lines, out = _run(tmp_path, "--pairs", "int4", "--shape", "v3,qwen3", "--no-rss", "--depth", "24",
                      "--ik-llama-bench", str(IK_LLAMA / "build" / "bin" / "llama-bench"))
    _check_peer(lines, out, "ik_llamacpp", ("v3", "qwen3"))
    for shape in ("v3", "qwen3"):                 # decode after a 24-token prompt: ours, and ik_llama.cpp's -gp 24,4
        ours, theirs = lines[f"{shape}_tg4_d24_ktrun_int4"][0], lines[f"{shape}_tg4_d24_ik_llamacpp_q4_0"][0]
        assert ours > 0 and theirs > 0
        ratio = lines[f"{shape}_tg4_d24_ktrun_int4_over_ik_llamacpp_q4_0"][0]
        assert ratio == pytest.approx(ours / theirs, rel=0.02, abs=6e-4)    # printed with 3 decimals, as _check_peer
    assert (tmp_path / "tiny-qwen3" / "ik_llamacpp-Q4_0.gguf").is_file()
