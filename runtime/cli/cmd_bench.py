"""`ktrun bench`: prompt processing (ppN) and token generation (tgN) rates the way llama-bench reports them, mean ±
standard deviation over repetitions, plus where a decode step's time goes; with --speculative, decode after the
prompt with and without drafts, alternating, and the acceptance rate."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import torch

from ..generate import decode_one_token, generate, prefill
from ..sampling import SamplingParams, greedy_tokens
from .decode_bytes import read_bandwidth, weight_bytes_per_token
from .expert_ram_option import expert_ram_from, expert_ram_options
from .gpu_weights_option import gpu_weights_option
from .hot_experts_option import hot_experts_from, hot_experts_options
from .speculative_option import speculative_from, speculative_options

PARTS = ("expert_wait_s", "attention_s", "mlp_s", "forward_s")


def _snapshot(model) -> dict:
    t = dict(model.timing)
    t.update({k: v for k, v in getattr(model.experts, "stats", {}).items() if k.endswith("_s")})
    return t


def bench_pp(model, n: int, ctx: int, gen: torch.Generator, prompt_ids: list[int] | None = None) -> float:
    """Seconds to prefill n random tokens (or the first n of prompt_ids) into an empty cache."""
    ids = prompt_ids[:n] if prompt_ids is not None else torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()
    cache = model.new_cache(ctx)
    t0 = time.perf_counter()
    prefill(model, cache, ids)
    return time.perf_counter() - t0


def bench_tg(model, n: int, ctx: int, gen: torch.Generator, prompt: int = 1) -> tuple[float, dict]:
    """Seconds for n greedy decode steps after a prompt of `prompt` random tokens (one by default: decode from an
    almost empty context; more: decode at that depth, as llama-bench's -gp); and the per-part time deltas of those
    steps. Each step's token is picked as the decode loop's sampler picks a greedy one (sampling.greedy_tokens:
    numpy's argmax; torch's cost ~40 us more in a Qwen3-30B-A3B-shaped step, its caches cold from the kernels)."""
    cache = model.new_cache(ctx)
    try:
        ids = torch.randint(0, model.cfg.vocab_size, (prompt,), generator=gen).tolist()
        tok = greedy_tokens(prefill(model, cache, ids)[None])[0]
        before = _snapshot(model)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = greedy_tokens(decode_one_token(model, cache, tok)[None])[0]
        wall = time.perf_counter() - t0
        after = _snapshot(model)
    finally:
        cache.release()                  # its KV blocks back to the model's pool
    return wall, {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_s")}


def bench_speculative(model, tg: int, reps: int, prompt_ids: list[int], spec) -> dict:
    """Greedy decode of tg tokens after prompt_ids, without and with speculation, alternating per repetition (the
    same machine state for both); -> decode rates (tokens after the first / decode seconds) and draft counts."""
    params = SamplingParams(max_tokens=tg, ignore_eos=True)
    ctx = len(prompt_ids) + tg + 1
    res = {"plain": [], "spec": [], "drafted": 0, "accepted": 0, "steps": 0, "tokens": 0, "same": True}
    for _ in range(reps):
        plain = generate(model, prompt_ids, params, ctx, set())
        out = generate(model, prompt_ids, params, ctx, set(), speculative=spec)
        res["plain"].append((len(plain.tokens) - 1) / plain.decode_s)
        res["spec"].append((len(out.tokens) - 1) / out.decode_s)
        res["same"] &= plain.tokens == out.tokens
        res["drafted"] += out.drafted
        res["accepted"] += out.accepted
        res["steps"] += out.steps - 1                 # decode forwards (the first token came from the prefill)
        res["tokens"] += len(out.tokens) - 1
    return res


def speculative_lines(res: dict) -> list[str]:
    plain, spec = mean_sd(res["plain"]), mean_sd(res["spec"])
    return [f"spec_acceptance_rate: {res['accepted'] / max(res['drafted'], 1):.4f}",
            f"spec_draft_tokens: {res['drafted']}",
            f"spec_tokens_per_forward: {res['tokens'] / max(res['steps'], 1):.3f}",
            f"spec_decode_speedup: {spec[0] / plain[0] if plain[0] else 0.0:.3f}",
            f"spec_greedy_tokens_identical: {res['same']}"]


class _Hits:
    """GPU hit counts of the timed runs, by phase, when the executor keeps them (ktrun.experts.hybrid)."""

    def __init__(self, experts):
        self.read = getattr(experts, "hit_counts", None)
        self.by_phase: dict[str, tuple[dict, dict]] = {}

    def measure(self, phase: str, fn, *args):
        before = self.read() if self.read else None
        out = fn(*args)
        if before is not None:
            after = self.read()
            hits, calls = self.by_phase.setdefault(phase, ({}, {}))
            for L in after[1]:
                hits[L] = hits.get(L, 0) + after[0][L] - before[0].get(L, 0)
                calls[L] = calls.get(L, 0) + after[1][L] - before[1].get(L, 0)
        return out


def run_bench(model, pp: int, tg: int, reps: int, seed: int = 0, warmup: bool = True,
              prompt_ids: list[int] | None = None) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ctx = max(pp, tg + 1) + 1
    if warmup:
        bench_pp(model, pp or 8, ctx, gen, prompt_ids)        # also fills lazily built expert caches
        bench_tg(model, 2, ctx, gen)
    res = {"pp": [], "tg": [], "tg_parts": [], "tier": []}
    hits = _Hits(model.experts)
    stats = (lambda: dict(getattr(model.experts, "stats", {})))
    for _ in range(reps):
        if pp:
            res["pp"].append(pp / hits.measure("pp", bench_pp, model, pp, ctx, gen, prompt_ids))
        if tg:
            before = stats()
            wall, parts = hits.measure("tg", bench_tg, model, tg, ctx, gen)
            res["tg"].append(tg / wall)
            res["tg_parts"].append({**parts, "wall_s": wall})
            res["tier"].append((before, stats()))    # RAM-tier counters around the tg run (ktrun.experts.tiered)
    res["hits"] = hits.by_phase                   # phase -> (GPU-served calls, routed calls) per layer
    return res


def hit_ratio_lines(by_phase: dict, per_layer: bool) -> list[str]:
    """`gpu_hit_ratio: X` (all timed runs), per phase, and per layer on request."""
    if not by_phase:
        return []
    tot_h, tot_c = {}, {}
    for hits, calls in by_phase.values():
        for L in calls:
            tot_h[L] = tot_h.get(L, 0) + hits[L]
            tot_c[L] = tot_c.get(L, 0) + calls[L]

    def ratio(h, c):
        return sum(h.values()) / sum(c.values()) if sum(c.values()) else 0.0

    lines = [f"gpu_hit_ratio: {ratio(tot_h, tot_c):.4f}"]
    lines += [f"gpu_hit_ratio_{phase}: {ratio(h, c):.4f}" for phase, (h, c) in by_phase.items()]
    if per_layer:
        lines += [f"gpu_hit_ratio_layer_{L}: {tot_h[L] / tot_c[L] if tot_c[L] else 0.0:.4f}" for L in sorted(tot_c)]
    return lines


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


def roofline_lines(read: dict[str, int], step_s: float, bandwidth: float) -> str:
    """Weight bytes per decoded token and the achieved read rate of a decode step vs the measured bandwidth."""
    mb = {k: v / 1e6 for k, v in read.items()}
    achieved = read["total"] / step_s / 1e9 if step_s > 0 else 0.0
    out = (f"\nweights_read_per_token: {mb['total']:.3f} MB (experts {mb['experts']:.3f} MB, dense "
           f"{mb['dense']:.3f} MB, head {mb['head']:.3f} MB)\ndecode_weight_read: {achieved:.2f} GB/s")
    if bandwidth > 0:
        out += (f"\nread_bandwidth_measured: {bandwidth / 1e9:.2f} GB/s\n"
                f"decode_fraction_of_bandwidth: {achieved * 1e9 / bandwidth:.3f}")
    return out


@click.command("bench")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--pp", default=None, type=click.IntRange(0),
              help="Prompt tokens per pp test [default: 512; with --prompt-file the whole file].")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Take the pp test's prompt tokens from this text file (e.g. held-out text of the served domain) "
                   "instead of random tokens.")
@click.option("--per-layer", is_flag=True, help="Also print the GPU hit ratio of every MoE layer.")
@click.option("--tg", default=128, show_default=True, type=click.IntRange(0), help="Generated tokens per tg test.")
@click.option("--reps", "-r", default=3, show_default=True, type=click.IntRange(1), help="Repetitions.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random prompt tokens.")
@click.option("--dense-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="dtype of the dense layers (auto: bfloat16 on CUDA, float32 on the CPU).")
@click.option("--device", default=None, help="torch device for the dense layers (default: cuda if available).")
@click.option("--reference-experts", is_flag=True, help="Time the torch reference experts instead of the kernels.")
@gpu_weights_option
@hot_experts_options()
@expert_ram_options
@speculative_options
def bench(model_dir, pp, prompt_file, per_layer, tg, reps, seed, dense_dtype, device, reference_experts, gpu_weights,
          **hot):
    """Benchmark prompt processing and token generation of the converted model in MODEL_DIR; the KV-cache bytes per
    token and, for linear-attention models, the recurrent-state bytes per request; with hot experts on
    the GPU, also the GPU hit ratio (share of routed expert calls served on the GPU); with --expert-ram, the RAM
    tier's disk bytes per token, disk read rate, tier and prefetch hit ratios over the tg runs.

    \b
    Examples:
      ktrun bench converted/                       # pp512 and tg128, 3 repetitions
      ktrun bench converted/ --pp 64 --tg 16 --reps 2
      ktrun bench converted/ --profile profile.json --gpu-experts 8 --prompt-file heldout.txt --per-layer
      ktrun bench converted/ --expert-ram 64GB --pp 0 --tg 32    # experts beyond 64 GB read from disk
      ktrun bench converted/ --prompt-file edit.py --speculative ngram --draft-tokens 4   # decode with drafts
      ktrun bench converted/ --prompt-file code.py --speculative mtp --draft-tokens 1      # MTP-layer drafts

    With --speculative, two more rows time greedy decoding after the prompt (--prompt-file, else pp random
    tokens), without and with drafts, alternating per repetition; the acceptance rate (accepted / drafted tokens),
    tokens per decode forward and the speedup follow the table.
    """
    from ktlayouts.expert_profile import ExpertProfile, ProfileError, summary_lines

    from ..experts.hot import describe
    from ..loaded_model import load_model
    from ..loader import LoadError

    spec = speculative_from(hot)
    ram_opts = expert_ram_from(hot)
    hot_opts = hot_experts_from(hot)
    try:
        lm = load_model(model_dir, device=device, use_kernels=False if reference_experts else None,
                        gpu_weights=gpu_weights, dtype=None if dense_dtype == "auto" else getattr(torch, dense_dtype),
                        hot_experts=hot_opts, expert_ram=ram_opts, mtp=spec is not None and spec.needs_mtp)
        spec = spec.with_mtp(lm.mtp) if spec is not None else None
        summary = summary_lines(ExpertProfile.load(hot_opts.profile)) if hot_opts and hot_opts.profile else []
    except (LoadError, ProfileError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    with lm:
        m, conv = lm.model, lm.converted
        prompt_ids = None
        if prompt_file:
            prompt_ids = lm.tokenizer.encode(Path(prompt_file).read_text(encoding="utf-8", errors="replace"))
            pp = len(prompt_ids) if pp is None else min(pp, len(prompt_ids))
        pp = 512 if pp is None else pp
        name = f"{m.cfg.model_type} {conv.geometry.method} experts"
        backend = f"{conv.device.type} {str(conv.dtype)[6:]} dense + {type(m.experts).__name__}"
        hot_line = describe(m.experts)
        res = run_bench(m, pp, tg, reps, seed, prompt_ids=prompt_ids)
        spec_res = None
        if spec is not None and tg:
            ids = prompt_ids[:pp] if prompt_ids is not None else torch.randint(
                0, m.cfg.vocab_size, (max(pp, 1),), generator=torch.Generator().manual_seed(seed)).tolist()
            spec_res = bench_speculative(m, tg, reps, ids, spec)
        read = weight_bytes_per_token(m, conv) if tg else None
        bandwidth = read_bandwidth(m.experts) if tg and conv.device.type == "cpu" else 0.0
        from ..experts.tiered import find_tier
        tier = find_tier(m.experts)
        measured = tier.measured_resident_bytes() if tier is not None else None
        from ..cache_budget import cache_lines
        cache = cache_lines(m.cfg, m.dtype, max(pp, tg + 1) + 1)
    click.echo(f"quantized GPU layers: {conv.gpu_weights}")
    click.echo(hot_line + "\n")
    for line in summary:
        click.echo(line)
    click.echo(f"| {'model':<28} | {'backend':<36} | {'test':>6} | {'t/s':>20} |")
    click.echo(f"| {'-' * 28} | {'-' * 36} | {'-' * 6}:| {'-' * 20}:|")
    for key, n in (("pp", pp), ("tg", tg)):
        if n:
            mu, sd = mean_sd(res[key])
            click.echo(f"| {name:<28} | {backend:<36} | {key + str(n):>6} | {mu:>11.2f} ± {sd:>6.2f} |")
    if spec_res is not None:
        tag = f"{spec.method}{spec.draft_tokens}"
        for key, label in (("plain", f"tg{tg}@p"), ("spec", f"tg{tg}+{tag}")):
            mu, sd = mean_sd(spec_res[key])
            click.echo(f"| {name:<28} | {backend:<36} | {label:>6} | {mu:>11.2f} ± {sd:>6.2f} |")
        click.echo(f"\n(tg{tg}@p: greedy decode after the {len(ids)}-token prompt; tg{tg}+{tag}: the same with "
                   f"{spec.method} drafts of up to {spec.draft_tokens} tokens)")
        for line in speculative_lines(spec_res):
            click.echo(line)
    if tg:
        b = decode_breakdown(res["tg_parts"], tg)
        click.echo(f"\ndecode step {b['step_ms']:.2f} ms: waiting on CPU experts {b['experts_wait_ms']:.2f} ms, "
                   f"attention {b['attention_ms']:.2f} ms, router+shared/dense MLP {b['router_shared_dense_mlp_ms']:.2f} ms, "
                   f"head/norms/embedding {b['head_norm_embed_ms']:.2f} ms, loop overhead {b['loop_overhead_ms']:.2f} ms")
        click.echo(f"CPU routed-expert compute {b['cpu_expert_compute_ms']:.2f} ms per step "
                   f"(runs while the shared experts compute)")
        click.echo(roofline_lines(read, b["step_ms"] / 1e3, bandwidth))
    click.echo("")
    for line in cache:
        click.echo(line)
    lines = hit_ratio_lines(res["hits"], per_layer)
    if res["tier"]:
        from ..experts.tiered import tier_lines
        tier = tier_lines(res["tier"][0][0], res["tier"][-1][1], tg * len(res["tier"]), measured)
        if tier:
            click.echo("")
            for line in tier:
                click.echo(line)
    if lines:
        click.echo("")
        for line in lines:
            click.echo(line)
