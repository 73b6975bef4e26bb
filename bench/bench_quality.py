"""Quantization quality of the embedded default model: held-out perplexity and mean KL(BF16 || quantized) for routed
experts in int8/int4 (groups 32/64/128 and per-row, the CPU tile formats) and GPU layers in rtn-int4/gptq-int4,
as one table; plus expert-use statistics (share of routed tokens taken by the top 10% of experts, per MoE layer).

Independent path: the shipped BF16 model in transformers (float32 compute); quantized variants replace weights by
their quantize-dequantize round trip through the on-disk reference code: experts via
`ktlayouts.cpu_expert.pack_expert_matrix` / `unpack_expert_matrix`; GPU layers (attention, dense MLP, shared expert)
via `ktconvert.gpu.rtn.quantize_rtn` / `ktconvert.gpu.gptq.gptq_quantize`, zero-padded to the Marlin geometry like the
converter. Activations stay float (the CPU kernels' int8 activation quantization is not modelled here). GPTQ Hessians
come from the BF16 model on training-split text (one pass, not layer-sequential).

    .venv/bin/python bench/bench_quality.py                     # ~8k held-out tokens, 1 thread
    .venv/bin/python bench/bench_quality.py --tokens 4096 --threads 2
    .venv/bin/python bench/bench_quality.py --no-runtime          # only the round-trip rows

The same table also has rows through the real product (bench/quality_runtime.py): the default model converted by
`ktconvert` and scored by `ktrun` (CPU kernels when available: int8 activations too).
"""
from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

import numpy as np
import torch
from ktlayouts.cpu_expert import MatrixGeometry, pack_expert_matrix, unpack_expert_matrix
from ktlayouts.marlin import marlin_padded_shape

import ktconvert
from ktconvert.default_model import data
from ktconvert.gpu.gptq import GptqConfig, HessianAccumulator, gptq_quantize
from ktconvert.gpu.rtn import quantize_rtn

MODEL_DIR = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"
SEQ_LEN = 256
GPU_GROUP = 128
GPU_TARGETS = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "shared_experts.gate_proj",
               "shared_experts.up_proj", "shared_experts.down_proj")


def token_windows(tok, texts: list[str], n_tokens: int) -> torch.Tensor:
    """BOS text EOS documents as one stream, cut into consecutive (n, SEQ_LEN+1) windows."""
    ids = []
    for t in texts:
        ids += [data.BOS_ID] + tok.encode(t, add_special_tokens=False).ids + [data.EOS_ID]
    n = min((len(ids) - 1) // SEQ_LEN, n_tokens // SEQ_LEN)
    return torch.tensor([ids[i * SEQ_LEN: i * SEQ_LEN + SEQ_LEN + 1] for i in range(n)])


def expert_round_trip(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """(N, K) weight -> packed CPU tiles -> dequantized (N, K), exactly as the converter and kernels store it."""
    geom = MatrixGeometry(w.shape[0], w.shape[1], bits, group)
    qweight, scales = pack_expert_matrix(w.numpy().astype(np.float32), geom)
    return torch.from_numpy(unpack_expert_matrix(qweight, scales, geom).copy())


@torch.no_grad()
def quantize_experts(model, bits: int, group: int) -> None:
    inter = model.config.moe_intermediate_size
    for layer in model.model.layers[model.config.first_k_dense_replace:]:
        ex = layer.mlp.experts
        for e in range(ex.gate_up_proj.shape[0]):
            ex.gate_up_proj[e, :inter] = expert_round_trip(ex.gate_up_proj[e, :inter], bits, group)
            ex.gate_up_proj[e, inter:] = expert_round_trip(ex.gate_up_proj[e, inter:], bits, group)
            ex.down_proj[e] = expert_round_trip(ex.down_proj[e], bits, group)


def gpu_linears(model) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(GPU_TARGETS)}


@torch.no_grad()
def collect_hessians(model, calib: torch.Tensor) -> dict[str, torch.Tensor]:
    acc, hooks = {}, []
    for name, lin in gpu_linears(model).items():
        acc[name] = HessianAccumulator(lin.in_features)
        hooks.append(lin.register_forward_hook(lambda m, inp, out, a=acc[name]: a.add(inp[0])))
    for i in range(0, len(calib), 4):
        model(input_ids=calib[i:i + 4])
    for h in hooks:
        h.remove()
    return {n: a.h for n, a in acc.items()}


@torch.no_grad()
def quantize_gpu_layers(model, algo: str, hessians: dict | None) -> None:
    for name, lin in gpu_linears(model).items():
        n, k = lin.weight.shape
        n_pad, k_pad = marlin_padded_shape(n, k, GPU_GROUP)
        w = torch.nn.functional.pad(lin.weight.float(), (0, k_pad - k, 0, n_pad - n))
        if algo == "rtn":
            q = quantize_rtn(w, 4, GPU_GROUP)
        else:
            h = torch.zeros(k_pad, k_pad)
            h[:k, :k] = hessians[name]
            q, _ = gptq_quantize(w, h, GptqConfig(bits=4, group_size=GPU_GROUP), name=name)
        lin.weight.copy_(q.dequantize()[:n, :k])


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, ref_logp: list | None, batch: int = 4):
    """-> (perplexity, mean KL(ref || model) in nats/token, list of log-prob batches)."""
    nll, kl, count, logps = 0.0, 0.0, 0, []
    for j, i in enumerate(range(0, len(windows), batch)):
        x = windows[i:i + batch]
        logp = torch.log_softmax(model(input_ids=x[:, :-1]).logits.float(), dim=-1)
        nll -= float(logp.gather(-1, x[:, 1:, None]).sum())
        count += x[:, 1:].numel()
        if ref_logp is None:
            logps.append(logp)
        else:
            kl += float((ref_logp[j].exp() * (ref_logp[j] - logp)).sum())
    return math.exp(nll / count), kl / count, logps


