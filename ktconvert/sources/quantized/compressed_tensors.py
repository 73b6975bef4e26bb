"""compressed-tensors checkpoints (llm-compressor; read by vLLM and transformers) as a conversion source.

config.json `quantization_config`: {"quant_method": "compressed-tensors", "format", "config_groups": {name:
{"targets", "weights": {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "actorder"},
"format"}}, "ignore"}. A module's scheme is that of the first config group whose targets match it, exact names
before "re:" regexes (re.match) before the class name "Linear" (what compressed-tensors does); a module matching an
`ignore` entry is not quantized. Formats (by the group's `format`, else the config's):

  pack-quantized        int, 4 or 8 bits: weight_packed (N, ceil(K*b/32)) I32, consecutive K values LSB first, each
                        the signed value + 2^(b-1); weight_scale (N, K/G) [group] or (N, 1) [channel] or (1,)
                        [tensor]; weight_shape (2,) I64 = [N, K]; asymmetric: weight_zero_point packed the same way
                        along N, (ceil(N*b/32), n_groups) I32; act order: weight_g_idx (K,)
  naive/int-quantized   int8: weight (N, K) I8, weight_scale as above, weight_zero_point (N, n_groups) I8
  float-quantized       FP8 E4M3 weight (N, K), weight_scale (1,) [tensor], (N, 1) [channel], (N, K/G) [group] or
                        (ceil(N/bn), ceil(K/bk)) [block]
  mxfp4-pack-quantized  weight_packed (N, K/2) U8 of E2M1 pairs, weight_scale (N, K/32) U8 E8M0
  mxfp8-quantized       FP8 E4M3 weight (N, K), weight_scale (N, K/32) U8 E8M0
  nvfp4-pack-quantized  weight_packed (N, K/2) U8, weight_scale (N, K/16) F8_E4M3, weight_global_scale (1,) F32

Values: int W = (q - zero_point) * scale; float W = value * scale (nvfp4: scale / global_scale); all in float32.
Activation and KV-cache scales (input_scale, k_scale, ...) are dropped: our runtime does not quantize activations
that way.
"""
from __future__ import annotations

import re

import numpy as np
from ktlayouts.gptq import unpack_cols, unpack_rows

from ktconvert.sources.fp8 import dequant_fp8_block, fp8_e4m3_to_f32
from ktconvert.sources.quantized.grid import IntGrid, contiguous_g_idx
from ktconvert.sources.quantized.scheme import QuantScheme, QuantTensorInfo, WeightFormat, scale_values
from ktconvert.sources.quantized.values import E8M0_NAN, e8m0_exponents, pow2, unpack_e2m1_times_two
from ktconvert.sources.roles import SourceError

FLOAT_DTYPES = ("BF16", "F16", "F32")
INT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized", "mxfp8-quantized", "mxfp4-pack-quantized",
                 "nvfp4-pack-quantized")
KNOWN_FORMATS = (*INT_FORMATS, *FLOAT_FORMATS, "dense", "mixed-precision")
DROPPED_PARTS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point",
                 "k_scale", "v_scale", "q_scale")


