"""bench/bench_quant_vs_llamacpp.py's peer rows, as a real subprocess on 2 chunks: llama.cpp's imatrix rows (its
converter, llama-imatrix on the calibration text, llama-quantize --imatrix, llama-perplexity's KL against its BF16
GGUF, on both held-out texts) and ik_llama.cpp's (its own converter, imatrix, IQ4_KS and the bits of its row-scaled
types). Each needs its
build (bench/README.md); without one the test is skipped and says where it looked (KTRUN_LLAMA_CPP /
KTRUN_IK_LLAMA_CPP name other trees)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_quant_vs_llamacpp.py"
LLAMA = Path(os.environ.get("KTRUN_LLAMA_CPP", "/work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp"))
IK = Path(os.environ.get("KTRUN_IK_LLAMA_CPP", "/work/tools/ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp"))
LINE = re.compile(r"^(quant\.[\w.+-]+): (\S+) (\S+)$")
BINS = ("llama-quantize", "llama-perplexity", "llama-imatrix")


def _missing(tree: Path) -> list[str]:
    return [b for b in BINS if not (tree / "build" / "bin" / b).is_file()] + \
        [f for f in ("convert_hf_to_gguf.py", "gguf-py") if not (tree / f).exists()]


def _run(tmp_path: Path, *extra: str, chunks: int = 2) -> tuple[dict[str, tuple[float, str]], str]:
    cmd = [sys.executable, str(BENCH), "--workdir", str(tmp_path), "--chunks", str(chunks), "--imatrix-chunks", "4",
           "--only", "experts,whole", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = {m.group(1): (float(m.group(2)), m.group(3)) for m in map(LINE.match, r.stdout.splitlines()) if m}
    return lines, r.stdout


def _check_row(lines, key: str) -> None:
    assert lines[f"{key}.bpw"][1] == "bits/weight" and lines[f"{key}.padding_bpw"][0] == 0
    assert 0 <= lines[f"{key}.kl_mean"][0] < 0.05 and lines[f"{key}.kl_mean"][1] == "nats/token"
    assert 0.8 < lines[f"{key}.top1"][0] <= 1
    assert lines[f"{key}.ppl"][0] > 1


@pytest.mark.skipif(bool(_missing(LLAMA)), reason=f"no llama.cpp build with {', '.join(_missing(LLAMA))} at {LLAMA} "
                    "(bench/README.md; or set KTRUN_LLAMA_CPP)")
def test_llama_cpp_imatrix_rows(tmp_path):
    b = LLAMA / "build" / "bin"
    lines, out = _run(tmp_path, "--tools", "llama.cpp", "--configs", "^(Q4_K|Q4_K-imatrix|Q4_K_M-imatrix)$",
                      "--texts", "stdlib,torch",
                      "--llama-quantize", str(b / "llama-quantize"), "--llama-perplexity", str(b / "llama-perplexity"),
                      "--convert-script", str(LLAMA / "convert_hf_to_gguf.py"))      # llama-imatrix: found beside
    for text in ("stdlib", "torch"):
        for key in ("experts.llamacpp.Q4_K", "experts.llamacpp.Q4_K-imatrix", "whole.llamacpp.Q4_K_M-imatrix"):
            _check_row(lines, f"quant.{text}.{key}")
        assert f"quant.{text}.bf16.llamacpp.ppl" in lines
    # one file, scored on each text: the same bits, another KL
    assert lines["quant.torch.experts.llamacpp.Q4_K.bpw"] == lines["quant.stdlib.experts.llamacpp.Q4_K.bpw"]
    assert lines["quant.torch.experts.llamacpp.Q4_K.kl_mean"] != lines["quant.stdlib.experts.llamacpp.Q4_K.kl_mean"]
    assert re.search(r"# text torch: torch's own torch/nn/modules/\*\.py .* identical tokens in llama\.cpp: True", out)
    # Q4_K for the experts' gate / up (K = 256), Q5_0 for their down_proj (K = 160): (2 * 4.5 + 5.5) / 3
    q4k, q4k_imatrix = "quant.stdlib.experts.llamacpp.Q4_K", "quant.stdlib.experts.llamacpp.Q4_K-imatrix"
    assert lines[f"{q4k_imatrix}.bpw"][0] == pytest.approx(29 / 6, abs=1e-4)
    assert lines[f"{q4k}.bpw"][0] == lines[f"{q4k_imatrix}.bpw"][0]
    # the imatrix changed the codes: another KL, and the quantizer read it
    assert lines[f"{q4k_imatrix}.kl_mean"] != lines[f"{q4k}.kl_mean"]
    assert (tmp_path / "llama-imatrix.gguf").is_file()
    assert "imatrix" in (tmp_path / "llama-experts-Q4_K-imatrix.quant.log").read_text()
    assert "# experts llama.cpp Q4_K-imatrix: Q4_K 6, Q5_0 3" in out
    assert out.count("identical tokens in llama.cpp: True") == 2 and (tmp_path / "llama-bf16.torch.kld").is_file()


@pytest.mark.skipif(bool(_missing(IK)), reason=f"no ik_llama.cpp build with {', '.join(_missing(IK))} at {IK} "
                    "(bench/README.md; or set KTRUN_IK_LLAMA_CPP)")
def test_ik_llama_cpp_rows(tmp_path):
    # ours too (its BF16 reference only: no row of ours matches), for the identical-tokens check across tools; 24
    # chunks reach a string literal with two backslashes in a row, which ik's llama-perplexity read as one escaped
    # backslash before the bench passed it --no-escape
    lines, out = _run(tmp_path, "--tools", "ours,ik_llama.cpp", "--ik-llama-dir", str(IK), "--configs",
                      "^IQ4_KS-imatrix$", "--texts", "stdlib", chunks=24)
    for key in ("experts.ik_llamacpp.IQ4_KS-imatrix", "whole.ik_llamacpp.IQ4_KS-imatrix"):
        _check_row(lines, f"quant.stdlib.{key}")
    # IQ4_KS: 136 bytes per 256 weights plus a float scale per row; gate / up (K = 256) are IQ4_KS, the down_proj
    # (K = 160) falls back to IQ4_NL (4.5 bits): ((4.25 + 32 / 256) * 2 + 4.5) / 3
    iq4_ks = lines["quant.stdlib.experts.ik_llamacpp.IQ4_KS-imatrix.bpw"][0]
    assert iq4_ks == pytest.approx((4.375 * 2 + 4.5) / 3, abs=1e-4)
    assert "# experts ik_llama.cpp IQ4_KS-imatrix: IQ4_KS 6, IQ4_NL 3" in out
    assert (tmp_path / "ik-bf16.gguf").is_file() and (tmp_path / "ik-imatrix.dat").is_file()
    assert (tmp_path / "ik-trace.log").is_file()      # its trace log in the workdir, not llama.log where it ran
    assert "24 chunks x 256 tokens" in out and "identical tokens in ours, ik_llama.cpp: True" in out
    assert "quant.stdlib.bf16.ik_llamacpp.ppl" in lines and not any(k.startswith("quant.torch.") for k in lines)
    assert not any(k.startswith("quant.stdlib.experts.ours") for k in lines)


def test_a_crashing_llama_perplexity_falls_back_to_the_documented_workaround(tmp_path, capsys):
    """No build needed: a stand-in llama-perplexity that aborts unless LLAMA_ARG_REPACK=0 (what llama.cpp's repacked
    CPU buffers did on whole-model GGUFs): the bench retries with the workaround, keeps it, and says so."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_quant_vs_llamacpp as bench
    finally:
        sys.path.remove(str(BENCH.parent))
    fake = tmp_path / "llama-perplexity"
    fake.write_text('#!/bin/sh\n[ "$LLAMA_ARG_REPACK" = 0 ] && echo "args $*" && exit 0\necho boom >&2; exit 134\n')
    fake.chmod(0o755)
    peer = bench.Peer("llama.cpp", "llamacpp", "llama", "convert.py", "q", str(fake), None, [], [], [], False,
                      [("its defaults", [], {}), ("LLAMA_ARG_REPACK=0", [], {"LLAMA_ARG_REPACK": "0"})])
    assert bench.peer_perplexity(peer, ["-m", "x.gguf"], tmp_path / "a.log", "args").strip() == "args -m x.gguf"
    assert peer.level == 1 and peer.note == "LLAMA_ARG_REPACK=0"
    assert "failed with its defaults (log a.log); from here on it runs with LLAMA_ARG_REPACK=0" in capsys.readouterr().out
    bench.peer_perplexity(peer, ["-m", "y.gguf"], tmp_path / "b.log", "args")      # straight to the workaround
    assert "boom" not in (tmp_path / "b.log").read_text()
    fake.write_text("#!/bin/sh\necho boom >&2; exit 134\n")
    with pytest.raises(SystemExit, match="failed with every workaround"):
        bench.peer_perplexity(peer, ["-m", "z.gguf"], tmp_path / "c.log", "args")
