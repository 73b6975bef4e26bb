"""Lazy reader for a local Hugging Face checkpoint directory (safetensors shards + index).

Every shard header is parsed and validated at open (the JSON after an 8-byte little-endian length; never
unpickled); tensor data is read one tensor at a time with pread into a fresh buffer, so memory stays bounded by
the largest tensor (no mapping keeps pages of the whole checkpoint resident). FP8 weights (DeepSeek release
format) are dequantized on the CPU with their weight_scale_inv.
"""
from __future__ import annotations

import json
import mmap
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from ktlayouts.bf16 import bf16_bits_to_f32
from ktlayouts.files import allowed_roots

from ktconvert.sources.base import SourceBase
from ktconvert.sources.fp8 import FP8_FMTS, FP8_SCALE_FMTS, dequant_fp8_block, fp8_e4m3_to_f32
from ktconvert.sources.fused_experts import FusedExpertScheme
from ktconvert.sources.quantized import QuantTensorInfo, scheme_for
from ktconvert.sources.roles import ArchAdapter, SourceError, adapter_for
from ktconvert.sources.side_files import checked_path, side_files
from ktconvert.sources.st_header import DTYPE_SIZES, TensorInfo, parse_shard

INDEX_NAME = "model.safetensors.index.json"
_INT_DTYPES = ("I8", "U8", "I16", "I32", "I64")
_NUMPY_DTYPES = {"F16": np.float16, "F32": np.float32, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "I8": np.int8,
                 "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64}
SINGLE_NAME = "model.safetensors"

_DECODED_INTO = ("BF16", "F16", "F32")    # encodings read(..., out=) decodes into the caller's buffer
FINITE_CHUNK = 1 << 20                     # values per step of the NaN/Inf check


def fp8_block_size(qc: dict, where) -> tuple[int, int]:
    """(rows, cols) of the FP8 weight blocks a quantization_config names ((128, 128) when there is none);
    SourceError naming the field for any other quantization."""
    if not qc:
        return (128, 128)
    method, fmt, scale_fmt = qc.get("quant_method"), qc.get("fmt", "e4m3"), qc.get("scale_fmt")
    if method != "fp8" or fmt not in FP8_FMTS or scale_fmt not in FP8_SCALE_FMTS:
        raise SourceError(f"{where}: unsupported quantization_config (quant_method={method!r}, fmt={fmt!r}"
                          f"{f', scale_fmt={scale_fmt!r}' if scale_fmt else ''}); supported: unquantized BF16/F16/F32 "
                          f"and fp8 e4m3 128x128 block scales (the DeepSeek-V3 / V3.2, Kimi-K2 and MiniMax-M2 "
                          f"release format)")
    block = qc.get("weight_block_size") or (128, 128)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise SourceError(f"{where}: quantization_config.weight_block_size = {block!r} is not two positive integers")
    return tuple(block)


def _safe_shard_path(root: Path, shard: str, where: str, roots: tuple[Path, ...]) -> Path:
    if not isinstance(shard, str) or not shard or "/" in shard or "\\" in shard or shard in (".", ".."):
        raise SourceError(f"{where}: shard name {shard!r} is not a plain file name inside {root}")
    checked_path(root / shard, roots)
    return root / shard


class Source(SourceBase):
    """One local checkpoint directory, validated at open, read lazily one tensor at a time."""

    def __init__(self, path: Path):
        self.path = Path(path)
        # every file read (config, index, shards, side files) resolves inside these (ktconvert.sources.side_files)
        self.roots = allowed_roots(self.path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise SourceError(f"{self.path}: no config.json (not a checkpoint directory)")
        self.side_paths = side_files(self.path, self.roots)     # config.json among them: checked before reading
        try:
            self.config: dict = json.loads(cfg_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SourceError(f"{cfg_path}: invalid JSON: {e}") from e
        self.arch: ArchAdapter = adapter_for(self.config, str(cfg_path))
        # a wrapped checkpoint (Kimi-K2.5) may keep its quantization_config in the text model's config
        qc = (self.config.get("quantization_config")
              or self.arch.family.text_config(self.config).get("quantization_config") or {})
        if qc and self.config.get("expert_dtype") is not None and "expert_dtype" not in qc:
            qc = {**qc, "expert_dtype": self.config["expert_dtype"]}   # DeepSeek-V4's top-level field, as transformers
        # already-quantized Linears (compressed-tensors, GPTQ, AWQ, FP8 per channel, MX): ktconvert.sources.quantized
        fused = self.arch.family.names.fused_experts
        # fused routed experts (gpt-oss: unquantized or MXFP4; Qwen3.5-MoE: unquantized) read as per-expert
        # weights: sources.fused_experts. A family whose fused form is optional reads other formats as usual.
        self.quant = (FusedExpertScheme(fused, self.arch.cfg, qc, str(cfg_path))
                      if fused is not None and not (fused.optional and qc) else scheme_for(qc, str(cfg_path)))
        # DeepSeek-style FP8 blocks (DeepSeek-V3 / V3.2, Kimi-K2, MiniMax-M2): read here
        self.fp8_block: tuple[int, int] = fp8_block_size(qc if self.quant is None else {}, cfg_path)
        self._infos: dict[str, TensorInfo] = {}
        self._names: list[str] = []
        self._load_index()
        if self.quant is not None:      # stored parts (X.weight_packed, X.qweight, ...) -> one logical X.weight each
            self._infos, self._names = self.quant.logical_tensors(self._infos, self._names, self.read_stored)
        self._validate_tensors()

    # --- open-time validation ---------------------------------------------------------------------------
    def _load_index(self) -> None:
        index_path = self.path / INDEX_NAME
        if index_path.is_file():
            checked_path(index_path, self.roots)
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise SourceError(f"{index_path}: invalid index (needs a JSON weight_map): {e}") from e
            if not isinstance(weight_map, dict):
                raise SourceError(f"{index_path}: weight_map is not an object")
            shard_names = list(dict.fromkeys(weight_map.values()))
        elif (self.path / SINGLE_NAME).is_file():
            weight_map, shard_names = None, [SINGLE_NAME]
        else:
            raise SourceError(f"{self.path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        per_shard: dict[str, dict[str, TensorInfo]] = {}
        for shard in shard_names:
            p = _safe_shard_path(self.path, shard, str(index_path), self.roots)
            if not p.is_file():
                raise SourceError(f"{index_path}: shard {shard} named in the index is missing on disk ({p})")
            per_shard[shard], _ = parse_shard(p)
        if weight_map is None:
            self._infos = dict(per_shard[SINGLE_NAME])
            self._names = list(self._infos)
            return
        for name, shard in weight_map.items():
            info = per_shard[shard].get(name)
            if info is None:
                raise SourceError(f"{index_path}: tensor {name} is mapped to shard {shard}, which does not contain it")
            self._infos[name] = info
        for shard, tensors in per_shard.items():
            extra = sorted(set(tensors) - set(weight_map))
            if extra:
                raise SourceError(f"{self.path / shard}: tensor {extra[0]} is in the shard but missing from "
                                  f"{INDEX_NAME} ({len(extra)} such tensors)")
        self._names = list(weight_map)
        if not self._names:
            raise SourceError(f"{index_path}: the index lists no tensors")

    def _validate_tensors(self) -> None:
        for name in self._names:
            self.arch.classify(name)  # unknown names fail here, naming the tensor
            info = self._infos[name]
            if info.dtype == "F8_E4M3":
                self._check_fp8_scale(info)
            elif info.dtype in _INT_DTYPES and self.arch.classify(name).kind != "kept":
                raise SourceError(f"{info.file}: tensor {name}: dtype {info.dtype} is not a weight dtype here "
                                  f"(integer tensors belong to a quantized Linear that quantization_config "
                                  f"describes)")
        a = self.arch
        h, i = a.hidden_size, a.moe_intermediate_size
        want = {"gate": (i, h), "up": (i, h), "down": (h, i)}
        for layer in a.moe_layers():
            for e in range(a.n_experts):
                for proj, shape in want.items():
                    name = a.expert_tensor_name(layer, e, proj)
                    info = self._infos.get(name)
                    if info is None:
                        raise SourceError(f"{self.path}: tensor {name} is missing (config promises {a.n_experts} "
                                          f"experts in layers {a.moe_layers()})")
                    if info.shape != shape:
                        raise SourceError(f"{info.file}: tensor {name} has shape {info.shape}, but config.json "
                                          f"(hidden_size={h}, expert intermediate={i}) implies {shape}")

    def _check_fp8_scale(self, info: TensorInfo) -> None:
        sname = info.name + "_scale_inv"
        s = self._infos.get(sname)
        if len(info.shape) != 2:
            raise SourceError(f"{info.file}: tensor {info.name}: FP8 weight must be 2-D, got shape {info.shape}")
        if s is None:
            raise SourceError(f"{info.file}: tensor {info.name}: FP8 weight without {sname}")
        (bn, bk), (n, k) = self.fp8_block, info.shape
        want = (-(-n // bn), -(-k // bk))
        if s.shape != want or s.dtype != "F32":
            raise SourceError(f"{s.file}: tensor {sname}: shape {s.shape} {s.dtype}, expected F32 {want} for "
                              f"{info.name} {info.shape} with blocks {(bn, bk)}")

    # --- public API ---------------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._names)

    def _raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, read with pread into a fresh buffer: no mapping stays resident after the read, so
        memory is bounded by the tensor being read, whatever the checkpoint's size. The shard is opened per read
        (microseconds): no shared descriptor, so threads may read concurrently and close() is always safe."""
        fd = os.open(info.file, os.O_RDONLY)
        try:
            return self._pread(fd, info)
        finally:
            os.close(fd)

    @staticmethod
    def _pread(fd: int, info: TensorInfo) -> np.ndarray:
        buf = np.empty(info.nbytes, dtype=np.uint8)
        view, done = memoryview(buf), 0
        while done < info.nbytes:
            got = os.preadv(fd, [view[done:]], info.offset + done)
            if got <= 0:
                raise SourceError(f"{info.file}: tensor {info.name}: file ended at byte offset {info.offset + done}, "
                                  f"expected {info.nbytes - done} more bytes (shard changed after open?)")
            done += got
        return buf

    def read_raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes decoded to f32 numpy WITHOUT FP8 scaling (copy, shape as stored)."""
        info = self.info(name)
        raw = self._raw(info)
        if info.dtype == "BF16":
            out = bf16_bits_to_f32(raw.view(np.uint16))
        elif info.dtype == "F16":
            out = raw.view(np.float16).astype(np.float32)
        elif info.dtype == "F32":
            out = raw.view(np.float32).copy()
        elif info.dtype == "F8_E4M3":
            out = fp8_e4m3_to_f32(raw)
        elif info.dtype in _INT_DTYPES:      # a kept integer table (DeepSeek-V4's tid2eid): exact below 2^24
            out = raw.view(_NUMPY_DTYPES[info.dtype]).astype(np.float32)
        else:
            raise SourceError(f"{info.file}: tensor {name}: {info.dtype} is not a float tensor")
        return out.reshape(info.shape)

    def read_stored(self, info: TensorInfo) -> np.ndarray:
        """One stored tensor in its own dtype (BF16 widened to float32 exactly, F8_E4M3 as its uint8 bits)."""
        raw = self._raw(info)
        out = bf16_bits_to_f32(raw.view(np.uint16)) if info.dtype == "BF16" else raw.view(_NUMPY_DTYPES[info.dtype])
        return out.reshape(info.shape)

    def int_grid(self, name: str):
        """A quantized Linear's integer grid (ktconvert.sources.quantized.IntGrid), or None (not quantized, or
        not an integer format): what the converter takes over exactly where a layout holds it."""
        info = self.info(name)
        if not isinstance(info, QuantTensorInfo):
            return None
        got = self.quant.decode(info, self.read_stored)
        return got if not isinstance(got, np.ndarray) else None

    def quant_format(self, name: str):
        """The WeightFormat of a quantized Linear, or None (stored as plain floats)."""
        info = self.info(name)
        return info.fmt if isinstance(info, QuantTensorInfo) else None

    reads_into = _DECODED_INTO      # the stored dtypes read(name, out=) decodes into the caller's buffer

    def read(self, name: str, out: np.ndarray | None = None) -> torch.Tensor:
        """One tensor as float32 (FP8 weights dequantized with their block scales); NaN/Inf -> SourceError.
        out: a float32 array of the tensor's shape that a BF16 / F16 / F32 tensor is decoded into, straight from
        the page cache (_decode_mapped), for a caller that reuses its buffers; ignored for other encodings. A
        conversion reads gigabytes in tensors of tens of MB: fresh arrays each time were fresh pages for the kernel
        to zero, most of an rtn conversion's system time."""
        info = self.info(name)
        if out is not None and not isinstance(info, QuantTensorInfo) and info.dtype in _DECODED_INTO:
            if out.shape != tuple(info.shape) or out.dtype != np.float32:
                raise ValueError(f"{name}: out is {out.dtype} {out.shape}, the tensor float32 {tuple(info.shape)}")
            self._decode_mapped(info, out)
            return torch.from_numpy(self._check_finite(info, out))
        if isinstance(info, QuantTensorInfo):
            got = self.quant.decode(info, self.read_stored)
            out = got if isinstance(got, np.ndarray) else got.dequantize()
            return torch.from_numpy(self._check_finite(info, np.ascontiguousarray(out, dtype=np.float32)))
        if info.dtype == "F8_E4M3":
            scale_name = name + "_scale_inv"
            scale = self._check_finite(self.info(scale_name), self.read_raw(scale_name))
            out = dequant_fp8_block(np.asarray(self._raw(info)).reshape(info.shape), scale, self.fp8_block)
        else:
            out = self.read_raw(name)
        return torch.from_numpy(self._check_finite(info, out))

    def read_bf16(self, name: str) -> torch.Tensor:
        """One tensor as bfloat16: a BF16 tensor's stored bits as they are (no float32 in between), anything else
        read() rounded to bfloat16 (what CPU autocast does to a float32 weight before a bf16 matmul)."""
        info = self.info(name)
        if isinstance(info, QuantTensorInfo) or info.dtype != "BF16":
            return self.read(name).to(torch.bfloat16)
        bits = self._mapped(info) if info.offset % 2 == 0 else self._raw(info)
        bits = bits.view(np.uint16)
        if any(((bits[i:i + FINITE_CHUNK] & 0x7F80) == 0x7F80).any() for i in range(0, bits.size, FINITE_CHUNK)):
            return self.read(name).to(torch.bfloat16)   # exponent all ones: NaN or Inf, which read() names
        with warnings.catch_warnings():      # a read-only mapping: the forward only reads its weights
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(info.shape)

    @staticmethod
    def _map(info: TensorInfo) -> tuple[mmap.mmap, int]:
        """(a read-only mapping of the page cache holding the tensor, pages mapped at once (MAP_POPULATE), the
        tensor's byte offset in it); the file's size checked first (a shard cut short while mapped would fault)."""
        start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
        fd = os.open(info.file, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size < info.offset + info.nbytes:
                raise SourceError(f"{info.file}: tensor {info.name}: file ends before byte offset "
                                  f"{info.offset + info.nbytes} (shard changed after open?)")
            mm = mmap.mmap(fd, info.offset + info.nbytes - start, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                           prot=mmap.PROT_READ, offset=start)
        finally:
            os.close(fd)
        return mm, info.offset - start

    @staticmethod
    def _mapped(info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only mapping of the page cache: no copy and no fresh pages (pread's copy into
        a buffer of ours was ~6% of a calibrated conversion's CPU time). Read-only: a writable private mapping would
        be populated by write faults, every page copied. The array keeps the mapping; it is unmapped when the last
        view of it goes (one expert's forward)."""
        mm, at = Source._map(info)
        return np.frombuffer(mm, np.uint8, info.nbytes, at)

    @staticmethod
    def _decode_mapped(info: TensorInfo, out: np.ndarray) -> None:
        """Decode the tensor into out straight from the page cache: mapped, read in place and unmapped, so there is
        no copy into a buffer of ours (pread's copy was a tenth of an rtn conversion's CPU time) and nothing stays
        mapped."""
        mm, at = Source._map(info)
        try:
            raw = np.frombuffer(mm, np.uint8, info.nbytes, at)
            if info.dtype == "BF16":
                bf16_bits_to_f32(raw.view(np.uint16).reshape(out.shape), out=out)
            else:
                np.copyto(out, raw.view(_NUMPY_DTYPES[info.dtype]).reshape(out.shape))
            del raw
        finally:
            mm.close()

    @staticmethod
    def _check_finite(info: TensorInfo, values: np.ndarray) -> np.ndarray:
        flat = values.reshape(-1)             # checked a chunk at a time: no tensor-sized temporaries
        if all(np.isfinite(flat[i:i + FINITE_CHUNK]).all() for i in range(0, flat.size, FINITE_CHUNK)):
            return values
        bad = ~np.isfinite(values)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            what = "NaN" if np.isnan(values.flat[i]) else "Inf"
            where = tuple(int(x) for x in np.unravel_index(i, info.shape))
            at = (f"byte offset {info.offset + i * DTYPE_SIZES[info.dtype]}"
                  if info.dtype in DTYPE_SIZES and not isinstance(info, QuantTensorInfo) else
                  f"dequantized from {', '.join(sorted(p.name for p in info.parts.values()))}")
            raise SourceError(f"{info.file}: tensor {info.name}: {what} at element {where} ({at}); "
                              f"{int(bad.sum())} non-finite values")
        return values

    def close(self) -> None:
        """Nothing stays open between reads; kept so a Source works as a context manager like a file."""

    def __repr__(self) -> str:
        return f"Source({self.path}, {self.arch!r}, {len(self._names)} tensors)"