class CompressedTensorsScheme(QuantScheme):
    family = "compressed-tensors"
    parts = ("weight", "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
             "weight_global_scale", *DROPPED_PARTS)
    markers = ("weight_packed", "weight_scale")

    def __init__(self, qc: dict, where: str):
        super().__init__(qc, where)
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise SourceError(f"{where}: unsupported quantization_config (quant_method='compressed-tensors'): "
                              f"quantization_config.config_groups is missing or empty")
        self.format = qc.get("format")
        if self.format is not None and self.format not in KNOWN_FORMATS:
            raise SourceError(f"{self.field('format')} {self.format!r} is not supported; supported: "
                              f"{', '.join(KNOWN_FORMATS)}")
        sparsity = qc.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise SourceError(f"{self.field('sparsity_config.format')} {sparsity.get('format')!r}: sparse "
                              f"checkpoints are not supported")
        self.groups = []
        for gname, g in groups.items():
            if not isinstance(g, dict) or not isinstance(g.get("targets"), list) or not g["targets"]:
                raise SourceError(f"{self.field(f'config_groups.{gname}.targets')} must be a non-empty list")
            self.groups.append((gname, g))
        self.ignore = list(qc.get("ignore") or [])

    # --- which scheme quantizes a module -------------------------------------------------------------------------
    @staticmethod
    def _matches(name: str, target: str) -> int | None:
        """0: exact name, 1: regex, 2: class "Linear" (every stored quantized module is a Linear); None: no match."""
        if target.startswith("re:"):
            return 1 if re.match(target[3:], name) else None
        if target == name:
            return 0
        return 2 if target == "Linear" else None

    def scheme_of(self, module: str) -> tuple[str, dict] | None:
        if any(self._matches(module, t) in (0, 1) for t in self.ignore):
            return None
        best = None
        for gname, g in self.groups:
            for t in g["targets"]:
                rank = self._matches(module, t)
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, gname, g)
        return None if best is None else (best[1], best[2])

    def logical_tensors(self, infos, names, read):
        kept = [n for n in names if n.rpartition(".")[2] not in DROPPED_PARTS]
        return super().logical_tensors(infos, kept, read)

    # --- describe: shapes and dtypes at open -------------------------------------------------------------------
    def describe(self, module: str, parts: dict, read) -> QuantTensorInfo:
        found = self.scheme_of(module)
        first = parts.get("weight_packed") or parts.get("weight_scale")
        if found is None:
            raise SourceError(f"{first.file}: tensor {first.name}: module {module} is stored quantized, but no "
                              f"{self.field('config_groups')} target matches it (or "
                              f"quantization_config.ignore lists it)")
        gname, group = found
        w = group.get("weights")
        key = f"config_groups.{gname}.weights"
        if not isinstance(w, dict):
            raise SourceError(f"{self.field(key)} is missing: a weight scheme is needed for {module}")
        fmt_name = group.get("format") or self.format
        kind, bits = w.get("type", "int"), w.get("num_bits")
        if kind not in ("int", "float") or not isinstance(bits, int):
            raise SourceError(f"{self.field(key)}: type {kind!r} / num_bits {bits!r} is not supported")
        if kind == "int":
            return self._describe_int(module, parts, w, key, fmt_name, read)
        return self._describe_float(module, parts, w, key, fmt_name)

    def _group(self, w: dict, key: str, k: int, strategy: str) -> int:
        if strategy == "group":
            g = w.get("group_size")
            if not isinstance(g, int) or g <= 0:
                raise SourceError(f"{self.field(key + '.group_size')} {g!r}: strategy 'group' needs a positive "
                                  f"group_size")
            return g
        if strategy == "channel":
            return -1
        if strategy == "tensor":
            return 0
        raise SourceError(f"{self.field(key + '.strategy')} {strategy!r} is not supported for this format "
                          f"(group, channel or tensor)")

    def _check_scale_shape(self, scale, n: int, k: int, group: int, key: str, module: str) -> None:
        want = {0: [(1,), (), (1, 1)], -1: [(n, 1), (n,)]}[group] if group <= 0 else [(n, -(-k // group))]
        if tuple(scale.shape) not in want:
            what = {0: "one scale per tensor", -1: "one scale per output channel"}.get(group, f"group_size {group}")
            raise SourceError(f"{scale.file}: tensor {scale.name}: shape {list(scale.shape)} disagrees with "
                              f"{self.field(key + ('.group_size' if group > 0 else '.strategy'))} ({what}) for "
                              f"{module} of shape [{n}, {k}]: expected {list(want[0])}")

    def _describe_int(self, module, parts, w, key, fmt_name, read) -> QuantTensorInfo:
        bits, sym = w["num_bits"], bool(w.get("symmetric", True))
        strategy = w.get("strategy") or ("group" if w.get("group_size") else "channel")
        scale = self.need(parts, module, "weight_scale")
        self.check(scale, FLOAT_DTYPES, None, "scales")
        if "weight_packed" in parts:
            if fmt_name not in (None, "pack-quantized", "mixed-precision"):
                raise SourceError(f"{parts['weight_packed'].file}: tensor {module}.weight_packed: "
                                  f"{self.field('format')} is {fmt_name!r}, but weight_packed is pack-quantized")
            if bits not in (4, 8):
                raise SourceError(f"{self.field(key + '.num_bits')} {bits}: pack-quantized int{bits} is not "
                                  f"supported (4 or 8 bits)")
            packed = parts["weight_packed"]
            shape_info = self.need(parts, module, "weight_shape", "pack-quantized stores the logical shape")
            self.check(shape_info, ("I64", "I32"), (2,), "[N, K]")
            n, k = (int(x) for x in read(shape_info))
            self.check(packed, ("I32",), (n, -(-k * bits // 32)), f"{bits}-bit codes of [{n}, {k}], "
                                                                    f"packed along K")
        else:
            weight = self.need(parts, module, "weight", "naive int quantization stores int8 weights")
            if bits != 8:
                raise SourceError(f"{self.field(key + '.num_bits')} {bits}: unpacked int weights must be 8-bit")
            self.check(weight, ("I8",), None, "int8 weight")
            n, k = weight.shape
        group = self._group(w, key, k, strategy)
        self._check_scale_shape(scale, n, k, group, key, module)
        if not sym:
            zp = self.need(parts, module, "weight_zero_point", f"{self.field(key + '.symmetric')} is false")
            ng = scale.shape[-1] if scale.shape else 1
            want = (-(-n * bits // 32), ng) if "weight_packed" in parts else (n, ng)
            self.check(zp, ("I32",) if "weight_packed" in parts else ("I8",), want, "zero points")
        act = "weight_g_idx" in parts
        if act:
            self.check(parts["weight_g_idx"], ("I32", "I64"), (k,), "group of each input channel")
        fmt = WeightFormat(self.family, "int", bits, group, sym, act)
        return self.make_info(module, parts, (n, k), fmt)

    def _describe_float(self, module, parts, w, key, fmt_name) -> QuantTensorInfo:
        bits = w["num_bits"]
        strategy = w.get("strategy") or "tensor"
        scale = self.need(parts, module, "weight_scale")
        if bits == 8:
            weight = self.need(parts, module, "weight", "FP8 weights are stored as `weight`")
            self.check(weight, ("F8_E4M3",), None, "float8_e4m3fn weight")
            n, k = weight.shape
            if scale.dtype == "U8" or fmt_name == "mxfp8-quantized":
                self.check(scale, ("U8",), (n, -(-k // 32)), "MXFP8: one E8M0 scale per 32 input channels")
                return self.make_info(module, parts, (n, k), WeightFormat(self.family, "mxfp8", 8, 32))
            self.check(scale, FLOAT_DTYPES, None, "scales")
            if strategy == "block":
                bs = w.get("block_structure")
                if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
                    raise SourceError(f"{self.field(key + '.block_structure')} {bs!r}: strategy 'block' needs "
                                      f"[rows, cols]")
                want = (-(-n // bs[0]), -(-k // bs[1]))
                if tuple(scale.shape) != want:
                    raise SourceError(f"{scale.file}: tensor {scale.name}: shape {list(scale.shape)} disagrees with "
                                      f"{self.field(key + '.block_structure')} {bs} for {module} [{n}, {k}]: "
                                      f"expected {list(want)}")
                return self.make_info(module, parts, (n, k), WeightFormat(self.family, "fp8", 8, -2))
            group = self._group(w, key, k, strategy)
            self._check_scale_shape(scale, n, k, group, key, module)
            return self.make_info(module, parts, (n, k), WeightFormat(self.family, "fp8", 8, group))
        if bits == 4:
            packed = self.need(parts, module, "weight_packed", "FP4 weights are packed two per byte")
            self.check(packed, ("U8",), None, "E2M1 pairs")
            n, k = packed.shape[0], packed.shape[1] * 2
            if "weight_global_scale" in parts or fmt_name == "nvfp4-pack-quantized":
                self.check(scale, ("F8_E4M3",), (n, k // 16), "NVFP4: one FP8 scale per 16 input channels")
                self.check(self.need(parts, module, "weight_global_scale"), ("F32", "BF16", "F16"), None,
                           "global scale")
                return self.make_info(module, parts, (n, k), WeightFormat(self.family, "nvfp4", 4, 16))
            self.check(scale, ("U8",), (n, -(-k // 32)), "MXFP4: one E8M0 scale per 32 input channels")
            return self.make_info(module, parts, (n, k), WeightFormat(self.family, "mxfp4", 4, 32))
        raise SourceError(f"{self.field(key + '.num_bits')} {bits}: float weights of {bits} bits are not supported "
                          f"(FP8 or FP4)")

    # --- decode: values ---------------------------------------------------------------------------------------
    def decode(self, info: QuantTensorInfo, read):
        p, f = info.parts, info.fmt
        n, k = info.shape
        if f.kind == "int":
            return self._int_grid(info, read)
        scale_info = p["weight_scale"]
        if f.kind in ("mxfp4", "mxfp8"):
            e = read(scale_info)
            if (e == E8M0_NAN).any():
                i = int(np.flatnonzero(e == E8M0_NAN)[0])
                raise SourceError(f"{scale_info.file}: tensor {scale_info.name}: E8M0 NaN scale (255) at element "
                                  f"{tuple(int(x) for x in np.unravel_index(i, e.shape))}")
            if f.kind == "mxfp4":      # 2 * E2M1 is an integer: an exact int grid with half the power-of-two scale
                q = unpack_e2m1_times_two(read(p["weight_packed"]), k)
                return IntGrid(q, pow2(e8m0_exponents(e) - 1), contiguous_g_idx(k, 32), f.label)
            w = fp8_e4m3_to_f32(read(p["weight"]))
            return w * np.repeat(pow2(e8m0_exponents(e)), 32, axis=1)[:, :k]
        scale = scale_values(read(scale_info), scale_info, "scale")
        if f.kind == "nvfp4":
            gs = scale_values(read(p["weight_global_scale"]), p["weight_global_scale"], "global scale").reshape(-1)
            vals = unpack_e2m1_times_two(read(p["weight_packed"]), k).astype(np.float32) * np.float32(0.5)
            s = (fp8_e4m3_to_f32(read(scale_info)) / gs[0]).astype(np.float32)
            return vals * np.repeat(s, 16, axis=1)[:, :k]
        bits = read(p["weight"])
        if f.group == -2:                               # block scales
            bs = self._block_of(info)
            return dequant_fp8_block(bits.reshape(n, k), scale, bs)
        w = fp8_e4m3_to_f32(bits)
        if f.group <= 0:                                # one scale per tensor (1,) or per output channel (N, 1)
            return w * scale.reshape(-1, 1)
        return w * np.repeat(scale, f.group, axis=1)[:, :k]

    def _block_of(self, info: QuantTensorInfo) -> tuple[int, int]:
        _, group = self.scheme_of(info.module)
        return tuple(group["weights"]["block_structure"])

    def _int_grid(self, info: QuantTensorInfo, read) -> IntGrid:
        p, f = info.parts, info.fmt
        n, k = info.shape
        zero = 1 << (f.bits - 1)
        if "weight_packed" in p:
            q = unpack_cols(read(p["weight_packed"]), f.bits)[:, :k].astype(np.int16) - zero
        else:
            q = read(p["weight"]).astype(np.int16)
        scale = scale_values(read(p["weight_scale"]), p["weight_scale"], "scale").reshape(n if f.group else 1, -1)
        if scale.shape[0] == 1 and n != 1:
            scale = np.repeat(scale, n, axis=0)          # one scale per tensor
        ng = scale.shape[1]
        if not f.symmetric:
            z = read(p["weight_zero_point"])
            zp = (unpack_rows(z, f.bits)[:n].astype(np.int16) - zero) if "weight_packed" in p else z.astype(np.int16)
            group_len = k if f.group <= 0 else f.group
            q = q - np.repeat(zp.reshape(n, ng), group_len, axis=1)[:, :k]
        if "weight_g_idx" in p:
            g_idx = read(p["weight_g_idx"]).astype(np.int64)
            if g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= ng:
                gi = p["weight_g_idx"]
                raise SourceError(f"{gi.file}: tensor {gi.name}: group indices outside [0, {ng})")
        else:
            g_idx = contiguous_g_idx(k, k if f.group <= 0 else f.group)
        return IntGrid(q, scale, g_idx, f.label)
