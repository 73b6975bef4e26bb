"""ktrun decode (tg) and prompt processing (pp) on a DeepSeek-V3-shaped synthetic model, against the kernels alone.

The model: full-width routed experts (hidden 7168, intermediate 2048, int4-amx group 128, top-8), one full-width
shared expert, MLA attention with V3's ranks (q_lora 1536, kv_lora 512, rope 64, nope 128, v 128) but only
--heads heads, --layers MoE layers, --experts experts per layer, a 4096-token vocabulary — sized to fit this
machine. Weights are random (packed codes and scales written straight into the int4 layout).

Peer measured in the same run: the kernels alone (ktrun.ops.moe.MoEKernels.forward) replaying exactly the expert calls
(same layers, activations, routed ids and weights) of the timed decode steps. step/kernel = decode step time over
kernel time for the same experts; everything above 1 is attention, shared expert, router, head and Python. Also the
machine's read bandwidth (kernel measurement) as the limit for the expert bytes a decode step streams, and the step
against max(kernels alone, dense part alone): what a perfect overlap of the two would take (the heterogeneous loop's
target on a GPU, where the dense part runs beside the CPU experts). And the cost of speculative decoding's verify
forward on this model: one decode forward with 1 + k rows against 1 row after the same prompt (--verify-rows k).

    .venv/bin/python bench/bench_decode.py [--layers 2] [--experts 16] [--heads 16] [--tg 16] [--pp 64] [--reps 3]
    .venv/bin/python bench/bench_decode.py --device cuda --dense-format triton-int4   # GPU layers as a conversion has
                                                    # them: int4 g128 on ktrun's Triton kernel (bench/device_check.sh)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # torch's idle OpenMP threads must not spin on the kernels' CPUs

import torch
from bench_speculative import verify_cost  # bench/ sits on sys.path as the script's folder
from ktlayouts.families import parse_config
from ktrun.cli.cmd_bench import bench_pp, bench_tg, decode_breakdown
from ktrun.experts.kernel import KernelExperts
from ktrun.models.model import MoEModel
from ktrun.ops.triton_linear import TritonLinear, pack_rows_torch
from synthetic_experts import SyntheticConversion

H, I, TOP_K, VOCAB = 7168, 2048, 8, 4096


def v3_config(layers: int, experts: int, heads: int) -> dict:
    return {"model_type": "deepseek_v3", "vocab_size": VOCAB, "hidden_size": H, "intermediate_size": 18432,
            "moe_intermediate_size": I, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "n_shared_experts": 1, "n_routed_experts": experts,
            "num_experts_per_tok": TOP_K, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
            "v_head_dim": 128, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 4096,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, "rope_theta": 10000}


def dense_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    nh, dn, dr, dv, R, Q = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, 512, 1536
    w = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g), "model.norm.weight": torch.ones(H),
         "lm_head.weight": rnd(VOCAB, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
                  p + "self_attn.q_a_proj.weight": rnd(Q, H), p + "self_attn.q_a_layernorm.weight": torch.ones(Q),
                  p + "self_attn.q_b_proj.weight": rnd(nh * (dn + dr), Q),
                  p + "self_attn.kv_a_proj_with_mqa.weight": rnd(R + dr, H),
                  p + "self_attn.kv_a_layernorm.weight": torch.ones(R),
                  p + "self_attn.kv_b_proj.weight": rnd(nh * (dn + dv), R), p + "self_attn.o_proj.weight": rnd(H, nh * dv),
                  p + "mlp.gate.weight": rnd(cfg.num_experts, H),
                  p + "mlp.gate.e_score_correction_bias": torch.zeros(cfg.num_experts),
                  p + "mlp.shared_experts.gate_proj.weight": rnd(I, H), p + "mlp.shared_experts.up_proj.weight": rnd(I, H),
                  p + "mlp.shared_experts.down_proj.weight": rnd(H, I)})
    return w


def triton_int4(name: str, w: torch.Tensor, dtype: torch.dtype, group: int = 128) -> TritonLinear:
    """W (N, K) -> an int4 TritonLinear (round to nearest, symmetric, per group of K): the GPU layers' bytes as a
    converted model holds them, computed by ktrun's Triton kernel."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    scales = (g.abs().amax(-1) / 7).clamp_min(1e-8).to(torch.float16)                     # (N, K/G)
    codes = (g / scales.float()[..., None]).round().clamp(-8, 7).add(8).to(torch.uint8)    # (N, K/G, G)
    return TritonLinear(name, pack_rows_torch(codes.reshape(n, k).t().contiguous(), 4), scales.t().contiguous(),
                        None, 4, group, n, k, dtype)


