"""GGUF checkpoints (single file or a `-00001-of-0000N.gguf` split set) as a conversion source.

Presents the same interface as ktconvert.sources.Source, under hub tensor names, so the pipeline runs unchanged:
metadata becomes config.json, `tokenizer.ggml.*` becomes tokenizer files, llama.cpp's stacked expert tensors
(`blk.N.ffn_{gate,up,down}_exps`, shape (E, rows, cols)) become one hub tensor per expert, read one expert slice at a
time from the memory-mapped file and dequantized with gguf-py (any ggml type it knows); a fused
`ffn_gate_up_exps` (the converter's --fuse-gate-up-exps) gives each expert's gate and up as runs of its rows. Tensors llama.cpp's converter
changed on the way in are given back as the hub stores them: joined from their GGUF parts, or with the converter's
transform undone (the family's GGUFArch says which and how). Q8_0, Q4_0 and MXFP4 blocks are integer grids
(`int_grid`): the converter takes them over exactly into int8 / int4 group 32 (MXFP4: int8), without a float round
trip (ktconvert.exact_paths).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from ktlayouts.families import gguf_arch
from ktlayouts.families.gguf_names import IGNORED, Join
from ktlayouts.files import allowed_roots

from ktconvert.sources.base import SourceBase
from ktconvert.sources.gguf_meta import Meta, config_from_gguf
from ktconvert.sources.gguf_tokenizer import tokenizer_files
from ktconvert.sources.roles import SourceError, adapter_for, as_source_error
from ktconvert.sources.side_files import checked_path

EXACT_TYPES = {"Q8_0": 8, "Q4_0": 4}        # ggml types that are integers times one f16 scale per 32 values
# MXFP4 block (17 bytes): E8M0 exponent e, 16 bytes whose low nibbles are elements 0-15 and high nibbles 16-31, each an
# E2M1 code; W = (2 x E2M1) * 2^(e - 128) (gguf-py's MXFP4.kvalues are the doubled E2M1 values)
MXFP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int16)
SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str             # hub name
    dtype: str            # ggml type name, e.g. "Q8_0", "BF16"
    shape: tuple          # hub (Linear) orientation
    file: Path
    offset: int           # absolute byte offset of this tensor's (or expert slice's) data
    nbytes: int
    gguf_name: str
    expert: int | None = None
    stored: tuple = ()    # the GGUF tensor's own shape (hub orientation), before an Undo reshapes it
    join: Join | None = None
    parts: tuple = ()     # (part, GGUF name) of a joined tensor
    rows: tuple | None = None   # (first, end) rows of the expert slab a Split part takes (ffn_gate_up_exps)


def split_paths(path: Path) -> list[Path]:
    """All parts of a split set (named like llama.cpp's gguf-split), or [path]; a missing part is an error."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise SourceError(f"{path}: split GGUF set of {n} parts is incomplete: missing {', '.join(missing)}")
    roots = allowed_roots(path.parent) + (path.resolve().parent,)    # the parts found beside the one named
    for p in parts:
        checked_path(p, roots)
    return parts


def _can_dequantize(qtype) -> bool:
    """Whether gguf-py has a dequantizer for this ggml type (probed once per type on an empty array)."""
    import gguf
    try:
        gguf.quants.dequantize(np.zeros((0, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001 - an empty probe may trip shape checks; the type itself is known
        return True
    return True


def _open_reader(path: Path):
    import gguf
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise SourceError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise SourceError(f"{path}: tensor {t.name}: data ends at byte {t.data_offset + t.n_bytes}, "
                              f"past the end of the file ({size} bytes); the file is truncated")
    return reader


class GGUFSource(SourceBase):
    def __init__(self, path: Path):
        self.path = Path(path)
        self._readers = [_open_reader(p) for p in split_paths(self.path)]
        self._where = str(self.path)
        self.meta = Meta(self._readers[0].fields, self._where)
        with as_source_error():
            self.gguf_arch = gguf_arch(self.meta.arch, str(self.path))   # its tensor names and metadata keys
        self._tensors = {t.name: (t, p) for r, p in zip(self._readers, split_paths(self.path)) for t in r.tensors}
        emb = self._tensors.get("token_embd.weight")
        if emb is None:
            raise SourceError(f"{self.path}: no token_embd.weight tensor")
        names = set(self._tensors)
        self.config = config_from_gguf(self.meta, int(emb[0].shape[-1]), "output.weight" in names, frozenset(names))
        self.arch = adapter_for(self.config, f"{self.path} (GGUF metadata)")
        for t, p in self._tensors.values():
            if not _can_dequantize(t.tensor_type):
                raise SourceError(f"{p}: tensor {t.name}: ggml type {t.tensor_type.name} cannot be dequantized "
                                  f"by this version of gguf-py")
        self._infos: dict[str, GGUFTensorInfo] = {}
        self._build_map()

    # --- name mapping -------------------------------------------------------------------------------------
    def _build_map(self) -> None:
        n_layers = self.arch.num_layers
        joins: dict[str, dict] = {}
        for gname, (t, file) in self._tensors.items():
            if IGNORED.match(gname):
                continue
            mapped = self.gguf_arch.match(gname)
            if mapped is None:
                raise SourceError(f"{file}: tensor {gname}: unknown tensor name for GGUF architecture {self.meta.arch}")
            if mapped.layer is not None and mapped.layer >= n_layers:
                continue  # multi-token-prediction blocks some converters keep
            rows = tuple(int(x) for x in reversed(t.shape))     # GGUF dims are innermost first
            hub = mapped.hub
            if mapped.join is not None:
                joins.setdefault(hub, {"join": mapped.join})[mapped.part] = (t, file, rows)
            elif "{E}" in hub:
                self._add_experts(t, file, rows, hub, mapped.split.parts if mapped.split else (None,))
            else:
                undo = self.gguf_arch.undo_for(hub)
                shape = undo.shape(rows, self.config) if undo else rows
                self._infos[hub] = GGUFTensorInfo(hub, t.tensor_type.name, shape, file, int(t.data_offset),
                                                  int(t.n_bytes), t.name, None, rows)
        for hub, got in joins.items():
            join = got.pop("join")
            missing = [p for p in join.parts if p not in got]
            if missing:
                have = next(iter(got.values()))[0].name
                raise SourceError(f"{self.path}: tensor {have} is one part of {hub}; its part {missing[0]!r} is "
                                  f"missing (llama.cpp writes {', '.join(join.parts)})")
            first, file, _ = got[join.parts[0]]
            shape = join.shape({p: got[p][2] for p in join.parts}, self.config)
            self._infos[hub] = GGUFTensorInfo(hub, first.tensor_type.name, shape, file, int(first.data_offset),
                                              sum(int(got[p][0].n_bytes) for p in join.parts), first.name,
                                              join=join, parts=tuple((p, got[p][0].name) for p in join.parts))
        for name in self.arch.expert_tensor_names():
            if name not in self._infos:
                raise SourceError(f"{self.path}: tensor {name} (from blk.*.ffn_*_exps) is missing")

    def _add_experts(self, t, file: Path, rows: tuple, hub: str, parts: tuple) -> None:
        """One hub tensor per expert (and per part of a Split: a contiguous run of each expert slab's rows)."""
        if len(rows) != 3 or rows[1] % len(parts):
            raise SourceError(f"{file}: tensor {t.name}: shape {list(rows)} (experts, rows, columns) does not hold "
                              f"{len(parts)} equal parts ({', '.join(p for p in parts if p)}) along its rows")
        per = int(t.n_bytes) // rows[0]                   # bytes of one expert slab
        n = rows[1] // len(parts)                         # rows of one part
        for e in range(rows[0]):
            for i, part in enumerate(parts):
                name = hub.replace("{E}", str(e)).replace("{P}", part or "")
                split = (i * n, (i + 1) * n) if part else None
                self._infos[name] = GGUFTensorInfo(name, t.tensor_type.name, (n, rows[2]), file,
                                                   int(t.data_offset) + e * per + i * (per // len(parts)),
                                                   per // len(parts), t.name, e, (n, rows[2]), rows=split)

    # --- Source interface ---------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return list(self._infos)

    def _raw(self, gname: str, expert: int | None, rows: tuple | None = None) -> np.ndarray:
        """The stored array (blocks as bytes for quantized types) of a tensor, one expert slab, or a run of its rows."""
        t, _ = self._tensors[gname]
        raw = t.data if expert is None else t.data[expert]
        return np.asarray(raw if rows is None else raw[rows[0]: rows[1]])

    def _dequant(self, gname: str, expert: int | None, rows: tuple | None = None) -> np.ndarray:
        import gguf
        t, _ = self._tensors[gname]
        return np.asarray(gguf.quants.dequantize(self._raw(gname, expert, rows), t.tensor_type), dtype=np.float32)

    def read(self, name: str) -> torch.Tensor:
        info = self.info(name)
        if info.join is not None:
            out = info.join.build({p: self._dequant(g, None) for p, g in info.parts}, self.config)
        else:
            out = self._dequant(info.gguf_name, info.expert, info.rows).reshape(info.stored)
            undo = self.gguf_arch.undo_for(name)
            if undo is not None:
                out = undo.fn(out, self.config)
        out = out.reshape(info.shape)
        bad = ~np.isfinite(out)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SourceError(f"{info.file}: tensor {info.gguf_name} ({name}): non-finite value at element "
                              f"{np.unravel_index(i, out.shape)} (tensor data at byte offset {info.offset})")
        return torch.from_numpy(np.array(out, dtype=np.float32, order="C"))

    def _blocks(self, info: GGUFTensorInfo) -> np.ndarray:
        return self._raw(info.gguf_name, info.expert, info.rows)

    def quant_format(self, name: str):
        """The WeightFormat of a quantized ggml type (Q8_0 and Q4_0 are integer grids), None for float types."""
        from ktconvert.sources.quantized import WeightFormat

        info = self.info(name)
        if info.dtype in ("F32", "F16", "BF16"):
            return None
        if info.dtype in EXACT_TYPES and not self._changed(info):
            return WeightFormat("gguf", "int", EXACT_TYPES[info.dtype], 32, name=f"GGUF {info.dtype}")
        if info.dtype == "MXFP4" and not self._changed(info):
            return WeightFormat("gguf", "mxfp4", 4, 32, name="GGUF MXFP4")
        return WeightFormat("gguf", info.dtype, 0, 0, name=f"GGUF {info.dtype}")

    def _changed(self, info: GGUFTensorInfo) -> bool:
        """Tensors llama.cpp's converter permuted, split or transformed: read through the float path only."""
        return info.join is not None or self.gguf_arch.undo_for(info.name) is not None

    def int_grid(self, name: str):
        """Q8_0 / Q4_0 / MXFP4 weights as their integer grid (ktconvert.sources.quantized.IntGrid), exactly; else
        None. Q8_0 block (34 bytes): f16 scale d, 32 int8 q; Q4_0 block (18 bytes): f16 d, 16 bytes whose low nibbles
        are elements 0-15 and high nibbles 16-31, W = (nibble - 8) * d; MXFP4 (17 bytes): see MXFP4_DOUBLED."""
        from ktconvert.sources.quantized import IntGrid
        from ktconvert.sources.quantized.grid import contiguous_g_idx
        from ktconvert.sources.quantized.values import pow2

        info = self.info(name)
        if info.dtype not in (*EXACT_TYPES, "MXFP4") or self._changed(info):
            return None
        n, k = info.shape
        size = {"Q8_0": 34, "Q4_0": 18, "MXFP4": 17}[info.dtype]
        blocks = self._blocks(info).reshape(n, k // 32, size)
        if info.dtype == "MXFP4":
            e = blocks[..., 0]            # ggml reads every E8M0 code as a power of two (255: 2^127, not NaN)
            qs = blocks[..., 1:]
            q = MXFP4_DOUBLED[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)]
            return IntGrid(q.reshape(n, k), pow2(e.astype(np.int32) - 128), contiguous_g_idx(k, 32), "GGUF MXFP4")
        scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        if info.dtype == "Q8_0":
            q = blocks[..., 2:].view(np.int8).astype(np.int16)
        else:
            qs = blocks[..., 2:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16) - 8
        return IntGrid(q.reshape(n, k), scales, contiguous_g_idx(k, 32), f"GGUF {info.dtype}")

    def side_files(self) -> dict[str, bytes]:
        """config.json and tokenizer files, built from the GGUF metadata."""
        files = tokenizer_files(self.meta, int(self.config.get("max_position_embeddings", 4096)))
        files["config.json"] = (json.dumps(self.config, indent=2) + "\n").encode()
        return files

    def close(self) -> None:
        self._readers = []


def is_gguf(path) -> bool:
    p = Path(path)
    return p.suffix == ".gguf" and p.is_file()
