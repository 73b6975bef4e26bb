"""Cases for ktrun's Triton W4A16 / W8A16 kernel (ktrun.ops.triton_linear), run on CPU tensors under Triton's
interpreter. Triton reads TRITON_INTERPRET when it is imported, so tests/test_triton_linear.py runs this file as a
subprocess with TRITON_INTERPRET=1 KTRUN_TRITON=on and checks the JSON lines it prints (one per case).

    TRITON_INTERPRET=1 KTRUN_TRITON=on python tests/triton_interpret_cases.py kernels
    TRITON_INTERPRET=1 KTRUN_TRITON=on python tests/triton_interpret_cases.py engine CONVERTED_DIR [...]
    TRITON_INTERPRET=1 KTRUN_TRITON=on python tests/triton_interpret_cases.py hot CONVERTED_DIR [...]

kernels: every golden layer (tests/golden, vLLM's packers: GPTQ and Marlin bytes), act-order groups and padded
shapes in every registered GPU format, M = 1 / 7 / 33 rows, bf16 / fp16 / fp32 inputs, split-K forced and chosen.
Each reference is computed here in float64 from the codes and scales: (code - 2^(bits-1)) * scale of the code's group.
engine: logits of a conversion with --gpu-weights packed (Triton) against dequant (float32 and bf16).
hot: hot experts held as gptq slots run by the kernel, against the torch reference experts.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import torch
from golden_data import GOLDEN, linear_entries
from ktlayouts.gptq import GptqGeometry
from ktlayouts.gpu_formats import format_families, gpu_format_for
from ktrun.dense_placement import _triton
from ktrun.ops.packed_linear import MarlinLinear
from ktrun.ops.triton_linear import TritonLinear, interpreting, wna16_matmul

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROWS = ((1, "bf16", None), (1, "fp16", 3), (7, "fp16", None), (33, "bf16", None), (33, "fp32", 2))


def reference(codes_kn: np.ndarray, scales_gn: np.ndarray, g_idx: np.ndarray, bits: int) -> torch.Tensor:
    """W^T (K, N) in float64: W[n, k] = (codes[k, n] - 2^(bits-1)) * scales[g_idx[k], n]."""
    return torch.from_numpy((codes_kn.astype(np.float64) - (1 << (bits - 1))) * scales_gn.astype(np.float64)[g_idx])


def emit(case: str, got: torch.Tensor, want: torch.Tensor, **extra) -> None:
    err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    print(json.dumps({"case": case, "rel_err": err, "finite": bool(torch.isfinite(got).all()), **extra}), flush=True)


def run_rows(tag: str, call, w_kn: torch.Tensor, k: int, n: int, seed: int = 0) -> None:
    """call(x (M, k), split) -> (M, n), against x W^T with W^T = w_kn (K_s, N_s) >= (k, n) (padding ignored)."""
    g = torch.Generator().manual_seed(seed)
    for m, dt, split in ROWS:
        x = torch.randn(m, k, generator=g).to(DTYPES[dt])
        emit(f"{tag}-m{m}-{dt}-split{split or 'auto'}", call(x, split).float(), x.double() @ w_kn[:k, :n])


def layer_call(layer: TritonLinear):
    """(x, split) -> the kernel on the layer's packed tensors, float32, padded input, cropped output."""
    def call(x, split):
        y = wna16_matmul(F_pad(x, layer.k_pad), layer.qweight, layer.scales, layer.g_idx, layer.bits, layer.group,
                         split_k=split)
        if split is None:      # the layer's own call: the same launch, cast to x's dtype
            assert torch.equal(layer(x), y[:, : layer.n].to(x.dtype)), f"{layer.name}: layer(x) != kernel, cast"
        return y[:, : layer.n]
    return call


def golden_cases() -> None:
    for e in linear_entries():
        d = dict(np.load(GOLDEN / e["file"]))
        bits, k, n, gs = e["bits"], e["K"], e["N"], e["group_size"]
        group = k if gs == -1 else gs
        g_idx = np.arange(k) // group
        qw, sc = torch.from_numpy(d["gptq_qweight"]), torch.from_numpy(d["scales_fp16"])

        def call(x, split, qw=qw, sc=sc, bits=bits, group=group):
            return wna16_matmul(x, qw, sc, None, bits, group, split_k=split)
        w = reference(d["codes_kn"], d["scales_fp16"], g_idx, bits)
        run_rows(f"golden-gptq-{e['file']}", call, w, k, n)
        marlin = MarlinLinear("golden", torch.from_numpy(d["marlin_qweight"]), torch.from_numpy(d["marlin_scales"]),
                              bits, n, k, torch.float32)
        layer = TritonLinear.from_marlin(marlin)
        run_rows(f"golden-marlin-{e['file']}", layer_call(layer), w, k, n)


