"""ktrun decode (tg) and prefill (pp) on synthetic stacks shaped like the families with new layer kinds, with where
the time goes.

--shape qwen3-next (default): Qwen3-Next-80B-A3B's layer shapes (hidden 2048; routed experts intermediate 512,
int4-amx group 128, top-10, one sigmoid-gated shared expert of 512; gated DeltaNet with 16 key / 32 value heads of 128
and a width-4 conv, its q|k|v|z and b|a projections fused; gated full attention with 16 heads, 2 KV heads of 256,
rotary on a quarter), every 4th layer full attention.
--shape qwen3.5: Qwen3.5-35B-A3B's (the same widths, top-8, the DeltaNet's projections unfused: in_proj_qkv / z / b
/ a, the text model under model.language_model.).
--shape gpt-oss: gpt-oss-20b's (hidden 2880; experts intermediate 2880 in int8-amx group 32, what its MXFP4 experts
convert to exactly, top-4, biases and the clamped SwiGLU in the kernels; GQA with 64 query / 8 KV heads of 64, q/k/v/o
biases and per-head sinks; sliding-window (128) and full layers alternating).
Only --layers layers and --experts experts per layer, a 4096-token vocabulary; weights are random (packed codes and
scales written straight into the expert layout).

Peer measured in the same run: the kernels alone (ktrun.ops.moe.MoEKernels.forward) replaying the timed decode steps'
expert calls, and the dense part alone (routed experts answering zero); the limit: the machine's read bandwidth
(kernel measurement) against the expert bytes a decode step streams and the dense bytes. Attention time is split by
layer kind (DeltaNet, full, sliding window) by timing the family's attention calls.

    .venv/bin/python bench/bench_decode_hybrid.py [--shape qwen3-next|qwen3.5|gpt-oss] [--layers 4] [--experts 32]
                                                  [--tg 16] [--pp 128] [--reps 3]

--ttft: time to first token of requests sharing a long system prompt (--system tokens, then --question tokens of
their own), prefix cache on vs off, alternated --reps times, through the Engine's prefix-cache calls around the same
prefill (match, prefill the rest, publish, retire): the first request (cold, snapshotting where prompts may part),
the next ones (resuming from the snapshot at the system prompt's last block end). Also the recurrent-state snapshot
and KV bytes of this stack and of the full 48-layer Qwen3-Next-80B-A3B.

    .venv/bin/python bench/bench_decode_hybrid.py --ttft [--system 2048] [--question 32] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import types
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # torch's idle OpenMP threads must not spin on the kernels' CPUs

import torch
from ktlayouts.families import get_family, parse_config
from ktrun.cache_budget import kv_bytes_per_token, state_bytes_per_request
from ktrun.cli.cmd_bench import bench_pp, bench_tg, decode_breakdown
from ktrun.experts.kernel import KernelExperts
from ktrun.generate import prefill
from ktrun.models.kv_cache import BlockPool
from ktrun.models.model import MoEModel
from ktrun.prefix_cache import PrefixCache, PrefixCacheConfig
from synthetic_experts import SyntheticConversion  # bench/ sits on sys.path as the script's folder

VOCAB = 4096
_DELTANET = {"num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
             "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
             "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "max_position_embeddings": 4096}


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    top_k: int
    method: str
    group: int
    shared: int = 0                 # shared expert intermediate (0: none)


SHAPES = {"qwen3-next": Shape(2048, 512, 10, "int4-amx", 128, shared=512),
          "qwen3.5": Shape(2048, 512, 8, "int4-amx", 128, shared=512),
          "gpt-oss": Shape(2880, 2880, 4, "int8-amx", 32)}


def model_config(shape: str, layers: int, experts: int) -> dict:
    s = SHAPES[shape]
    common = {"vocab_size": VOCAB, "hidden_size": s.hidden, "num_hidden_layers": layers,
              "num_experts_per_tok": min(s.top_k, experts)}
    if shape == "gpt-oss":
        return {"model_type": "gpt_oss", **common, "intermediate_size": s.inter, "num_local_experts": experts,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
                "max_position_embeddings": 131072, "rope_theta": 150000.0}
    text = {**common, **_DELTANET, "moe_intermediate_size": s.inter, "shared_expert_intermediate_size": s.shared,
            "num_experts": experts}
    if shape == "qwen3-next":
        return {"model_type": "qwen3_next", **text, "intermediate_size": 5120, "partial_rotary_factor": 0.25,
                "rope_theta": 10000000}
    return {"model_type": "qwen3_5_moe", "text_config": {
        "model_type": "qwen3_5_moe_text", **text, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}}}


def dense_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    names = get_family(cfg.model_type).names
    H, E = cfg.hidden_size, cfg.num_experts

    def rnd(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    la, nh, nkv, hd = cfg.linear_attention, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    zero_centred = cfg.model_type != "gpt_oss"                 # Qwen's RMSNorms scale by 1 + weight
    norm = (lambda n: torch.zeros(n)) if zero_centred else (lambda n: torch.ones(n))
    w = {names.embed: torch.randn(VOCAB, H, generator=g), names.final_norm: norm(H), names.head: rnd(VOCAB, H)}
    for i in range(cfg.num_layers):
        p = names.layer(i)
        w.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H)})
        if cfg.model_type == "gpt_oss":
            I = cfg.moe_intermediate_size
            q = p + "self_attn."
            w.update({q + "q_proj.weight": rnd(nh * hd, H), q + "k_proj.weight": rnd(nkv * hd, H),
                      q + "v_proj.weight": rnd(nkv * hd, H), q + "o_proj.weight": rnd(H, nh * hd),
                      q + "q_proj.bias": torch.zeros(nh * hd), q + "k_proj.bias": torch.zeros(nkv * hd),
                      q + "v_proj.bias": torch.zeros(nkv * hd), q + "o_proj.bias": torch.zeros(H), q + "sinks": rnd(nh),
                      p + "mlp.router.weight": rnd(E, H), p + "mlp.router.bias": rnd(E),
                      p + "mlp.experts.gate_up_proj_bias": rnd(E, 2 * I) * 0.1,
                      p + "mlp.experts.down_proj_bias": rnd(E, H) * 0.1})
            continue
        si = SHAPES["qwen3-next"].shared
        w.update({p + "mlp.gate.weight": rnd(E, H), p + "mlp.shared_expert_gate.weight": rnd(1, H),
                  p + "mlp.shared_expert.gate_proj.weight": rnd(si, H),
                  p + "mlp.shared_expert.up_proj.weight": rnd(si, H),
                  p + "mlp.shared_expert.down_proj.weight": rnd(H, si)})
        if cfg.layer_types[i] == "linear_attention":
            q = p + "linear_attn."
            kd, vd = la.num_k_heads * la.k_head_dim, la.num_v_heads * la.v_head_dim
            w.update({q + "conv1d.weight": rnd(la.conv_dim, 1, la.conv_kernel),
                      q + "A_log": torch.rand(la.num_v_heads, generator=g).log(),
                      q + "dt_bias": torch.ones(la.num_v_heads), q + "norm.weight": torch.ones(la.v_head_dim),
                      q + "out_proj.weight": rnd(H, vd)})
            if cfg.model_type == "qwen3_next":          # q|k|v|z and b|a fused per key head
                w.update({q + "in_proj_qkvz.weight": rnd(2 * kd + 2 * vd, H),
                          q + "in_proj_ba.weight": rnd(2 * la.num_v_heads, H)})
            else:                                       # Qwen3.5: four plain Linears
                w.update({q + "in_proj_qkv.weight": rnd(2 * kd + vd, H), q + "in_proj_z.weight": rnd(vd, H),
                          q + "in_proj_b.weight": rnd(la.num_v_heads, H),
                          q + "in_proj_a.weight": rnd(la.num_v_heads, H)})
        else:
            q = p + "self_attn."
            w.update({q + "q_proj.weight": rnd(2 * nh * hd, H), q + "k_proj.weight": rnd(nkv * hd, H),
                      q + "v_proj.weight": rnd(nkv * hd, H), q + "o_proj.weight": rnd(H, nh * hd),
                      q + "q_norm.weight": torch.zeros(hd), q + "k_norm.weight": torch.zeros(hd)})
    return w


def timed_arch(model: MoEModel, clock: dict) -> None:
    """Wrap the family's attention to add each call's seconds to clock[layer kind]."""
    arch, cfg = model.arch, model.cfg

    def attention(c, w, p, x, batch, layer, *rest):
        t0 = time.perf_counter()
        out = arch.attention(c, w, p, x, batch, layer, *rest)
        clock[cfg.layer_types[layer]] = clock.get(cfg.layer_types[layer], 0.0) + time.perf_counter() - t0
        return out

    model.arch = types.SimpleNamespace(**{k: getattr(arch, k) for k in dir(arch) if not k.startswith("__")})
    model.arch.attention = attention


class NoExperts:
    """Routed experts cost nothing (output zero): times the dense part of a decode step alone."""
    def __init__(self):
        self.stats = {}

    def submit(self, layer, x, ids, weights, out):
        out.zero_()

    def sync(self):
        pass


class Recording(KernelExperts):
    """KernelExperts that keeps copies of every call's inputs, to replay them on the kernels alone."""
    record = False

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def submit(self, layer, x, ids, weights, out):
        if self.record:
            self.calls.append((layer, x.float().contiguous().clone(), ids.clone(), weights.float().clone()))
        super().submit(layer, x, ids, weights, out)


