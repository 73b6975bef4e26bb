"""`ktconvert quantize --report-kl`: the source model's own float32 distributions on the held-out quarter of the
calibration text, computed layer by layer, and the conversion scored against them.

Reference: transformers' DeepseekV3ForCausalLM on the same chunks (the whole model at once)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import ktconvert

MODEL_DIR = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"


def lines(stdout: str) -> dict[str, float]:
    """The `name: number` lines of the output."""
    return {m.group(1): float(m.group(2)) for ln in stdout.splitlines()
            if (m := re.fullmatch(r"(\w+): ([-+\d.e]+)", ln.strip()))}


@torch.no_grad()
def test_report_kl_reference_is_the_source_model(tmp_path):
    """--report-kl's reference (layer by layer, float32) equals transformers' whole model on the same chunks."""
    from safetensors.numpy import load_file
    from transformers import DeepseekV3ForCausalLM

    from ktconvert.report_kl import heldout_chunks, write_reference
    from ktconvert.sources import open_source

    with open_source(MODEL_DIR) as src:
        chunks, _ = heldout_chunks(src, None)
        write_reference(src, chunks, tmp_path / "ref.logprobs")
    assert chunks.shape[1] == 256 and chunks.shape[0] >= 2 and (chunks[:, 0] == 0).all()
    got = load_file(str(tmp_path / "ref.logprobs"))
    model = DeepseekV3ForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    want = torch.log_softmax(model(input_ids=torch.from_numpy(chunks)).logits.double(), -1)[:, 128:255]
    assert np.array_equal(got["tokens"], chunks)
    assert np.abs(got["log_probs"] - want.numpy()).max() < 2e-3


def test_quantize_report_kl_prints_the_numbers(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ktconvert", "quantize", str(MODEL_DIR), "-o", str(tmp_path / "c"),
                        "--method", "int4-amx", "--gpu-method", "rtn-int4", "--quiet", "--report-kl"],
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    got = lines(r.stdout)
    assert {"ppl", "ppl_base", "kl_mean", "kl_p99", "top1_agreement"} <= set(got)
    assert 1e-5 < got["kl_mean"] < 0.05 and got["kl_p99"] > got["kl_mean"] and 0.8 < got["top1_agreement"] < 1
    assert "held-out quarter" in r.stderr and not list(tmp_path.glob(".ktconvert-report-*"))