def act_order_cases() -> None:
    rng = np.random.default_rng(7)
    for bits in (4, 8):
        for gs in (32, 64, 128):
            k, n = 256, 96
            geom = GptqGeometry(n, k, bits, gs)
            codes = rng.integers(0, 1 << bits, (k, n), dtype=np.uint8)
            scales = (rng.random(geom.scales_shape) * 0.02 + 1e-3).astype(np.float16)
            g_idx = rng.permutation(geom.default_g_idx()).astype(np.int32)
            fmt = gpu_format_for("gptq", bits)
            layer = _triton("act.weight", fmt, fmt.pack(codes, scales, geom, g_idx), "cpu", torch.float32, "case")
            assert layer.g_idx is not None
            run_rows(f"act-order-w{bits}-g{gs}", layer_call(layer), reference(codes, scales, g_idx, bits), k, n,
                     seed=bits * gs)


def padded_cases() -> None:
    """Logical shapes the formats pad (Marlin: N to 64, K to 128) or store as they are, in every format."""
    rng = np.random.default_rng(3)
    for family in format_families():
        for bits in (4, 8):
            for n, k, gs in ((200, 136, -1), (40, 192, 64), (24, 96, 32)):
                fmt = gpu_format_for(family, bits)
                geom = fmt.storage_geometry(n, k, gs)
                codes = np.zeros((geom.k, geom.n), np.uint8) + (1 << (bits - 1))
                codes[:k, :n] = rng.integers(0, 1 << bits, (k, n), dtype=np.uint8)
                scales = (rng.random(geom.scales_shape) * 0.02 + 1e-3).astype(np.float16)
                parts = fmt.pack(codes, scales, geom, shape=(n, k))
                layer = _triton("pad.weight", fmt, parts, "cpu", torch.float32, "case")
                w = reference(codes, scales, np.arange(geom.k) // geom.group, bits)
                run_rows(f"padded-{family}-w{bits}-n{n}-k{k}-g{gs}", layer_call(layer), w, k, n, seed=n + k)


def F_pad(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, k - x.shape[1]))


def engine_cases(dirs: list[str]) -> None:
    from ktrun.engine import Engine
    from ktrun.models.kv_cache import Batch
    from runtime_helpers import PROMPT
    for d in dirs:
        for dt in (torch.float32, torch.bfloat16):
            logits, how = {}, {}
            for mode in ("dequant", "packed"):
                eng = Engine(d, ctx=256, device="cpu", use_kernels=False, gpu_weights=mode, dtype=dt)
                ids = eng.tokenizer.encode(PROMPT)
                out = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], eng.model.device),
                                        all_logits=True)
                logits[mode], how[mode] = out.float(), eng.converted.gpu_weights
                eng.close()
            lp = torch.log_softmax(logits["dequant"], -1)
            kl = (lp.exp() * (lp - torch.log_softmax(logits["packed"], -1))).sum(-1).max().item()
            print(json.dumps({"case": f"engine-{d}-{dt}", "how": how["packed"], "kl_max": kl,
                              "max_abs": (logits["packed"] - logits["dequant"]).abs().max().item(),
                              "same_argmax": bool(torch.equal(logits["packed"].argmax(-1),
                                                              logits["dequant"].argmax(-1)))}), flush=True)


def hot_cases(dirs: list[str]) -> None:
    """Hot experts held as gptq (TritonLinear slots filled in place) against the torch reference experts: the same
    codes and scales on both sides, so the logits agree up to float summation order."""
    from ktrun.experts.placement import Budget, HotExpertOptions
    from ktrun.loaded_model import load_model
    from ktrun.models.kv_cache import Batch
    from runtime_helpers import PROMPT

    def forced(lm):
        ids = lm.tokenizer.encode(PROMPT * 3)
        return lm.model.forward(Batch.build([(lm.model.new_cache(len(ids) + 1), ids)], lm.model.device),
                                all_logits=True).float()
    for d in dirs:
        with load_model(d, device="cpu", use_kernels=False) as lm:
            exact = forced(lm)
        for fmt in ("gptq", "auto"):
            opts = HotExpertOptions(budget=Budget(per_layer=4), strategy="uniform", gpu_format=fmt)
            with load_model(d, device="cpu", use_kernels=False, hot_experts=opts) as lm:
                store = lm.model.experts.store
                got = forced(lm)
                print(json.dumps({"case": f"hot-{fmt}-{d}", "format": store.format,
                                  "slots": sum(len(v) for v in store.slots.values()),
                                  "triton_slots": all(isinstance(lin, TritonLinear)
                                                      for slots in store.slots.values() for s in slots for lin in s),
                                  "hit_ratio": lm.model.experts.stats["gpu_hit_ratio"],
                                  "max_abs": (got - exact).abs().max().item()}), flush=True)


def main() -> None:
    if not interpreting():
        sys.exit("run with TRITON_INTERPRET=1 in the environment (Triton reads it when imported)")
    what = sys.argv[1]
    if what == "kernels":
        golden_cases()
        act_order_cases()
        padded_cases()
    elif what == "engine":
        engine_cases(sys.argv[2:])
    elif what == "hot":
        hot_cases(sys.argv[2:])
    else:
        sys.exit(f"unknown case group {what!r}: kernels, engine or hot")


if __name__ == "__main__":
    main()
