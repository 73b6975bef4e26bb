"""`ktrun perplexity` (llama-perplexity's protocol) on conversions of the shipped default model.

References: transformers' DeepseekV3ForCausalLM and AutoTokenizer on the same chunks (the BF16 conversion's
perplexity), and a plain numpy KL / percentile / argmax computed from the saved distributions read with the
safetensors library (the quantized conversion's KL numbers).
"""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ktconvert

MODEL_DIR = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"
TEXT = MODEL_DIR / "heldout_eval.txt"
CTX, CHUNKS = 256, 8
PPL_REL_BOUND = 1e-3    # ktrun (BF16 weights, float32 compute, bf16 expert kernels) vs transformers float32


def ktrun(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "ktrun", "perplexity", *args], capture_output=True, text=True,
                       timeout=600, check=False)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def lines(stdout: str) -> dict[str, float]:
    return {k.strip(): float(v) for k, v in (ln.split(":", 1) for ln in stdout.splitlines() if ":" in ln)}


@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    from ktconvert.pipeline import ConvertOptions, convert

    root = tmp_path_factory.mktemp("ppl")
    out = {}
    for name, opts in (("bf16", ConvertOptions(method="bf16", gpu_method="bf16")),
                       ("int4", ConvertOptions(method="int4-amx", group_size=128, gpu_method="rtn-int4"))):
        convert(MODEL_DIR, root / name, opts, show_progress=False)
        out[name] = root / name
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def base(conversions):
    path = conversions["root"] / "bf16.logprobs"
    r = ktrun(str(conversions["bf16"]), "--text", str(TEXT), "--ctx", str(CTX), "--chunks", str(CHUNKS),
              "--kl-divergence-base", str(path))
    return path, lines(r.stdout)


def reference_chunks() -> np.ndarray:
    """llama-perplexity's chunks, built here with transformers' tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    ids = tok(TEXT.read_text(encoding="utf-8"))["input_ids"]
    assert ids[0] == tok.bos_token_id
    chunks = np.asarray(ids[: CHUNKS * CTX]).reshape(CHUNKS, CTX).copy()
    chunks[:, 0] = tok.bos_token_id
    return chunks


@torch.no_grad()
def test_bf16_conversion_perplexity_equals_transformers(base):
    from safetensors.numpy import load_file
    from transformers import DeepseekV3ForCausalLM

    path, got = base
    chunks = reference_chunks()
    assert np.array_equal(load_file(str(path))["tokens"], chunks)     # the same tokens as transformers'
    model = DeepseekV3ForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    x = torch.from_numpy(chunks)
    lp = torch.log_softmax(model(input_ids=x).logits.double(), -1)                # (n, ctx, V)
    first = CTX // 2
    nll = -lp[:, first:CTX - 1].gather(-1, x[:, first + 1:, None])[..., 0]         # (n, 127)
    want = math.exp(float(nll.mean()))
    assert got["ppl"] == pytest.approx(want, rel=PPL_REL_BOUND), (got["ppl"], want)
    assert 0.3 * 110.3 < want < 3 * 110.3      # the model card's number on a different slice: same ballpark


def test_quantized_kl_equals_numpy_on_the_saved_distributions(conversions, base):
    from safetensors.numpy import load_file

    base_path, base_lines = base
    q_path = conversions["root"] / "int4.logprobs"
    r = ktrun(str(conversions["int4"]), "--text", str(TEXT), "--ctx", str(CTX), "--chunks", str(CHUNKS),
              "--kl-divergence", str(base_path), "--kl-divergence-base", str(q_path))
    got = lines(r.stdout)
    ref, q = load_file(str(base_path)), load_file(str(q_path))
    assert np.array_equal(ref["tokens"], q["tokens"])
    lp_ref = ref["log_probs"].astype(np.float64)                                  # (n, 127, V)
    lp_q = q["log_probs"].astype(np.float64)
    kl = (np.exp(lp_ref) * (lp_ref - lp_q)).sum(-1).ravel()
    top1 = (lp_ref.argmax(-1) == lp_q.argmax(-1)).mean()
    tokens = ref["tokens"][:, CTX // 2 + 1:]
    nll = -np.take_along_axis(lp_q, tokens[..., None].astype(np.int64), -1).mean()
    nll_ref = -np.take_along_axis(lp_ref, tokens[..., None].astype(np.int64), -1).mean()
    assert got["kl_mean"] == pytest.approx(kl.mean(), rel=1e-4)
    assert got["kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-4)
    assert got["kl_max"] == pytest.approx(kl.max(), rel=1e-4)
    assert got["top1_agreement"] == pytest.approx(top1, abs=1e-4)
    assert got["ppl"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert got["ppl_base"] == pytest.approx(base_lines["ppl"], rel=1e-4) == pytest.approx(math.exp(nll_ref), rel=1e-4)
    assert 1e-5 < got["kl_mean"] < 0.05 and 0.8 < got["top1_agreement"] < 1.0    # int4: small but not zero


def test_kl_mode_scores_the_reference_tokens_without_text(conversions, base):
    base_path, base_lines = base
    r = ktrun(str(conversions["bf16"]), "--ctx", str(CTX), "--kl-divergence", str(base_path))
    got = lines(r.stdout)
    assert got["ppl"] == pytest.approx(base_lines["ppl"], rel=1e-6)
    assert abs(got["kl_mean"]) < 1e-7 and got["top1_agreement"] == 1.0     # itself (float32 rounding of the file)


def test_mismatched_text_ctx_and_short_text_are_clear_errors(conversions, base, tmp_path):
    base_path, _ = base
    other = tmp_path / "other.txt"
    other.write_text(TEXT.read_text(encoding="utf-8")[5000:], encoding="utf-8")
    r = ktrun(str(conversions["int4"]), "--text", str(other), "--ctx", str(CTX), "--chunks", str(CHUNKS),
              "--kl-divergence", str(base_path), check=False)
    assert r.returncode != 0 and "not the same text or tokenizer" in r.stderr and str(base_path) in r.stderr
    r = ktrun(str(conversions["int4"]), "--ctx", "128", "--kl-divergence", str(base_path), check=False)
    assert r.returncode != 0 and "ctx 256" in r.stderr
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n    return x\n", encoding="utf-8")
    r = ktrun(str(conversions["int4"]), "--text", str(short), check=False)
    assert r.returncode != 0 and "needs at least 512" in r.stderr
    bad = tmp_path / "bad.logprobs"
    bad.write_bytes(b"\x00" * 16)
    r = ktrun(str(conversions["int4"]), "--kl-divergence", str(bad), check=False)
    assert r.returncode != 0 and str(bad) in r.stderr
    assert not list(tmp_path.glob("*.partial"))

