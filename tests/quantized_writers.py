"""GPTQ, AWQ and FP8 (per channel / per tensor) checkpoints written from their published bit layouts, for the tests.

gptqmodel / auto-gptq / autoawq ship as source distributions that build CUDA extensions (none installs on this CPU
machine), so these writers follow the formats' documented layouts with plain loops over the bit positions, sharing
nothing with ktconvert's packers or readers. Each returns the values it stored (W = (q - z) * s per Linear), the
reference the readers are checked against. compressed-tensors fixtures come from the library itself
(ktconvert.testing.quantized).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from ktconvert.testing.files import write_shards

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]     # AutoAWQ GEMM: nibble i of a word holds output channel 8c + order[i]
ROUTER = re.compile(r".*\.(mlp|block_sparse_moe)\.gate\.weight$")


def read_checkpoint(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(src / shard)))
    return index, {n: tensors[n] for n in index["weight_map"]}


def quantized_linears(tensors: dict[str, torch.Tensor], skip=(r"lm_head\.weight$",)) -> list[str]:
    """The 2-D Linear weights a GPTQ/AWQ tool quantizes: all but embeddings, the router gates and `skip`."""
    return [n for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in n
            and not ROUTER.match(n) and not any(re.search(s, n) for s in skip)]


def _finish(src: Path, out: Path, written: dict, qc: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    write_shards(written, out, max_shard_bytes=512 * 1024)
    for p in src.iterdir():
        if p.is_file() and not p.name.startswith("model") and p.name != "config.json":
            shutil.copy(p, out / p.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def pack_along_rows(v: np.ndarray, bits: int) -> np.ndarray:
    """(R, C) unsigned -> (R*bits/32, C) int32: word [i, c] bits [bits*j, bits*(j+1)) = v[i*f + j, c]."""
    f = 32 // bits
    words = np.zeros((v.shape[0] // f, v.shape[1]), dtype=np.uint32)
    for j in range(f):
        words |= (v[j::f].astype(np.uint32) & ((1 << bits) - 1)) << np.uint32(bits * j)
    return words.view(np.int32)


def pack_along_cols(v: np.ndarray, bits: int, order=None) -> np.ndarray:
    """(R, C) unsigned -> (R, C*bits/32) int32; `order`: which column of each word's group nibble j holds."""
    f = 32 // bits
    order = list(range(f)) if order is None else order
    words = np.zeros((v.shape[0], v.shape[1] // f), dtype=np.uint32)
    for j in range(f):
        words |= (v[:, order[j]::f].astype(np.uint32) & ((1 << bits) - 1)) << np.uint32(bits * j)
    return words.view(np.int32)


def _minmax_quant(w: np.ndarray, bits: int, sym: bool):
    """GPTQ's / AWQ's round-to-nearest per group: w (N, L) -> q (N, L), zero (N,), scale (N,) float16."""
    maxq = (1 << bits) - 1
    lo, hi = np.minimum(w.min(1), 0), np.maximum(w.max(1), 0)
    if sym:
        hi = np.maximum(-lo, hi)
        lo = -hi
    scale = ((hi - lo) / maxq).astype(np.float16)
    scale[scale == 0] = 1
    s = scale.astype(np.float32)
    zero = np.full(w.shape[0], (maxq + 1) // 2) if sym else np.clip(np.round(-lo / s), 0, maxq)
    q = np.clip(np.round(w / s[:, None]) + zero[:, None], 0, maxq)
    return q.astype(np.int64), zero.astype(np.int64), scale


def gptq_checkpoint(src: Path, out: Path, bits=4, group_size=32, sym=True, desc_act=False, skip=(r"lm_head\.weight$",),
                    seed=0, drop_g_idx=False, dynamic=None, version="gptq") -> tuple[Path, dict[str, np.ndarray]]:
    """src quantized the GPTQ way (round to nearest per group; desc_act: input channels in a random order, so
    g_idx permutes the groups) in the GPTQ v1 layout (`version` gptq_v2: zeros stored as they are)."""
    _index, tensors = read_checkpoint(src)
    rng = np.random.default_rng(seed)
    written, values = {}, {}
    targets = set(quantized_linears(tensors, skip))
    for name, t in tensors.items():
        if name not in targets:
            written[name] = t
            continue
        w = t.float().numpy()                                     # (N, K)
        n, k = w.shape
        glen = k if group_size == -1 else group_size
        order = rng.permutation(k) if desc_act else np.arange(k)
        g_idx = np.empty(k, dtype=np.int32)
        g_idx[order] = np.arange(k) // glen                       # the i-th channel processed joins group i // G
        q = np.zeros((n, k), dtype=np.int64)
        zeros = np.zeros((k // glen, n), dtype=np.int64)
        scales = np.zeros((k // glen, n), dtype=np.float16)
        for g in range(k // glen):
            cols = np.flatnonzero(g_idx == g)
            qq, z, s = _minmax_quant(w[:, cols], bits, sym)
            q[:, cols], zeros[g], scales[g] = qq, z, s
        base = name.removesuffix(".weight")
        stored_zeros = zeros - 1 if version == "gptq" else zeros
        written[f"{base}.qweight"] = torch.from_numpy(pack_along_rows(q.T, bits))           # (K*b/32, N)
        written[f"{base}.qzeros"] = torch.from_numpy(pack_along_cols(stored_zeros, bits))   # (ng, N*b/32)
        written[f"{base}.scales"] = torch.from_numpy(scales)
        if not drop_g_idx:
            written[f"{base}.g_idx"] = torch.from_numpy(g_idx)
        values[name] = ((q - zeros[g_idx].T) * scales.astype(np.float32)[g_idx].T).astype(np.float32)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
          "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": version, "lm_head": False}
    if dynamic:
        qc["dynamic"] = dynamic
    return _finish(src, out, written, qc), values


def awq_checkpoint(src: Path, out: Path, group_size=32, skip=(r"lm_head\.weight$",)) -> tuple[Path, dict]:
    """src quantized the AutoAWQ way (asymmetric 4-bit per group) in the GEMM layout (AWQ's packing order)."""
    _index, tensors = read_checkpoint(src)
    written, values = {}, {}
    targets = set(quantized_linears(tensors, skip))
    for name, t in tensors.items():
        if name not in targets:
            written[name] = t
            continue
        w = t.float().numpy()
        n, k = w.shape
        q = np.zeros((n, k), dtype=np.int64)
        zeros = np.zeros((k // group_size, n), dtype=np.int64)
        scales = np.zeros((k // group_size, n), dtype=np.float16)
        for g in range(k // group_size):
            cols = slice(g * group_size, (g + 1) * group_size)
            q[:, cols], zeros[g], scales[g] = _minmax_quant(w[:, cols], 4, sym=False)
        base = name.removesuffix(".weight")
        written[f"{base}.qweight"] = torch.from_numpy(pack_along_cols(q.T, 4, AWQ_PACK_ORDER))    # (K, N/8)
        written[f"{base}.qzeros"] = torch.from_numpy(pack_along_cols(zeros, 4, AWQ_PACK_ORDER))   # (K/G, N/8)
        written[f"{base}.scales"] = torch.from_numpy(scales)                                       # (K/G, N)
        g = np.arange(k) // group_size
        values[name] = ((q - zeros[g].T) * scales.astype(np.float32)[g].T).astype(np.float32)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": None}
    return _finish(src, out, written, qc), values


def fp8_scaled_checkpoint(src: Path, out: Path, per_channel=True, quant_method="fbgemm_fp8", flat_scales=False
                          ) -> tuple[Path, dict]:
    """src as FP8 E4M3 weights with one float32 scale per output channel (N, 1) (flat_scales: (N,)) or per tensor
    (1,) (flat_scales: a 0-d scalar), cast by torch (its float8_e4m3fn rounding); values: the FP8 bits times the
    scale, in float32."""
    _index, tensors = read_checkpoint(src)
    written, values = {}, {}
    targets = {n for n in quantized_linears(tensors) if ".layers." in n}
    for name, t in tensors.items():
        if name not in targets:
            written[name] = t
            continue
        w = t.float()
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
        scale = (amax / 448.0).clamp(min=1e-12).float()
        bits = (w / (scale if per_channel else scale[0])).to(torch.float8_e4m3fn)
        base = name.removesuffix(".weight")
        written[name] = bits
        written[f"{base}.weight_scale"] = scale.reshape(-1)[0] if flat_scales and not per_channel else \
            scale.reshape(-1) if flat_scales else scale
        values[name] = (bits.float() * (scale if per_channel else scale[0])).numpy()
    qc = {"quant_method": quant_method, "activation_scheme": "dynamic"} if quant_method != "fbgemm_fp8" else \
        {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    return _finish(src, out, written, qc), values