def replay_kernels(ex: Recording, calls, reps: int) -> float:
    best = float("inf")
    outs = [torch.empty(x.shape, dtype=torch.float32) for _, x, _, _ in calls]
    for _ in range(reps):
        t0 = time.perf_counter()
        for (layer, x, ids, w), o in zip(calls, outs):
            ex.moe.forward(layer, x, ids, w, o)
        best = min(best, time.perf_counter() - t0)
    return best


def request_ttft(model, pc, ids: list[int], ctx: int) -> tuple[float, int]:
    """One request's time to its first token's logits with the Engine's prefix-cache calls (pc None: cache off);
    -> (seconds, prompt tokens taken from the cache)."""
    cache = model.new_cache(ctx)
    t0 = time.perf_counter()
    hit = pc.match(cache, ids) if pc is not None else 0
    prefill(model, cache, ids[hit:])
    dt = time.perf_counter() - t0
    if pc is not None:
        pc.publish(cache)
        pc.retire(cache)
    cache.release()
    return dt, hit


def ttft_bench(model, args) -> None:
    gen = torch.Generator().manual_seed(1)
    V = model.cfg.vocab_size
    system = torch.randint(3, V, (args.system,), generator=gen).tolist()
    questions = [torch.randint(3, V, (args.question,), generator=gen).tolist() for _ in range(7 * args.reps + 1)]
    ctx = args.system + args.question + 1
    request_ttft(model, None, system[:64] + questions[0], ctx)                         # warm-up
    t = {k: [] for k in ("off", "first", "second", "third", "second_every")}
    hits = {}
    q = iter(questions[1:])
    for r in range(args.reps):
        # alternated: cache off; a fresh cache's first, second and third request; with --state-every, the second
        t["off"].append(request_ttft(model, None, system + next(q), ctx)[0])
        for name, every in (("", 0), ("_every", args.state_every)):
            pc = PrefixCache(model.kv_pool, {"bench": f"{r}{name}"}, PrefixCacheConfig(ram_bytes=0, state_every=every),
                             model.state_layout)
            for k in ("first", "second", "third") if not name else ("first", "second"):
                dt, hits[k + name] = request_ttft(model, pc, system + next(q), ctx)
                if k + name in t:
                    t[k + name].append(dt)
            pc.close()
            model.kv_pool = BlockPool(model.kv_pool.layout, model.dtype, model.device)   # nothing cached is kept
            if not args.state_every:
                break
    full = parse_config(model_config("qwen3-next", 48, 512))
    n_lin = sum(t == "linear_attention" for t in model.cfg.layer_types)
    print(f"model: {args.shape}-shaped, {model.cfg.num_layers} layers ({n_lin} gated DeltaNet) x {model.cfg.num_experts} experts, "
          f"dense {str(model.dtype)[6:]}; system prompt {args.system} tokens + {args.question}-token question; "
          f"{torch.get_num_threads()} torch threads; load average {os.getloadavg()[0]:.1f}")
    def ms(xs):
        return f"{statistics.fmean(xs) * 1e3:.1f} ms (min {min(xs) * 1e3:.1f})"

    print(f"ttft_cache_off: {ms(t['off'])}")
    print(f"ttft_cache_on_first_request: {ms(t['first'])} ({hits['first']} prompt tokens from the cache)")
    why = (": no snapshot at the system prompt's end yet, one is taken there" if not hits["second"] else
           ": the first request's prompt-end snapshot is the system prompt's end")
    print(f"ttft_cache_on_second_request: {ms(t['second'])} ({hits['second']} prompt tokens from the cache{why})")
    print(f"ttft_cache_on_repeated_system_prompt: {ms(t['third'])} ({hits['third']} prompt tokens from the cache)")
    print(f"ttft_speedup_repeated_system_prompt: {min(t['off']) / min(t['third']):.1f} ratio")
    print(f"ttft_first_request_over_cache_off: {min(t['first']) / min(t['off']):.3f} ratio")
    if args.state_every:
        print(f"ttft_cache_on_second_request_state_every_{args.state_every}: {ms(t['second_every'])} "
              f"({hits['second_every']} prompt tokens from the cache)")
    print(f"snapshot_bytes_this_stack: {model.state_layout.nbytes()} bytes")
    sb, kv = state_bytes_per_request(full, torch.bfloat16), kv_bytes_per_token(full, torch.bfloat16)
    print(f"snapshot_bytes_qwen3_next_80b_bf16: {sb} bytes ({sb / 2**20:.1f} MiB)")
    print(f"kv_bytes_per_token_qwen3_next_80b_bf16: {kv} bytes")
    print(f"snapshot_in_kv_tokens_qwen3_next_80b: {sb / kv:.0f} tokens")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-next")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None, help="per layer (default 32; gpt-oss 8: 25 MB each)")
    ap.add_argument("--tg", type=int, default=16)
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dense-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--ttft", action="store_true", help="Time to first token with the prefix cache on vs off.")
    ap.add_argument("--system", type=int, default=2048, help="--ttft: shared system prompt tokens.")
    ap.add_argument("--question", type=int, default=32, help="--ttft: each request's own tokens after it.")
    ap.add_argument("--state-every", type=int, default=512,
                    help="--ttft: also time a second request with a snapshot every this many tokens (0: no).")
    args = ap.parse_args()
    if args.ttft and args.shape == "gpt-oss":
        ap.error("--ttft times the recurrent-state snapshots: use --shape qwen3-next or qwen3.5")

    shape = SHAPES[args.shape]
    n_exp = args.experts or (8 if args.shape == "gpt-oss" else 32)
    cfg = parse_config(model_config(args.shape, args.layers, n_exp))
    dt = getattr(torch, args.dense_dtype)
    keep_f32 = ("gate.weight", "router.weight", "router.bias", "_bias", "sinks")
    dense = {k: v.to(torch.float32 if k.endswith(keep_f32) else dt) for k, v in dense_weights(cfg).items()}
    conv = SyntheticConversion(args.layers, n_exp, shape.hidden, shape.inter, method=shape.method, group=shape.group,
                               config=cfg, dense=dense)
    ex = Recording(conv)
    model = MoEModel(cfg, dense, ex, dtype=dt)
    if args.ttft:
        ttft_bench(model, args)
        return
    clock: dict[str, float] = {}
    timed_arch(model, clock)
    gen = torch.Generator().manual_seed(0)
    ctx = max(args.pp, args.tg + 1) + 1
    bench_tg(model, 2, ctx, gen)                                        # warm-up
    tg_rates, parts, ratios = [], [], []
    clock.clear()
    for _ in range(args.reps):
        ex.calls, ex.record = [], True
        wall, part = bench_tg(model, args.tg, ctx, gen)
        ex.record = False
        calls = ex.calls[args.layers:]                                   # drop the 1-token prefill's calls
        tg_rates.append(args.tg / wall)
        parts.append({**part, "wall_s": wall})
        ratios.append((wall / args.tg) / (replay_kernels(ex, calls, 3) / args.tg))
    steps = args.tg * args.reps + args.reps                              # the 1-token prefills are timed too
    kind_ms = {k: 1e3 * v / steps for k, v in clock.items()}
    b = decode_breakdown(parts, args.tg)
    kern_ms = b["step_ms"] / statistics.fmean(ratios)
    model.experts = NoExperts()
    dense_ms = min(bench_tg(model, args.tg, ctx, gen)[0] for _ in range(args.reps)) / args.tg * 1e3
    model.experts = ex
    pp_rates = [args.pp / bench_pp(model, args.pp, ctx, gen) for _ in range(args.reps)]

    bw = ex.moe.measure_read_bandwidth(reps=3)
    embed = get_family(cfg.model_type).names.embed
    dense_bytes = sum(t.numel() * t.element_size() for k, t in dense.items() if k != embed)
    expert_step_bytes = conv.nbytes / n_exp * cfg.top_k           # top-k experts of every layer, each token

    def ms(xs):
        return f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.2f}"

    kinds = {k: sum(t == k for t in cfg.layer_types) for k in dict.fromkeys(cfg.layer_types)}
    shared = " + gated shared expert" if shape.shared else " + biases, clamped SwiGLU"
    print(f"model: {args.shape}-shaped ({cfg.model_type}), {args.layers} layers "
          f"({', '.join(f'{n} {k}' for k, n in kinds.items())}) x {n_exp} experts (H {shape.hidden}, I {shape.inter}, "
          f"{shape.method} g{shape.group}, top-{cfg.top_k}){shared}; kernel backend {ex.moe.backend_detail}, "
          f"{ex.moe.n_threads} kernel threads, {torch.get_num_threads()} torch threads, dense {args.dense_dtype}; "
          f"expert bytes {conv.nbytes / 1e9:.2f} GB")
    print(f"tg{args.tg}_tokens_per_s: {ms(tg_rates)} tok/s")
    print(f"pp{args.pp}_tokens_per_s: {ms(pp_rates)} tok/s")
    print(f"tg_decode_step: {b['step_ms']:.2f} ms")
    print(f"tg_kernels_alone_same_experts: {kern_ms:.2f} ms")
    print(f"tg_step_over_kernels: {statistics.fmean(ratios):.3f} ratio")
    print(f"tg_dense_part_alone: {dense_ms:.2f} ms")
    print(f"tg_step_over_kernels_plus_dense: {b['step_ms'] / (kern_ms + dense_ms):.3f} ratio")
    print(f"tg_step_waiting_on_experts: {b['experts_wait_ms']:.2f} ms")
    print(f"tg_step_attention: {b['attention_ms']:.2f} ms")
    for kind, label in (("linear_attention", "gated_deltanet"), ("full_attention", "full_attention"),
                        ("sliding_attention", "sliding_window_attention")):
        if kind in kinds:
            print(f"tg_step_{label}_layers: {kind_ms.get(kind, 0.0):.2f} ms")
    print(f"tg_step_router_shared_expert: {b['router_shared_dense_mlp_ms']:.2f} ms")
    print(f"tg_step_head_norms_embedding: {b['head_norm_embed_ms']:.2f} ms")
    print(f"tg_step_loop_overhead: {b['loop_overhead_ms']:.2f} ms")
    print(f"tg_dense_bytes_per_step: {dense_bytes / 1e6:.1f} MB")
    print(f"tg_expert_bytes_per_step: {expert_step_bytes / 1e6:.1f} MB")
    print(f"read_bandwidth: {bw / 1e9:.1f} GB/s")
    print(f"tg_kernels_over_bandwidth_limit: {kern_ms / (expert_step_bytes / bw * 1e3):.2f} ratio")
    print(f"tg_dense_over_bandwidth_limit: {dense_ms / (dense_bytes / bw * 1e3):.2f} ratio")
    print(f"tg_step_over_bandwidth_limit: {b['step_ms'] / ((expert_step_bytes + dense_bytes) / bw * 1e3):.2f} ratio")


if __name__ == "__main__":
    main()
