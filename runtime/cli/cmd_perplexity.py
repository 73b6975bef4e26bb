"""`ktrun perplexity`: how far a conversion is from the model it came from (llama-perplexity's protocol,
ktrun.perplexity)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from .gpu_weights_option import gpu_weights_option


def print_summary(summary: dict[str, float], out=None) -> None:
    for key in ("ppl", "ppl_base", "kl_mean", "kl_median", "kl_p99", "kl_max", "top1_agreement"):
        if key in summary:
            click.echo(f"{key}: {summary[key]:.6g}" if key.startswith("kl") else f"{key}: {summary[key]:.4f}",
                       file=out)


def run_perplexity(model_dir, text: str | None, ctx: int, chunks: int | None, base_out=None, reference_path=None,
                   batch: int = 4, device=None, dtype=None, use_kernels=None, gpu_weights: str = "auto",
                   quiet: bool = False, text_name: str = "--text") -> dict[str, float]:
    """Load MODEL_DIR, score the text's chunks (or the reference's tokens), return the summary numbers."""
    from ktlayouts.logprobs import read_logprobs
    from tqdm import tqdm

    from ..engine import Engine
    from ..perplexity import PerplexityError, score, text_chunks, writer_for

    reference = read_logprobs(reference_path) if reference_path else None
    eng = Engine(model_dir, ctx=ctx, max_batch=1, device=device, dtype=dtype, use_kernels=use_kernels,
                 gpu_weights=gpu_weights)
    writer = None
    try:
        if text is not None:
            rows = text_chunks(eng.tokenizer, text, ctx, chunks)
        elif reference is not None:                # llama-perplexity's KL mode: the tokens come from the reference
            rows = reference.tokens.astype("int64")
            if chunks is not None and chunks >= 0:
                rows = rows[:chunks]
        else:
            raise PerplexityError("give --text FILE (or --kl-divergence BASE, whose tokens are then scored)")
        if reference is not None and reference.shape.n_chunks != rows.shape[0]:
            reference = _first_chunks(reference, rows.shape[0])
        n, c = rows.shape
        if c != ctx:
            raise PerplexityError(f"--ctx {ctx}: the reference {reference_path} was written with ctx {c}")
        first = c // 2
        if not quiet:
            click.echo(f"perplexity: {model_dir}: {n} chunks of {c} tokens, positions {first}..{c - 2} scored "
                       f"({n * (c - 1 - first)} tokens){'' if text is None else ' from ' + text_name}", err=True)
        if base_out is not None:
            writer = writer_for(base_out, rows, eng.model.cfg.vocab_size, source=str(Path(model_dir).resolve()))
        with tqdm(total=n, unit="chunk", desc="perplexity", disable=quiet, file=sys.stderr) as bar:
            res = score(eng.model, rows, reference=reference, save=writer, batch=batch, progress=bar)
        if writer is not None:
            writer.close()
            writer = None
        return res.summary()
    finally:
        if writer is not None:
            writer.abort()
        eng.close()


def _first_chunks(reference, n: int):
    from dataclasses import replace

    from ktlayouts.logprobs import LogprobsShape

    from ..perplexity import PerplexityError
    if n > reference.shape.n_chunks:
        raise PerplexityError(f"{reference.path}: holds {reference.shape.n_chunks} chunks, this run has {n}")
    s = reference.shape
    return replace(reference, shape=LogprobsShape(n, s.ctx, s.vocab), tokens=reference.tokens[:n],
                   log_probs=reference.log_probs[:n])


@click.command("perplexity")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--text", "-f", "text_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="UTF-8 text to score (optional with --kl-divergence: the reference's tokens are used).")
@click.option("--ctx", "-c", default=256, show_default=True, type=click.IntRange(4), help="Tokens per chunk.")
@click.option("--chunks", default=-1, show_default=True, type=int, help="Chunks to score (-1: as many as fit).")
@click.option("--kl-divergence-base", "base_out", type=click.Path(dir_okay=False), default=None,
              help="Save this model's next-token distributions to this file (the reference for --kl-divergence).")
@click.option("--kl-divergence", "reference", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Score against the distributions saved by --kl-divergence-base (same tokens).")
@click.option("--batch", default=4, show_default=True, type=click.IntRange(1), help="Chunks per forward.")
@click.option("--dense-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="dtype of the dense layers (auto: bfloat16 on CUDA, float32 on the CPU).")
@click.option("--device", default=None, help="torch device for the dense layers (default: cuda if available).")
@click.option("--reference-experts", is_flag=True, help="Use the torch reference for routed experts, not the kernels.")
@gpu_weights_option
def perplexity(model_dir, text_file, ctx, chunks, base_out, reference, batch, dense_dtype, device, reference_experts,
               gpu_weights):
    """Perplexity of the converted model in MODEL_DIR on --text, with llama-perplexity's protocol (chunks of --ctx
    tokens, BOS first, the second half of each chunk scored); KL divergence and top-1 agreement against a
    reference saved from another conversion (e.g. the --method bf16 --gpu-method bf16 one).

    Prints `ppl: X`, and with --kl-divergence also `ppl_base`, `kl_mean`, `kl_median`, `kl_p99`, `kl_max` (nats per
    token) and `top1_agreement` (fraction of positions with the same most likely token).

    \b
    Examples:
      ktrun perplexity converted-bf16/ --text wiki.test.raw --kl-divergence-base bf16.logprobs
      ktrun perplexity converted-int4/ --text wiki.test.raw --kl-divergence bf16.logprobs
      ktrun perplexity converted-int4/ --text wiki.test.raw --ctx 512 --chunks 32
    """
    import torch
    from ktlayouts.families import ConfigError
    from ktlayouts.logprobs import LogprobsError

    from ..loader import LoadError
    from ..perplexity import PerplexityError
    from ..text.tokenizer import TokenizerError

    text = None
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise click.ClickException(f"--text {text_file}: cannot read as UTF-8 text ({e})") from None
    try:
        summary = run_perplexity(model_dir, text, ctx, None if chunks < 0 else chunks, base_out=base_out,
                                 reference_path=reference, batch=batch, device=device,
                                 dtype=None if dense_dtype == "auto" else getattr(torch, dense_dtype),
                                 use_kernels=False if reference_experts else None, gpu_weights=gpu_weights,
                                 text_name=f"--text {text_file}")
    except (LoadError, ConfigError, TokenizerError, PerplexityError, LogprobsError) as e:
        raise click.ClickException(str(e)) from None
    print_summary(summary)
    if base_out:
        click.echo(f"# reference distributions written to {base_out}", err=True)
