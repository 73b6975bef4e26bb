"""`ktconvert quantize --report-kl`: what the conversion cost, measured right after converting.

The reference is the source checkpoint itself in float32: its next-token distributions on the held-out part of the
calibration text (ktconvert.gpu.calib.split_calibration_text: the last quarter, which calibration never sees), run
one decoder layer at a time through transformers' layer classes (ktconvert.gpu.calib.LayerwiseGptq with every weight
kept), so memory stays at about one layer however large the model. The text is cut with llama-perplexity's protocol
(ktrun.perplexity: chunks of ctx tokens, BOS first, positions ctx/2 .. ctx-2 scored); the distributions go to a
ktlayouts.logprobs file, and `ktrun perplexity OUT --kl-divergence REF` scores the conversion against it.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

REPORT_CTX = 256
MAX_CHUNKS = 64


class ReportError(ValueError):
    """The held-out text is too short to report on, or the source cannot be run."""


def heldout_chunks(src, calib: str | None, ctx: int = REPORT_CTX) -> tuple[np.ndarray, Path]:
    """(chunks (n, ctx') int64, calibration file): the held-out part tokenized as ktrun does (BOS first when the
    tokenizer adds one), cut as llama-perplexity does; ctx' = ctx, or half the held-out tokens when fewer than 2 ctx."""
    from ktconvert.gpu.calib import read_calibration_text, split_calibration_text, tokenizer_for

    text, path = read_calibration_text(calib)
    _, held = split_calibration_text(text)
    tokenizer, _ = tokenizer_for(src)
    with_special = tokenizer.encode(held, add_special_tokens=True).ids
    plain = tokenizer.encode(held, add_special_tokens=False).ids
    bos = with_special[0] if len(with_special) == len(plain) + 1 else None
    ctx = min(ctx, len(with_special) // 2)
    if ctx < 8:
        raise ReportError(f"--report-kl: the held-out quarter of {path} has {len(with_special)} tokens; need at least "
                          f"16 (use a longer --calib text)")
    n = min(MAX_CHUNKS, len(with_special) // ctx)
    chunks = np.asarray(with_special[: n * ctx], dtype=np.int64).reshape(n, ctx).copy()
    if bos is not None:
        chunks[:, 0] = bos
    return chunks, path


@torch.no_grad()
def write_reference(src, chunks: np.ndarray, out: Path) -> None:
    """The source model's float32 next-token log-probs on `chunks`, layer by layer -> a ktlayouts.logprobs file."""
    from ktlayouts.logprobs import LogprobsShape, LogprobsWriter, first_scored

    from ktconvert.gpu.calib import LayerwiseGptq

    cal = LayerwiseGptq(src, torch.from_numpy(chunks), lambda *a: None, lambda hub: False)
    for li in range(src.arch.num_layers):
        cal._run_layer(li)
    hidden = cal.hidden                                                          # (n, ctx, H)
    eps = float(src.config.get("rms_norm_eps", 1e-6))
    norm = src.read("model.norm.weight").float()
    names = set(src.tensor_names())
    head = src.read("lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight").float()
    n, ctx = chunks.shape
    first = first_scored(ctx)
    writer = LogprobsWriter(out, LogprobsShape(n, ctx, head.shape[0]), source=f"{src.path} (float32, layer by layer)")
    try:
        for i in range(n):
            h = hidden[i, first:ctx - 1].float()                                  # (S, H)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm
            writer.add(chunks[i].astype(np.int32), torch.log_softmax((h @ head.T).double(), -1).float().numpy())
        writer.close()
    except BaseException:
        writer.abort()
        raise


def report_kl(src_path, out_dir, calib: str | None, ctx: int = REPORT_CTX) -> dict[str, float]:
    """Score the conversion in out_dir against its source on the held-out calibration text; prints and returns the
    `ktrun perplexity` summary (ppl, ppl_base, kl_mean, kl_median, kl_p99, kl_max, top1_agreement)."""
    import click
    from ktrun.cli.cmd_perplexity import print_summary, run_perplexity

    from ktconvert.sources import open_source

    out_dir = Path(out_dir)
    with open_source(src_path) as src:
        chunks, path = heldout_chunks(src, calib, ctx)
        click.echo(f"report-kl: {chunks.shape[0]} chunks of {chunks.shape[1]} tokens from the held-out quarter of "
                   f"{path}; reference: the source in float32, layer by layer", err=True)
        with tempfile.TemporaryDirectory(prefix=".ktconvert-report-", dir=out_dir.parent) as tmp:
            ref = Path(tmp) / "reference.logprobs"
            write_reference(src, chunks, ref)
            summary = run_perplexity(out_dir, None, chunks.shape[1], None, reference_path=ref, quiet=True)
    print_summary(summary)
    return summary
