"""`ktrun bench`: prompt processing (ppN) and token generation (tgN) rates the way llama-bench reports them, mean ±
standard deviation over repetitions, plus where a decode step's time goes."""
from __future__ import annotations

import statistics
import time

import click
import torch

from .generate import decode_one_token, prefill
from .gpu_weights_option import gpu_weights_option

PARTS = ("expert_wait_s", "attention_s", "mlp_s", "forward_s")


def _snapshot(model) -> dict:
    t = dict(model.timing)
    t.update({k: v for k, v in getattr(model.experts, "stats", {}).items() if k.endswith("_s")})
    return t


def bench_pp(model, n: int, ctx: int, gen: torch.Generator) -> float:
    """Seconds to prefill n random tokens into an empty cache."""
    ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()
    cache = model.new_cache(ctx)
    t0 = time.perf_counter()
    prefill(model, cache, ids)
    return time.perf_counter() - t0


def bench_tg(model, n: int, ctx: int, gen: torch.Generator) -> tuple[float, dict]:
    """Seconds for n greedy decode steps after one prompt token; and the per-part time deltas of those steps."""
    cache = model.new_cache(ctx)
    tok = int(torch.argmax(prefill(model, cache, [int(torch.randint(0, model.cfg.vocab_size, (1,), generator=gen))])))
    before = _snapshot(model)
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(torch.argmax(decode_one_token(model, cache, tok)))
    wall = time.perf_counter() - t0
    after = _snapshot(model)
    return wall, {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_s")}


def run_bench(model, pp: int, tg: int, reps: int, seed: int = 0, warmup: bool = True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ctx = max(pp, tg + 1) + 1
    if warmup:
        bench_pp(model, pp or 8, ctx, gen)        # also fills lazily built expert caches
        bench_tg(model, 2, ctx, gen)
    res = {"pp": [], "tg": [], "tg_parts": []}
    for _ in range(reps):
        if pp:
            res["pp"].append(pp / bench_pp(model, pp, ctx, gen))
        if tg:
            wall, parts = bench_tg(model, tg, ctx, gen)
            res["tg"].append(tg / wall)
            res["tg_parts"].append({**parts, "wall_s": wall})
    return res


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (0.0, 0.0)


def decode_breakdown(parts: list[dict], tg: int) -> dict[str, float]:
    """Milliseconds per decode step: experts (waiting on the routed experts), attention, other MLP work (router,
    shared experts, dense MLPs), head + norms + embedding, loop overhead (sampling, batch building) and the
    executor's own routed-expert compute time (overlaps the shared experts)."""
    n = tg * len(parts)
    tot = {k: sum(p.get(k, 0.0) for p in parts) for k in set().union(*parts)}
    step = tot["wall_s"] / n
    wait, attn, mlp, fwd = (tot.get(k, 0.0) / n for k in PARTS)
    return {"step_ms": 1e3 * step, "experts_wait_ms": 1e3 * wait, "attention_ms": 1e3 * attn,
            "router_shared_dense_mlp_ms": 1e3 * (mlp - wait), "head_norm_embed_ms": 1e3 * (fwd - attn - mlp),
            "loop_overhead_ms": 1e3 * (step - fwd), "cpu_expert_compute_ms": 1e3 * tot.get("expert_compute_s", 0.0) / n}


@click.command("bench")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--pp", default=512, show_default=True, type=click.IntRange(0), help="Prompt tokens per pp test.")
@click.option("--tg", default=128, show_default=True, type=click.IntRange(0), help="Generated tokens per tg test.")
@click.option("--reps", "-r", default=3, show_default=True, type=click.IntRange(1), help="Repetitions.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random prompt tokens.")
@click.option("--dense-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="dtype of the dense layers (auto: bfloat16 on CUDA, float32 on the CPU).")
@click.option("--device", default=None, help="torch device for the dense layers (default: cuda if available).")
@click.option("--reference-experts", is_flag=True, help="Time the torch reference experts instead of the kernels.")
@gpu_weights_option
def bench(model_dir, pp, tg, reps, seed, dense_dtype, device, reference_experts, gpu_weights):
    """Benchmark prompt processing and token generation of the converted model in MODEL_DIR.

    \b
    Examples:
      ktrun bench converted/                       # pp512 and tg128, 3 repetitions
      ktrun bench converted/ --pp 64 --tg 16 --reps 2
    """
    from .loaded_model import load_model
    from .loader import LoadError

    try:
        lm = load_model(model_dir, device=device, use_kernels=False if reference_experts else None,
                        gpu_weights=gpu_weights, dtype=None if dense_dtype == "auto" else getattr(torch, dense_dtype))
    except (LoadError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    with lm:
        m, conv = lm.model, lm.converted
        name = f"{m.cfg.model_type} {conv.geometry.method} experts"
        backend = f"{conv.device.type} {str(conv.dtype)[6:]} dense + {type(m.experts).__name__}"
        res = run_bench(m, pp, tg, reps, seed)
    click.echo(f"quantized GPU layers: {conv.gpu_weights}\n")
    click.echo(f"| {'model':<28} | {'backend':<36} | {'test':>6} | {'t/s':>20} |")
    click.echo(f"| {'-' * 28} | {'-' * 36} | {'-' * 6}:| {'-' * 20}:|")
    for key, n in (("pp", pp), ("tg", tg)):
        if n:
            mu, sd = mean_sd(res[key])
            click.echo(f"| {name:<28} | {backend:<36} | {key + str(n):>6} | {mu:>11.2f} ± {sd:>6.2f} |")
    if tg:
        b = decode_breakdown(res["tg_parts"], tg)
        click.echo(f"\ndecode step {b['step_ms']:.2f} ms: waiting on CPU experts {b['experts_wait_ms']:.2f} ms, "
                   f"attention {b['attention_ms']:.2f} ms, router+shared/dense MLP {b['router_shared_dense_mlp_ms']:.2f} ms, "
                   f"head/norms/embedding {b['head_norm_embed_ms']:.2f} ms, loop overhead {b['loop_overhead_ms']:.2f} ms")
        click.echo(f"CPU routed-expert compute {b['cpu_expert_compute_ms']:.2f} ms per step "
                   f"(runs while the shared experts compute)")
