"""What an activation profile is worth on the embedded default model (DeepSeek-V3 architecture, 3 MoE layers x 16
experts, top-4; int4 experts), measured honestly, and hot-expert decode speed.

Texts (all Python standard library, the model's own data source, ktconvert/default_model/data.py):
  A-fit      Python source of the model's training files (every 8th file): the domain half the profile is taken on
  A-heldout  ktconvert/data/default_model/heldout_eval.txt: Python source of files the model never saw
  B          English prose: the documentation topics of pydoc_data/topics.py (a different domain)
Every text is run by ktrun (all experts on the CPU kernels) and its routing counted (ktconvert.profile); a static
placement's hit ratio on a text is then the share of that text's routed calls the placed experts cover. Two cells
are re-measured through the real hybrid runtime (HybridExperts, hot experts computed by torch) to show the two agree.
Budgets are shares of the 48 routed experts; "random" is the expected hit ratio of experts chosen without a profile
(exactly the share); "oracle" ranks on the measured text itself (an upper bound no static profile reaches).

Dynamic vs static: a stream of 512-token segments alternating A-heldout / B (each segment its own request), run in
32-token steps through the real runtime with asynchronous swaps; static = frequency placement from the A-fit profile;
dynamic = the same start (or empty slots) kept fresh by --dynamic-experts.

Decode: tg tokens/s with 0 / 10 / 50% of the experts hot. Without CUDA the "GPU" is torch on the CPU, sharing the
two cores with the kernels: those numbers say nothing about a real GPU (bench/device_check.sh measures that).

    .venv/bin/python bench/bench_hot_experts.py [--tokens 6000] [--device cuda] [--decode-only]
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from ktlayouts.expert_placement import STRATEGIES
from ktlayouts.expert_profile import ExpertProfile, ranking, summary_lines
from ktrun.cli.cmd_bench import bench_tg
from ktrun.experts.hot import describe
from ktrun.experts.placement import Budget, HotExpertOptions, hit_ratio, plan_placement
from ktrun.loaded_model import load_model
from ktrun.models.kv_cache import Batch

from ktconvert.default_model.data import split_files
from ktconvert.pipeline import ConvertOptions, convert
from ktconvert.profile import run_profile

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "ktconvert" / "data" / "default_model"
SHARES = (0.05, 0.10, 0.25, 0.50)


def texts(n_chars: int) -> dict[str, str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, _held = split_files(stdlib)
    fit = "".join(p.read_text(encoding="utf-8") for p in train[::8])[:n_chars]
    held = (DEFAULT_MODEL / "heldout_eval.txt").read_text()[:n_chars]
    topics = ast.literal_eval(ast.parse((stdlib / "pydoc_data" / "topics.py").read_text()).body[-1].value)
    prose = "\n\n".join(topics[k] for k in sorted(topics))[:n_chars]
    return {"A-fit": fit, "A-heldout": held, "B": prose}


def converted(out: Path) -> Path:
    if not (out / "manifest.json").exists():
        convert(DEFAULT_MODEL, out, ConvertOptions(method="int4-amx", gpu_method="bf16"), show_progress=False)
    return out


def profile_of(lm, text: str, tokens: int, heldout_every: int) -> ExpertProfile:
    return run_profile(lm.model, lm.tokenizer, [text], chunk_tokens=256, heldout_every=heldout_every,
                       max_tokens=tokens, progress=False, text_info={"source": "bench"})


def oracle(counts: dict, cells: int) -> dict:
    flat = sorted(((-float(c[e]), L, int(e)) for L, c in counts.items() for e in ranking(c)))[:cells]
    out: dict[int, list] = {L: [] for L in counts}
    for _c, L, e in flat:
        out[L].append(e)
    return out


def runtime_hit_ratio(conv: Path, text_ids: list[int], opts: HotExpertOptions, device) -> float:
    with load_model(conv, device=device, hot_experts=opts) as lm:
        for i in range(0, len(text_ids), 2048):            # sequences of 2048 tokens in 256-token chunks, as profiled
            seq = text_ids[i:i + 2048]
            cache = lm.model.new_cache(len(seq))
            for c in range(0, len(seq), 256):
                lm.model.forward(Batch.build([(cache, seq[c:c + 256])], lm.model.device))
        return lm.model.experts.stats["gpu_hit_ratio"]


def stream_hit_ratio(conv: Path, segments: list[tuple[str, list[int]]], opts: HotExpertOptions, device,
                     step_tokens: int = 32) -> dict:
    """Run the segments one after another (each its own sequence) in step_tokens forwards; hit ratio per domain."""
    with load_model(conv, device=device, hot_experts=opts) as lm:
        ex = lm.model.experts
        per: dict[str, list[int]] = {}
        for name, ids in segments:
            cache = lm.model.new_cache(len(ids) + 1)
            h0, c0 = (sum(d.values()) for d in ex.hit_counts())
            for i in range(0, len(ids), step_tokens):
                lm.model.forward(Batch.build([(cache, ids[i:i + step_tokens])], lm.model.device))
            h1, c1 = (sum(d.values()) for d in ex.hit_counts())
            acc = per.setdefault(name, [0, 0])
            acc[0] += h1 - h0
            acc[1] += c1 - c0
        s = ex.stats
        return {"all": s["gpu_hit_ratio"], **{k: h / c for k, (h, c) in per.items()}, "swaps": s["expert_swaps"]}


def decode_rates(conv: Path, prof_path: Path | None, device, tg: int, reps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for share in (0.0, 0.10, 0.50):
        opts = None if share == 0 else HotExpertOptions(profile=str(prof_path) if prof_path else None,
                                                        budget=Budget(ratio=share),
                                                        strategy="frequency" if prof_path else "uniform")
        with load_model(conv, device=device, hot_experts=opts) as lm:
            bench_tg(lm.model, 4, tg + 2, gen)                               # warm-up
            best, hits = 0.0, None
            for _ in range(reps):
                before = lm.model.experts.hit_counts() if opts else None
                wall, _parts = bench_tg(lm.model, tg, tg + 2, gen)
                best = max(best, tg / wall)
                if opts:
                    after = lm.model.experts.hit_counts()
                    hits = (sum(after[0].values()) - sum(before[0].values())) / max(
                        1, sum(after[1].values()) - sum(before[1].values()))
            tag = f"{round(100 * share)}pct"
            print(f"default_model_tg{tg}_gpu_experts_{tag}: {best:.1f} tok/s")
            if opts:
                print(f"default_model_tg_gpu_hit_ratio_{tag}: {hits:.4f} ratio")
                print(f"# {describe(lm.model.experts)}", file=sys.stderr)


def synthetic_decode(device, tg: int, reps: int, layers: int = 2, experts: int = 32) -> None:
    """DeepSeek-V3-shaped experts (bench_decode's synthetic model: H 7168, I 2048, int4 g128, top-8, random
    routing): tg tokens/s with 0 / 10 / 50% of the experts on `device` (the lowest ids: routing is random), held in the
    format `auto` picks there (gptq on ktrun's Triton kernel on CUDA without Marlin; bf16 on the CPU stand-in)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from types import SimpleNamespace

    import bench_decode as bd
    from ktlayouts.families import parse_config
    from ktrun.experts.hot_store import HotExpertStore
    from ktrun.experts.hybrid import HybridExperts
    from ktrun.experts.kernel import KernelExperts
    from ktrun.experts.residency import ExpertResidency
    from ktrun.models.model import MoEModel

    cfg = parse_config(bd.v3_config(layers, experts, 16))
    conv = bd.SyntheticConversion(layers, experts, bd.H, bd.I)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    dense = {k: v.to(device=device, dtype=torch.float32 if k.endswith(("gate.weight", "e_score_correction_bias"))
                     else dt) for k, v in bd.dense_weights(cfg).items()}
    gen = torch.Generator().manual_seed(0)
    for share in (0.0, 0.10, 0.50):
        cpu = KernelExperts(conv)
        n = round(share * experts)
        ex = cpu
        if n:
            t0 = time.perf_counter()
            like = SimpleNamespace(geometry=conv.geometry, experts=conv.experts, device=device, dtype=dt,
                                   config=conv.config)
            store = HotExpertStore(like, dict.fromkeys(range(layers), n), "auto")
            print(f"# synthetic hot experts held as {store.format}", file=sys.stderr)
            res = ExpertResidency(experts, dict.fromkeys(range(layers), n))
            for L in range(layers):
                for e in range(n):
                    slot = res.take_free(L)
                    store.load(L, slot, e)
                    res.place(L, e, slot)
            ex = HybridExperts(cpu, store, res)
            print(f"synthetic_hot_expert_load_{round(100 * share)}pct: {time.perf_counter() - t0:.1f} s")
        model = MoEModel(cfg, dense, ex, device, dt)
        bench_tg(model, 2, tg + 2, gen)
        best = max(tg / bench_tg(model, tg, tg + 2, gen)[0] for _ in range(reps))
        tag = f"{round(100 * share)}pct"
        print(f"synthetic_v3_{layers}x{experts}_tg{tg}_gpu_experts_{tag}: {best:.2f} tok/s")
        if n:
            print(f"synthetic_v3_gpu_hit_ratio_{tag}: {ex.stats['gpu_hit_ratio']:.4f} ratio")
        ex.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=6000, help="tokens per text")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "hot_experts"))
    ap.add_argument("--device", default=None, help="where dense layers and hot experts run (default: cuda if present)")
    ap.add_argument("--decode-only", action="store_true", help="only the decode benchmarks (bench/device_check.sh)")
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--synthetic-experts", type=int, default=32, help="experts per layer of the synthetic model")
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    conv = converted(out / "default-model-int4")
    print(f"device: {device.type}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
                                      " (no CUDA: the GPU side is torch on the CPU)"))
    t = texts(6 * args.tokens)
    prof_path = out / "profile-A-fit.json"
    with load_model(conv, device="cpu") as lm:
        ids = {k: lm.tokenizer.encode(v)[: args.tokens] for k, v in t.items()}
        if not prof_path.exists() or args.decode_only is False:
            fit = profile_of(lm, t["A-fit"], args.tokens, heldout_every=5)
            fit.save(prof_path)
        fit = ExpertProfile.load(prof_path)
        if args.decode_only:
            decode_rates(conv, prof_path, device, args.tg, args.reps)
            synthetic_decode(device, args.tg, args.reps, experts=args.synthetic_experts)
            return
        measured = {k: profile_of(lm, t[k], args.tokens, heldout_every=0) for k in ("A-heldout", "B")}
    print(f"tokens_per_text: {args.tokens} tokens")
    for line in summary_lines(fit):
        print("# " + line)
    E, layers = fit.n_experts, fit.moe_layers
    n_all = E * len(layers)
    print("\n# hit ratio (share of routed calls served on the GPU), profile = A-fit; columns: measured on "
          "A-fit (in-sample) / A-heldout / B")
    print(f"# {'budget':>14} | {'strategy':<10} | {'A-fit':>6} | {'A-heldout':>9} | {'B':>6}")
    for share in SHARES:
        cells = round(share * n_all)
        label = f"{round(100 * share)}% ({cells}/{n_all})"
        print(f"# {label:>14} | {'random':<10} | {cells / n_all:>6.3f} | {cells / n_all:>9.3f} | {cells / n_all:>6.3f}")
        for strategy in STRATEGIES:
            pl = plan_placement(fit, E, layers, Budget(ratio=cells / n_all), strategy).experts
            vals = [hit_ratio(fit.counts(), pl)] + [hit_ratio(measured[k].counts(), pl) for k in ("A-heldout", "B")]
            print(f"# {label:>14} | {strategy:<10} | {vals[0]:>6.3f} | {vals[1]:>9.3f} | {vals[2]:>6.3f}")
            key = strategy.replace("-", "_")
            print(f"hit_ratio_{key}_{round(100 * share)}pct_A_heldout: {vals[1]:.4f} ratio")
            print(f"hit_ratio_{key}_{round(100 * share)}pct_B: {vals[2]:.4f} ratio")
        orc = [hit_ratio(measured[k].counts(), oracle(measured[k].counts(), cells)) for k in ("A-heldout", "B")]
        print(f"# {label:>14} | {'oracle':<10} | {'':>6} | {orc[0]:>9.3f} | {orc[1]:>6.3f}")
    # the same numbers through the real hybrid runtime (hot experts computed by torch, routing of that run)
    for strategy, share, text in (("frequency", 0.25, "A-heldout"), ("per-layer", 0.10, "B")):
        cells = round(share * n_all)
        opts = HotExpertOptions(profile=str(prof_path), budget=Budget(ratio=cells / n_all), strategy=strategy)
        got = runtime_hit_ratio(conv, ids[text], opts, device)
        want = hit_ratio(measured[text].counts(), plan_placement(fit, E, layers, Budget(ratio=cells / n_all),
                                                                 strategy).experts)
        tag = f"{strategy.replace('-', '_')}_{round(100 * share)}pct_{text.replace('-', '_')}"
        print(f"runtime_hit_ratio_{tag}: {got:.4f} ratio")
        print(f"runtime_minus_offline_{tag}: {got - want:+.4f} ratio")
    # dynamic vs static on a stream that switches domains
    seg = 512
    segments = []
    for i in range(0, min(len(ids["A-heldout"]), len(ids["B"])) - seg + 1, seg):
        segments += [("A", ids["A-heldout"][i:i + seg]), ("B", ids["B"][i:i + seg])]
    cells = round(0.25 * n_all)
    base = {"budget": Budget(ratio=cells / n_all), "strategy": "frequency"}
    runs = {"static_profile": HotExpertOptions(profile=str(prof_path), **base),
            "dynamic_from_profile": HotExpertOptions(profile=str(prof_path), dynamic=True, window=512, **base),
            "dynamic_from_empty": HotExpertOptions(dynamic=True, window=512, **base)}
    print(f"\n# domain-switching stream: {len(segments)} segments of {seg} tokens (A-heldout, B, ...), 32-token "
          f"steps, 25% of experts hot ({cells}/{n_all}); dynamic window 512 tokens, hysteresis 0.25")
    for name, opts in runs.items():
        r = stream_hit_ratio(conv, segments, opts, device)
        print(f"stream_hit_ratio_{name}: {r['all']:.4f} ratio")
        print(f"stream_hit_ratio_{name}_A_segments: {r['A']:.4f} ratio")
        print(f"stream_hit_ratio_{name}_B_segments: {r['B']:.4f} ratio")
        print(f"stream_swaps_{name}: {r['swaps']} swaps")
    print()
    decode_rates(conv, prof_path, device, args.tg, args.reps)


if __name__ == "__main__":
    main()
