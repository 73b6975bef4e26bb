"""Fused routed experts (gpt-oss, Qwen3.5-MoE) as per-expert logical weights, decoded on read.

gpt-oss and Qwen3.5-MoE checkpoints store a MoE layer's experts as one tensor per projection
(ktlayouts.families.FusedExperts):
  gpt-oss      gate_up_proj (E, H, 2I), down_proj (E, I, H)                      x @ W, input dimension first
  gpt-oss      gate_up_proj_blocks (E, 2I, H/32, 16) U8 + gate_up_proj_scales (E, 2I, H/32) U8 E8M0,
  MXFP4        down_proj_blocks (E, H, I/32, 16) + down_proj_scales (E, H, I/32)   output dimension first
  Qwen3.5-MoE  gate_up_proj (E, 2I, H), down_proj (E, H, I)                      output dimension first
with gate and up interleaved along 2I (gpt-oss: gate = even, up = odd) or gate first (Qwen3.5: rows [0, I)). The
reader's table shows instead, per expert, the (N, K) Linear weights of the family's expert_name
(`<layer>mlp.experts.E.{gate,up,down}_proj.weight`), each
an ExpertSliceInfo over the bytes of its expert only (the fused tensor's expert e is one contiguous slab), so the
converter's roles, plan and exact paths see a per-expert checkpoint. MXFP4 weights decode to an exact integer grid
(2 x E2M1 is an integer; the E8M0 scale halved: ktconvert.sources.quantized.values), taken over by int8 layouts
unchanged; the biases (`*_bias`) stay as stored (role expert_bias).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from ktlayouts.families import FusedExperts, ModelConfig, get_family

from ktconvert.sources.quantized.grid import IntGrid, contiguous_g_idx
from ktconvert.sources.quantized.scheme import QuantScheme, QuantTensorInfo, WeightFormat
from ktconvert.sources.quantized.values import E8M0_NAN, e8m0_exponents, pow2, unpack_e2m1_times_two
from ktconvert.sources.roles import SourceError

MXFP4 = WeightFormat("gpt-oss", "mxfp4", 4, 32)
FLOAT_DTYPES = ("BF16", "F16", "F32")
ROWS = {"gate": 0, "up": 1, "down": None}     # gate/up: every other row of gate_up from this one; down: all rows


@dataclass(frozen=True)
class ExpertSliceInfo(QuantTensorInfo):
    """One expert's gate, up or down (N, K) out of a fused tensor: parts are the expert's slabs ("weight" for
    unquantized, "blocks" + "scales" for MXFP4), row0 the first of every other fused row (None: all rows)."""
    row0: int | None = None


def _slab(info, e: int, n_experts: int):
    """Expert e's slab of a fused (E, ...) tensor as a TensorInfo of its own (contiguous bytes)."""
    per = info.nbytes // n_experts
    return dataclasses.replace(info, shape=tuple(info.shape[1:]), offset=info.offset + e * per, nbytes=per)


