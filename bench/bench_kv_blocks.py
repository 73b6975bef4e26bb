"""Decode speed of the blocked KV cache against the contiguous per-request cache it replaced, alternated in one run.

Two measurements, each over four caches, alternated:
1. one attention layer, one decode token, at DeepSeek-V3's MLA cache width (kv_lora_rank 512 + rope 64; 16 heads)
   and a Qwen3-MoE GQA shape (32 query / 4 KV heads of 128), contexts 1024 and 4096: CPU microseconds per step (one
   thread), where the cache read is a large part of the work;
2. whole-model greedy decode (tok/s) of the default model (or --model-dir) at --ctx prompt lengths.

The four caches:
- contiguous: the pre-block layout (one growing tensor per layer and kind per request), reimplemented here as the
  baseline;
- one_run: a request alone in the pool (its blocks are consecutive: attention reads one view per layer and kind);
- two_runs: a request continuing a prefix another request left in the prefix cache (the shared run, then its own);
- gathered: a request whose blocks are interleaved with another's (more than MAX_RUNS runs: one index_select copy
  per layer and kind per step, the fallback).

    .venv/bin/python bench/bench_kv_blocks.py                  # the embedded default model, converted int4
    .venv/bin/python bench/bench_kv_blocks.py --model-dir converted/ --ctx 128 2048 --tg 64 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads, as `ktrun` does (runtime/cli/__init__.py)

import torch

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


class ContiguousCache:
    """The cache before blocks: per layer one tensor per kind, grown by doubling; attention reads a prefix view."""

    def __init__(self, num_layers, widths, ctx, dtype, device):
        self.ctx, self.dtype, self.device, self.widths = ctx, dtype, device, widths
        self.layers = [None] * num_layers
        self.length, self.tokens = 0, []

    def reserve(self, total):
        pass

    def write(self, layer, start, values):
        n = values[0].shape[0]
        bufs = self.layers[layer]
        cap = 0 if bufs is None else bufs[0].shape[0]
        if start + n > cap:
            new_cap = min(self.ctx, max(start + n, 2 * cap, 64))
            new = [torch.zeros((new_cap, *w), dtype=self.dtype, device=self.device) for w in self.widths]
            if bufs is not None:
                for a, b in zip(new, bufs):
                    a[:cap] = b
            self.layers[layer] = bufs = new
        for b, v in zip(bufs, values):
            b[start:start + n] = v
        return [[b[: start + n] for b in bufs]]            # one run


def convert_default(work: Path) -> Path:
    src = REPO / "ktconvert" / "data" / "default_model"
    out = work / "default-model"
    subprocess.run([str(BIN / "ktconvert"), "quantize", str(src), "-o", str(out), "--method", "int4-amx",
                    "--gpu-method", "rtn-int4", "--quiet"], check=True, cwd=REPO)
    return out


def decode_rate(model, kind: str, context: int, tg: int, gen: torch.Generator) -> float:
    """Tokens/s of tg greedy decode steps after a random prompt of `context` tokens."""
    from ktrun.generate import decode_one_token, prefill
    from ktrun.models.kv_cache import MAX_RUNS
    from ktrun.prefix_cache import PrefixCache, PrefixCacheConfig

    ctx, B, pool = context + tg + 1, model.kv_pool.block_size, model.kv_pool
    prompt = torch.randint(0, model.cfg.vocab_size, (context,), generator=gen).tolist()
    keep, pc, todo = [], None, prompt
    if kind == "contiguous":
        cache = ContiguousCache(model.cfg.num_layers, model.arch.cache_widths(model.cfg), ctx, model.dtype,
                                model.device)
    elif kind == "two_runs":                       # the prefix comes from the prefix cache, computed by another
        pc = PrefixCache(pool, {"bench": "kv_blocks"}, PrefixCacheConfig(ram_bytes=0))
        first = model.new_cache(ctx)
        prefill(model, first, prompt)
        pc.publish(first)
        cache = model.new_cache(ctx)
        todo = prompt[pc.match(cache, prompt):]
        keep = [first]
    else:
        cache = model.new_cache(ctx)
        if kind == "gathered":                     # another request takes every other block
            other = model.new_cache(ctx)
            for i in range(1, -(-ctx // B) + 1):
                cache.reserve(min(i * B, ctx))
                other.reserve(min(i * B, ctx))
            keep = [other]
    tok = int(torch.argmax(prefill(model, cache, todo)))
    runs = len(getattr(cache, "_runs", [0]))
    assert runs == {"one_run": 1, "two_runs": 2}.get(kind, runs) and (kind != "gathered" or runs > MAX_RUNS), runs
    t0 = time.perf_counter()
    for _ in range(tg):
        tok = int(torch.argmax(decode_one_token(model, cache, tok)))
    dt = time.perf_counter() - t0
    if pc is not None:                             # detach the prefix cache again, its blocks back to the pool
        cache.release()
        first.release()
        pool.on_unused = pool.reclaim = None
        for b in pc.unused:
            pool.free(b)
    del keep
    return tg / dt


LAYER_SHAPES = {
    # name: hub config fields of one decoder layer's attention
    "mla_dsv3": {"model_type": "deepseek_v3", "hidden_size": 1024, "num_attention_heads": 16, "kv_lora_rank": 512,
                 "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 384},
    "gqa_qwen3": {"model_type": "qwen3_moe", "hidden_size": 1024, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "head_dim": 128},
}


def layer_setup(name: str):
    """(cfg, weights, attention fn, cache widths) of one random attention layer."""
    from ktlayouts.families import parse_config
    from ktrun.models import arch_module

    hub = dict(LAYER_SHAPES[name], vocab_size=16, num_hidden_layers=1, intermediate_size=64,
               moe_intermediate_size=64, n_routed_experts=2, num_experts=2, num_experts_per_tok=1, n_group=1,
               topk_group=1)
    cfg = parse_config(hub)
    arch = arch_module(cfg.model_type)
    g = torch.Generator().manual_seed(1)
    H, nh, p = cfg.hidden_size, cfg.num_heads, "model.layers.0.self_attn."

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    if cfg.is_mla:
        R, dr, dn, dv, qr = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
        w = {"q_a_proj.weight": rnd(qr, H), "q_a_layernorm.weight": torch.ones(qr),
             "q_b_proj.weight": rnd(nh * (dn + dr), qr), "kv_a_proj_with_mqa.weight": rnd(R + dr, H),
             "kv_a_layernorm.weight": torch.ones(R), "kv_b_proj.weight": rnd(nh * (dn + dv), R),
             "o_proj.weight": rnd(H, nh * dv)}
    else:
        hd, nkv = cfg.head_dim, cfg.num_kv_heads
        w = {"q_proj.weight": rnd(nh * hd, H), "k_proj.weight": rnd(nkv * hd, H), "v_proj.weight": rnd(nkv * hd, H),
             "o_proj.weight": rnd(H, nh * hd), "q_norm.weight": torch.ones(hd), "k_norm.weight": torch.ones(hd)}
    return cfg, {p + k: v for k, v in w.items()}, arch, [tuple(x) for x in arch.cache_widths(cfg)]


def layer_caches(name: str, context: int, room: int) -> dict:
    """The four caches of one attention layer, each holding `context` random positions, with room for more."""
    from ktrun.models.kv_cache import MAX_RUNS, Batch, BlockLayout, BlockPool, SeqCache
    from ktrun.prefix_cache import PrefixCache, PrefixCacheConfig

    _cfg, _w, _arch, widths = LAYERS[name]
    pool = BlockPool(BlockLayout(1, tuple(widths)), torch.float32, "cpu")
    ctx, B = context + room, pool.block_size
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 16, (context,), generator=g).tolist()

    def fill(cache, ids):                          # positions of ids get random KV, committed with their tokens
        batch = Batch.build([(cache, ids)], "cpu")
        cache.write(0, cache.length, [torch.randn(len(ids), *wd, generator=g) for wd in widths])
        batch.commit()

    caches = {"contiguous": ContiguousCache(1, widths, ctx, torch.float32, "cpu"), "one_run": SeqCache(pool, ctx)}
    fill(caches["contiguous"], prompt)
    fill(caches["one_run"], prompt)
    pc = PrefixCache(pool, {"bench": "kv_blocks"}, PrefixCacheConfig(ram_bytes=0))
    first = SeqCache(pool, ctx)                    # computed the prefix the two_runs request reads
    fill(first, prompt)
    pc.publish(first)
    caches["two_runs"] = SeqCache(pool, ctx)
    fill(caches["two_runs"], prompt[pc.match(caches["two_runs"], prompt):])
    gathered, other = SeqCache(pool, ctx), SeqCache(pool, ctx)
    for i in range(1, -(-ctx // B) + 1):           # another request takes every other block
        gathered.reserve(min(i * B, ctx))
        other.reserve(min(i * B, ctx))
    fill(gathered, prompt)
    caches["gathered"] = gathered
    assert [len(caches[k]._runs) for k in ("one_run", "two_runs")] == [1, 2] and len(gathered._runs) > MAX_RUNS
    caches["_keep"] = (first, other, pc)
    return caches


def layer_steps_us(name: str, cache, steps: int) -> float:
    """CPU microseconds per decode step of one attention layer over `cache` (each step adds a position). CPU time
    of this process, one torch thread: on a machine shared with other work, wall time measures the others."""
    from ktrun.models.kv_cache import Batch

    cfg, w, arch, _widths = LAYERS[name]
    x = torch.ones(1, cfg.hidden_size)
    t0 = time.process_time()
    for _ in range(steps):
        batch = Batch.build([(cache, [1])], "cpu")
        cos, sin = ROPES[name].cos_sin(batch.positions, torch.float32)
        arch.attention(cfg, w, "model.layers.0.self_attn.", x, batch, 0, ROPES[name], cos, sin)
        batch.commit()
    return (time.process_time() - t0) / steps * 1e6


LAYERS: dict = {}
ROPES: dict = {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="a converted directory (default: convert the embedded model)")
    ap.add_argument("--ctx", type=int, nargs="+", default=[128, 1024], help="prompt lengths decoded after (model)")
    ap.add_argument("--layer-ctx", type=int, nargs="+", default=[1024, 4096], help="contexts of the layer test")
    ap.add_argument("--tg", type=int, default=64, help="decode steps per measurement (model)")
    ap.add_argument("--layer-steps", type=int, default=8, help="decode steps per measurement (layer)")
    ap.add_argument("--rounds", type=int, default=7, help="alternations of the four caches")
    ap.add_argument("--parts", nargs="+", choices=["layer", "model"], default=["layer", "model"])
    a = ap.parse_args()
    kinds = ("contiguous", "one_run", "two_runs", "gathered")

    def report(prefix: str, rates: dict, unit: str, higher_is_better: bool) -> None:
        for k in kinds:
            print(f"{prefix}_{k}: {statistics.median(rates[k]):.1f} {unit}")
        base = statistics.median(rates["contiguous"])
        for k in kinds[1:]:
            r = statistics.median(rates[k]) / base
            print(f"{prefix}_{k}_speed_vs_contiguous: {r if higher_is_better else 1 / r:.3f} x")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from ktrun.models.layers import Rope

    for name in LAYER_SHAPES if "layer" in a.parts else ():
        LAYERS[name] = layer_setup(name)
        ROPES[name] = Rope(LAYERS[name][0].rope, "cpu")
        for context in a.layer_ctx:
            caches = layer_caches(name, context, (a.rounds + 1) * a.layer_steps + 1)
            for k in kinds:
                layer_steps_us(name, caches[k], a.layer_steps // 4 or 1)     # warm up
            us = {k: [] for k in kinds}
            for _ in range(a.rounds):
                for k in kinds:
                    us[k].append(layer_steps_us(name, caches[k], a.layer_steps))
            report(f"layer_{name}_ctx{context}", us, "us/step", higher_is_better=False)

    torch.set_num_threads(threads)
    if "model" not in a.parts:
        return 0
    from ktrun.loaded_model import load_model

    with tempfile.TemporaryDirectory(prefix="bench_kv_blocks_") as tmp:
        model_dir = a.model_dir or convert_default(Path(tmp))
        with load_model(model_dir) as lm:
            model, gen = lm.model, torch.Generator().manual_seed(0)
            print(f"model: {model.cfg.model_type}, {model.cfg.num_layers} layers, KV block "
                  f"{model.kv_pool.block_size} positions, {model.device.type} {str(model.dtype)[6:]}")
            decode_rate(model, "one_run", 16, 4, gen)          # warm up
            for context in a.ctx:
                rates = {k: [] for k in kinds}
                for _ in range(a.rounds):
                    for k in kinds:
                        rates[k].append(decode_rate(model, k, context, a.tg, gen))
                report(f"model_ctx{context}_tg{a.tg}", rates, "tok/s", higher_is_better=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