def count_routes(c: torch.Tensor):
    def hook(module, inputs, outputs) -> None:  # must return None: a returned value replaces the router output
        c.add_(torch.bincount(outputs[2].flatten(), minlength=len(c)).float())
    return hook


@torch.no_grad()
def expert_use(model, windows: torch.Tensor) -> list[tuple[int, float, float]]:
    """Per MoE layer: (layer, share of routed tokens taken by the top 10% of experts, max/mean load)."""
    counts, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            counts[i] = torch.zeros(model.config.n_routed_experts)
            hooks.append(layer.mlp.gate.register_forward_hook(count_routes(counts[i])))
    for i in range(0, len(windows), 4):
        model(input_ids=windows[i:i + 4, :-1])
    for h in hooks:
        h.remove()
    top = max(1, math.ceil(0.1 * model.config.n_routed_experts))
    return [(i, float(c.sort(descending=True).values[:top].sum() / c.sum()), float(c.max() / c.mean()))
            for i, c in counts.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--tokens", type=int, default=8192, help="held-out tokens scored")
    ap.add_argument("--calib-tokens", type=int, default=4096, help="training-split tokens for GPTQ Hessians")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-runtime", action="store_true", help="skip the ktconvert + ktrun rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer
    from transformers import DeepseekV3ForCausalLM

    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    stdlib = data.default_stdlib_dir()
    train_files, heldout_files = data.split_files(stdlib)
    windows = token_windows(tok, [p.read_text(encoding="utf-8") for p in heldout_files], args.tokens)
    calib = token_windows(tok, [p.read_text(encoding="utf-8") for p in train_files[::8]], args.calib_tokens)[:, :-1]
    print(f"# held-out: {windows[:, 1:].numel()} tokens from {len(heldout_files)} files of {stdlib}; "
          f"GPTQ calibration: {calib.numel()} training-split tokens")

    base = DeepseekV3ForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    t0 = time.time()
    ref_ppl, _, ref_logp = evaluate(base, windows, None)
    hessians = collect_hessians(base, calib)
    rows = [("bf16", "bf16", ref_ppl, 0.0, "reference")]
    configs = [(f"int{b}-g{g}" if g > 0 else f"int{b}-per-row", "bf16", b, g, None)
               for b in (8, 4) for g in (32, 64, 128, -1)]
    configs += [("bf16", "rtn-int4-g128", None, None, "rtn"), ("bf16", "gptq-int4-g128", None, None, "gptq"),
                ("int4-g128", "gptq-int4-g128", 4, 128, "gptq"), ("int4-per-row", "gptq-int4-g128", 4, -1, "gptq")]
    for experts, gpu, bits, group, algo in configs:
        m = copy.deepcopy(base)
        if bits:
            quantize_experts(m, bits, group)
        if algo:
            quantize_gpu_layers(m, algo, hessians)
        ppl, kl, _ = evaluate(m, windows, ref_logp)
        rows.append((experts, gpu, ppl, kl, "round trip"))
        del m
    if not args.no_runtime:
        from quality_runtime import runtime_rows

        rows += [(e, g, p, k, f"ktrun {b}") for e, g, p, k, b in runtime_rows(args.model, windows, ref_logp, 4)]

    print("\n| routed experts | GPU layers | path | held-out ppl | ppl / bf16 | mean KL vs bf16 (nats/token) |")
    print("|---|---|---|---:|---:|---:|")
    for experts, gpu, ppl, kl, path in rows:
        print(f"| {experts} | {gpu} | {path} | {ppl:.3f} | {ppl / ref_ppl:.4f} | {kl:.5f} |")
    print("# path: 'round trip' = transformers with weights quantized-dequantized through ktlayouts / ktconvert.gpu.rtn|gptq "
          "(float activations); 'ktrun X' = converted by ktconvert, run by ktrun with expert backend X")
    for experts, gpu, ppl, kl, path in rows:
        key = f"experts_{experts}.gpu_{gpu}" + (".ktrun" if path.startswith("ktrun") else "")
        print(f"quality.{key}.ppl: {ppl:.3f} ppl")
        print(f"quality.{key}.ppl_ratio_vs_bf16: {ppl / ref_ppl:.4f} x")
        if path != "reference":
            print(f"quality.{key}.mean_kl: {kl:.5f} nats/token")
    n_experts = base.config.n_routed_experts
    top = max(1, math.ceil(0.1 * n_experts))
    print(f"# expert use over the held-out tokens: top10pct_share = share of routed (token, expert) slots taken by the "
          f"{top} most used of {n_experts} experts (uniform: {top / n_experts:.3f})")
    for layer, share, imbalance in expert_use(base, windows):
        print(f"experts.layer{layer}.top10pct_share: {share:.3f} fraction")
        print(f"experts.layer{layer}.max_over_mean_load: {imbalance:.2f} x")
    print(f"bench.quality.seconds: {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