QUANTIZED = ("_proj.weight",)       # the dense Linears a conversion quantizes (not embeddings, router, norms, head)


class Recording(KernelExperts):
    """KernelExperts that keeps copies of every call's inputs, to replay them on the kernels alone."""
    record = False

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def submit(self, layer, x, ids, weights, out):
        if self.record:
            self.calls.append((layer, x.float().cpu().contiguous().clone(), ids.cpu().clone(),
                               weights.float().cpu().clone()))
        super().submit(layer, x, ids, weights, out)


class NoExperts:
    """Routed experts cost nothing (output zero): times the dense part of a decode step alone."""
    def __init__(self):
        self.stats = {}

    def submit(self, layer, x, ids, weights, out):
        out.zero_()

    def sync(self):
        pass


def replay_kernels(ex: Recording, calls, reps: int) -> float:
    """Best-of-reps seconds for the kernels alone to run `calls`."""
    best = float("inf")
    outs = [torch.empty(x.shape, dtype=torch.float32) for _, x, _, _ in calls]
    for _ in range(reps):
        t0 = time.perf_counter()
        for (layer, x, ids, w), o in zip(calls, outs):
            ex.moe.forward(layer, x, ids, w, o)
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tg", type=int, default=16)
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--dense-dtype", choices=("float32", "bfloat16"), default=None,
                    help="dtype of the dense (GPU-layer) part (default: float32 on the CPU, bfloat16 on CUDA)")
    ap.add_argument("--device", default="cpu", help="where the dense part runs (cpu, cuda)")
    ap.add_argument("--verify-rows", type=int, default=4, help="draft tokens k of the verify-cost measurement (0: skip)")
    ap.add_argument("--dense-format", choices=("dense", "triton-int4"), default="dense",
                    help="dense: the Linears as float tensors; triton-int4: int4 g128 on ktrun's Triton kernel (CUDA, "
                         "or the CPU with TRITON_INTERPRET=1)")
    args = ap.parse_args()
    device = torch.device(args.device)
    args.dense_dtype = args.dense_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    cfg = parse_config(v3_config(args.layers, args.experts, args.heads))
    conv = SyntheticConversion(args.layers, args.experts, H, I)
    ex = Recording(conv)
    dt = getattr(torch, args.dense_dtype)
    dense = {k: v.to(device=device, dtype=torch.float32 if k.endswith(("gate.weight", "e_score_correction_bias"))
                     else dt) for k, v in dense_weights(cfg).items()}
    if args.dense_format == "triton-int4":
        dense = {k: triton_int4(k, v, dt) if k.endswith(QUANTIZED) else v for k, v in dense.items()}
    model = MoEModel(cfg, dense, ex, device=device, dtype=dt)
    gen = torch.Generator().manual_seed(0)
    ctx = max(args.pp, args.tg + 1) + 1
    bench_tg(model, 2, ctx, gen)                                        # warm-up
    tg_rates, parts, ratios = [], [], []
    for _ in range(args.reps):
        ex.calls, ex.record = [], True
        wall, part = bench_tg(model, args.tg, ctx, gen)
        ex.record = False
        calls = ex.calls[args.layers:]                                   # drop the 1-token prefill's calls
        kern = replay_kernels(ex, calls, 3)
        tg_rates.append(args.tg / wall)
        parts.append({**part, "wall_s": wall})
        ratios.append((wall / args.tg) / (kern / args.tg))
    b = decode_breakdown(parts, args.tg)
    kern_ms = b["step_ms"] / statistics.fmean(ratios)
    model.experts = NoExperts()
    dense_ms = min(bench_tg(model, args.tg, ctx, gen)[0] for _ in range(args.reps)) / args.tg * 1e3
    model.experts = ex
    verify = None
    if args.verify_rows:
        ids = torch.randint(0, VOCAB, (args.pp,), generator=gen).tolist()
        verify = verify_cost(model, ids, args.verify_rows, max(3, args.reps))
    pp_rates, pp_ratios = [], []
    for _ in range(args.reps):
        ex.calls, ex.record = [], True
        t = bench_pp(model, args.pp, ctx, gen)
        ex.record = False
        pp_rates.append(args.pp / t)
        pp_ratios.append(t / replay_kernels(ex, ex.calls, 1))
    bw = ex.moe.measure_read_bandwidth(reps=3)
    step_bytes = statistics.fmean(len(torch.unique(c[2])) for c in calls) * args.layers * conv.nbytes / (
        args.layers * args.experts)                                      # distinct experts streamed per step

    def ms(xs):
        return f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.2f}"

    print(f"model: deepseek_v3-shaped, {args.layers} MoE layers x {args.experts} experts (H {H}, I {I}, int4 g128, "
          f"top-{TOP_K}), {args.heads} MLA heads, shared expert; kernel backend {ex.moe.backend_detail}, "
          f"{ex.moe.n_threads} kernel threads, {torch.get_num_threads()} torch threads, dense {args.dense_dtype} "
          f"{args.dense_format} on {device.type}; expert bytes {conv.nbytes / 1e9:.2f} GB")
    print(f"tg{args.tg}_tokens_per_s: {ms(tg_rates)} tok/s")
    print(f"tg_decode_step: {b['step_ms']:.2f} ms")
    print(f"tg_kernels_alone_same_experts: {kern_ms:.2f} ms")
    print(f"tg_step_over_kernels: {statistics.fmean(ratios):.3f} ratio")
    print(f"tg_outside_kernels: {b['step_ms'] - kern_ms:.2f} ms")
    print(f"tg_dense_part_alone: {dense_ms:.2f} ms")
    print(f"tg_step_minus_kernels_minus_dense: {b['step_ms'] - kern_ms - dense_ms:.2f} ms")
    print(f"tg_step_over_kernels_plus_dense: {b['step_ms'] / (kern_ms + dense_ms):.3f} ratio")
    print(f"tg_step_over_max_kernels_dense: {b['step_ms'] / max(kern_ms, dense_ms):.3f} ratio")
    print(f"tg_step_waiting_on_experts: {b['experts_wait_ms']:.2f} ms")
    print(f"tg_step_attention: {b['attention_ms']:.2f} ms")
    print(f"tg_step_router_shared_expert: {b['router_shared_dense_mlp_ms']:.2f} ms")
    print(f"tg_step_head_norms_embedding: {b['head_norm_embed_ms']:.2f} ms")
    print(f"tg_step_loop_overhead: {b['loop_overhead_ms']:.2f} ms")
    print(f"tg_expert_bytes_per_step: {step_bytes / 1e6:.1f} MB")
    print(f"read_bandwidth: {bw / 1e9:.1f} GB/s")
    print(f"tg_kernels_bandwidth_limit: {(step_bytes / bw) * 1e3:.2f} ms")
    print(f"tg_kernels_over_bandwidth_limit: {kern_ms / ((step_bytes / bw) * 1e3):.2f} ratio")
    if verify is not None:
        one, many = verify
        print(f"tg_verify_forward_1_row: {one:.2f} ms")
        print(f"tg_verify_forward_{1 + args.verify_rows}_rows: {many:.2f} ms")
        print(f"tg_verify_cost_ratio: {many / one:.3f} x")
    print(f"pp{args.pp}_tokens_per_s: {ms(pp_rates)} tok/s")
    print(f"pp_prefill_over_kernels: {statistics.fmean(pp_ratios):.3f} ratio")
    ex.close()


if __name__ == "__main__":
    main()
