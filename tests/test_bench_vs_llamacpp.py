"""bench/bench_vs_llamacpp.py in its tiny configuration, as a real subprocess: the checkpoint, the real converter,
ktrun's timing and the roofline lines; with a llama.cpp build present (KTRUN_LLAMA_CPP or the documented place,
bench/README.md), also llama.cpp's converter, quantizer and llama-bench with the ratio lines."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_vs_llamacpp.py"
LLAMA = Path(os.environ.get("KTRUN_LLAMA_CPP", "/work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp"))
LINE = re.compile(r"^([a-z0-9_]+): (\S+)(?: ± \S+)? (\S+)$")


def _run(tmp_path: Path, *extra: str) -> dict[str, tuple[float, str]]:
    cmd = [sys.executable, str(BENCH), "--tiny", "--workdir", str(tmp_path), "--rounds", "2", "--tg", "4",
           "--pp", "8,16", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = {}
    for line in r.stdout.splitlines():
        m = LINE.match(line)
        if m:
            lines[m.group(1)] = (float(m.group(2)), m.group(3))
    return lines


def test_tiny_bench_against_the_roofline(tmp_path):
    lines = _run(tmp_path, "--pairs", "int4,int8")
    assert lines["read_bandwidth"][1] == "GB/s" and lines["read_bandwidth"][0] > 0
    for pair in ("int4", "int8"):
        for test in ("tg4", "pp8", "pp16"):
            value, unit = lines[f"{test}_ktrun_{pair}"]
            assert unit == "tok/s" and value > 0
        assert lines[f"ktrun_{pair}_weight_bytes_per_token"][1] == "MB"
        assert 0 < lines[f"ktrun_{pair}_roofline_over_step"][0] < 1.5
    # int8 codes are twice int4's: the expert bytes a step reads say so
    assert lines["ktrun_int8_expert_bytes_per_token"][0] > 1.5 * lines["ktrun_int4_expert_bytes_per_token"][0]
    assert not any(k.startswith(("llamacpp", "tg4_ktrun_int4_over")) for k in lines)
    # the conversions were reused on a second run (manifest.json present), and the run still measures
    again = _run(tmp_path, "--pairs", "int4", "--torch-threads", "1,2")
    assert {"tg4_ktrun_int4_torch1", "tg4_ktrun_int4_torch2"} <= set(again)


@pytest.mark.skipif(not (LLAMA / "build" / "bin" / "llama-bench").is_file(),
                    reason=f"no llama.cpp build at {LLAMA} (bench/README.md; or set KTRUN_LLAMA_CPP)")
def test_tiny_bench_against_llama_cpp(tmp_path):
    lines = _run(tmp_path, "--pairs", "int4", "--llama-bench", str(LLAMA / "build" / "bin" / "llama-bench"),
                 "--convert-script", str(LLAMA / "convert_hf_to_gguf.py"))
    for test in ("tg4", "pp8", "pp16"):
        ours, peer = lines[f"{test}_ktrun_int4"][0], lines[f"{test}_llamacpp_q4_0"][0]
        ratio, unit = lines[f"{test}_ktrun_int4_over_llamacpp_q4_0"]
        assert unit == "ratio" and ratio == pytest.approx(ours / peer, rel=0.02, abs=6e-4)   # printed to 3 decimals
    assert (tmp_path / "tiny" / "llamacpp-Q4_0.gguf").is_file()
    assert lines["llamacpp_q4_0_weight_bytes_per_token"][0] > 0
