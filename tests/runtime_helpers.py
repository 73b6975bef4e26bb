"""Shared helpers of the ktrun tests: peaked fixture checkpoints, their conversions, transformers references."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from ktconvert.pipeline import ConvertOptions, convert
from ktconvert.testing import make_checkpoint

INIT_SCALE = 8.0          # lm_head x8: peaked next-token distributions, so greedy choices have clear margins
PROMPT = "The quick brown fox jumps over the lazy dog"


def build_checkpoint(root: Path, arch: str, **kw) -> Path:
    out = root / f"src_{arch}{'_fp8' if kw.get('fp8') else ''}"
    if not (out / "config.json").exists():
        make_checkpoint(arch, out, init_scale=INIT_SCALE, **kw)
    return out


def build_conversion(src: Path, out: Path, method: str = "bf16", **kw) -> Path:
    if not (out / "manifest.json").exists():
        convert(src, out, ConvertOptions(method=method, **kw), show_progress=False)
    return out


def transformers_model(src: Path):
    from transformers import AutoModelForCausalLM
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def transformers_tokenizer(src: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(src)


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """(T, V) float32 logits of the transformers model for every position of ids."""
    return model(torch.tensor([ids])).logits[0].float()


def greedy_gaps(ref_logits: torch.Tensor, n_prompt: int, generated: list[int]) -> list[float]:
    """Per generated token: transformers' max logit minus the logit of our token, at the same prefix (0 = argmax)."""
    rows = ref_logits[n_prompt - 1: n_prompt - 1 + len(generated)]
    return [float(r.max() - r[t]) for r, t in zip(rows, generated)]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row, nats."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def shared_root(tmp_path_factory) -> Path:
    """One directory per test session for checkpoints and conversions shared by the ktrun test files."""
    root = tmp_path_factory.getbasetemp() / "ktrun_shared"
    root.mkdir(exist_ok=True)
    return root


def converted(tmp_path_factory, arch: str, method: str = "bf16", fp8: bool = False, **kw) -> Path:
    """Session-wide conversion of the peaked fixture checkpoint of arch (built once, then reused)."""
    root = shared_root(tmp_path_factory)
    src = build_checkpoint(root, arch, **({"fp8": True} if fp8 else {}))
    tag = "_".join([arch, "fp8" if fp8 else "bf16src", method] + [f"{k}{v}" for k, v in sorted(kw.items())])
    return build_conversion(src, root / f"conv_{tag}", method, **kw)


# `ktrun` as a real subprocess (the console script's entry point, with this interpreter)
KTRUN = [__import__("sys").executable, "-c", "from ktrun.cli import main; main()"]