class FusedExpertScheme(QuantScheme):
    """The logical table of a fused-expert checkpoint (unquantized or quantization_config quant_method "mxfp4");
    a family whose fused form is optional (Qwen3.5-MoE) passes per-expert checkpoints through unchanged."""

    family = "gpt-oss"

    def __init__(self, fused: FusedExperts, cfg: ModelConfig, qc: dict, where: str):
        super().__init__(qc or {}, where)
        method = (qc or {}).get("quant_method")
        if method not in (None, "mxfp4"):
            raise SourceError(f"{where}: unsupported quantization_config (quant_method={method!r}) for "
                              f"{cfg.model_type}: its checkpoints are unquantized or quant_method 'mxfp4'")
        self.fused, self.cfg = fused, cfg
        self.names = get_family(cfg.model_type).names     # the layer prefix and per-expert names of the family

    def logical_tensors(self, infos: dict, names: list[str], read) -> tuple[dict, list[str]]:
        c, f = self.cfg, self.fused
        stems = {}
        for layer in c.moe_layers:
            for key, stem in (("gate_up", f.gate_up), ("down", f.down)):
                stems[f"{self.names.layer(layer)}{stem}"] = (layer, key)
        if f.optional and not any(n.removesuffix("_blocks").removesuffix("_scales") in stems for n in names):
            return infos, names                             # a per-expert checkpoint: read as it is
        out_infos, out_names, done = {}, [], set()
        for name in names:
            base = name.removesuffix("_blocks").removesuffix("_scales")
            if base not in stems:
                out_infos[name] = infos[name]
                out_names.append(name)
                continue
            if base in done:
                continue
            done.add(base)
            layer, key = stems[base]
            for q in self._describe(base, layer, key, infos):
                out_infos[q.name] = q
                out_names.append(q.name)
        missing = [s for s in stems if s not in done]
        if missing:
            raise SourceError(f"{self.where}: tensor {missing[0]} (or its _blocks/_scales) is missing (config "
                              f"promises {c.num_experts} experts in layers {list(c.moe_layers)})")
        return out_infos, out_names

    def _describe(self, base: str, layer: int, key: str, infos: dict) -> list[ExpertSliceInfo]:
        c = self.cfg
        E, H, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
        n, k = (2 * inter, H) if key == "gate_up" else (H, inter)
        blocks, scales, plain = infos.get(base + "_blocks"), infos.get(base + "_scales"), infos.get(base)
        if plain is not None and (blocks is not None or scales is not None):
            raise SourceError(f"{plain.file}: tensor {base} is stored both unquantized and as MXFP4 _blocks/_scales")
        if plain is not None:
            want, dims = ((E, k, n), "(E, K, N)") if self.fused.input_first else ((E, n, k), "(E, N, K)")
            self.check(plain, FLOAT_DTYPES, want, f"fused {key} experts {dims} of hidden_size={H}, "
                                                  f"intermediate_size={inter}")
            parts_of = lambda e: {"weight": _slab(plain, e, E)}
            fmt, first = None, plain
        else:
            if blocks is None or scales is None:
                have = blocks or scales
                raise SourceError(f"{have.file}: tensor {have.name}: MXFP4 needs both {base}_blocks and "
                                  f"{base}_scales")
            if k % 32:
                raise SourceError(f"{blocks.file}: tensor {blocks.name}: MXFP4 rows of K={k} are not whole "
                                  f"blocks of 32")
            self.check(blocks, ("U8",), (E, n, k // 32, 16), "MXFP4 E2M1 pairs, 32 values per block")
            self.check(scales, ("U8",), (E, n, k // 32), "MXFP4: one E8M0 scale per 32 input channels")
            parts_of = lambda e: {"blocks": _slab(blocks, e, E), "scales": _slab(scales, e, E)}
            fmt, first = MXFP4, blocks
        projs = ("gate", "up") if key == "gate_up" else ("down",)
        out = []
        for e in range(E):
            parts = parts_of(e)
            for proj in projs:
                name = self.names.expert_tensor_name(layer, e, proj)
                shape = (inter, H) if proj != "down" else (H, inter)
                row0 = ROWS[proj] if self.fused.interleaved else (None if proj == "down" else ROWS[proj] * inter)
                share = len(projs)
                p0 = parts[next(iter(parts))]
                out.append(ExpertSliceInfo(name, fmt.label if fmt else first.dtype, shape, p0.file, p0.offset,
                                           sum(p.nbytes for p in parts.values()) // share, parts, fmt, row0))
        return out

    def _rows(self, a: np.ndarray, info: ExpertSliceInfo, n_rows: int) -> np.ndarray:
        if info.row0 is None:
            return a
        if self.fused.interleaved:
            return a[info.row0::2]
        return a[info.row0:info.row0 + n_rows]

    def decode(self, info: ExpertSliceInfo, read):
        n, k = info.shape
        if info.fmt is None:          # gpt-oss: (K, 2I) or (I, H), input dimension first; Qwen3.5: (2I, K), (H, I)
            w = np.asarray(read(info.parts["weight"]), dtype=np.float32)
            return np.ascontiguousarray(self._rows(w.T if self.fused.input_first else w, info, n))
        bi, si = info.parts["blocks"], info.parts["scales"]
        e = self._rows(read(si), info, n)                 # (N, K/32) biased exponents
        if (e == E8M0_NAN).any():
            r, g = (int(x) for x in np.argwhere(e == E8M0_NAN)[0])
            raise SourceError(f"{si.file}: tensor {si.name}: E8M0 NaN scale (255) at row {r}, block {g} of "
                              f"{info.name}")
        packed = self._rows(read(bi), info, n).reshape(n, k // 2)
        q = unpack_e2m1_times_two(packed, k)              # (N, K) int16 = 2 x E2M1
        return IntGrid(q, pow2(e8m0_exponents(e) - 1), contiguous_g_idx(k, 32), info.fmt.label)
