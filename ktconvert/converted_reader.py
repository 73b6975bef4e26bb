"""Reference reader of a converted directory: dequantized experts and dense tensors as float32 numpy arrays.

Used by `ktconvert verify --against` and by tests; it reads through plain `safetensors.safe_open`, so it also
proves the files are standard safetensors.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from ktlayouts import expert_shards
from ktlayouts.bf16 import bf16_bits_to_f32
from ktlayouts.converted_dir import (
    MTP_DENSE_KIND,
    PROJECTIONS,
    ExpertGeometry,
    expert_file,
    expert_tensor,
    load_manifest,
    safe_relpath,
)
from ktlayouts.cpu_expert import unpack_expert_matrix
from ktlayouts.gpu_formats import dequantize_named, quantized_linears
from safetensors import safe_open


def to_numpy(t) -> np.ndarray:
    """A torch tensor read by safetensors -> numpy; bfloat16 as its uint16 bit patterns (numpy has no bfloat16)."""
    import torch

    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


class ConvertedDir:
    def __init__(self, root: str | Path, mtp: bool = False):
        """mtp: the multi-token-prediction layers' dense tensors too (manifest kind mtp_dense; their experts are
        read by layer like any: read_expert)."""
        self.root = Path(root)
        self.manifest, self.geometry = load_manifest(self.root)
        self._handles: dict[str, object] = {}
        kinds = ("dense", "globals", *((MTP_DENSE_KIND,) if mtp else ()))
        self._dense_index = {name: rel for rel, f in self.manifest["files"].items()
                             if f["kind"] in kinds for name in f.get("tensors", {})}
        # GPU-quantized Linears (ktlayouts.gpu_formats): hub weight name -> (file, layout), read dequantized
        self._gpu: dict[str, tuple[str, str]] = {}
        for rel, f in self.manifest["files"].items():
            if f["kind"] in kinds:
                layouts = {n: t["layout"] for n, t in f.get("tensors", {}).items()}
                self._gpu.update({w: (rel, lay) for w, lay in quantized_linears(layouts, layouts).items()})

    def open(self, rel: str):
        if rel not in self._handles:
            self._handles[rel] = safe_open(str(safe_relpath(self.root, rel)), framework="pt")
        return self._handles[rel]

    def close(self) -> None:
        self._handles.clear()

    def dense_names(self) -> list[str]:
        """Non-expert tensors by hub name (a GPU-quantized Linear once, as its `.weight`)."""
        parts = {n for w in self._gpu for n in self._dense_index
                 if n.startswith(w[: -len("weight")]) and n != w[: -len("weight")] + "bias"}
        return sorted((set(self._dense_index) - parts) | set(self._gpu))

    def dense_layout(self, name: str) -> str:
        if name in self._gpu:
            return self._gpu[name][1]
        return self.manifest["files"][self._dense_index[name]]["tensors"][name]["layout"]

    def read_dense(self, name: str) -> np.ndarray:
        """A non-expert tensor as float32 (BF16 stored as uint16 bit patterns by the numpy reader)."""
        if name in self._gpu:
            rel, layout = self._gpu[name]
            f = self.open(rel)
            base = name[: -len("weight")]
            parts = {n: f.get_tensor(n).numpy() for n in self.manifest["files"][rel]["tensors"]
                     if n.startswith(base) and n != base + "bias"}     # the Linear's bias (GLM's q/k/v) stays BF16
            return dequantize_named(layout, parts, name)
        rel = self._dense_index[name]
        t = self.manifest["files"][rel]["tensors"][name]
        a = self.open(rel).get_tensor(name)
        if t["dtype"] == "BF16":          # exact: bf16 -> f32 is a bit shift
            return bf16_bits_to_f32(a.view(torch.int16).numpy().view(np.uint16)).reshape(t["shape"])
        return a.numpy().astype(np.float32)

    def read_expert_shard(self, layer: int, expert: int, shard: int) -> dict[str, np.ndarray]:
        """Dequantized matrices of one shard: gate/up (i1 - i0, H), down (H, i1 - i0) in padded coordinates."""
        geo = self.geometry
        f = self.open(expert_file(layer, shard, geo.numa_nodes))
        out = {}
        for p in PROJECTIONS:
            geom = geo.matrix_geometry(p, shard)
            q = f.get_slice(expert_tensor(p, "qweight"))[expert: expert + 1][0].numpy()
            s = None if not geo.format.quantized else to_numpy(f.get_slice(expert_tensor(p, "scales"))[expert: expert + 1][0])
            out[p] = unpack_expert_matrix(q, s, geom)
        return out

    def read_expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Dequantized expert reassembled from all shards: gate/up (I, H), down (H, I)."""
        return assemble_shards([self.read_expert_shard(layer, expert, s) for s in range(self.geometry.numa_nodes)],
                               self.geometry)


def assemble_shards(shards: list[dict[str, np.ndarray]], geo: ExpertGeometry) -> dict[str, np.ndarray]:
    """Per-shard matrices (padded coordinates) -> the source-shaped gate/up (I, H) and down (H, I)."""
    return expert_shards.join_shards(shards, geo.intermediate)


def relative_error(approx: np.ndarray, ref: np.ndarray) -> float:
    """||approx - ref||_F / ||ref||_F (0 when both are zero)."""
    ref = np.asarray(ref, dtype=np.float64)
    num = float(np.linalg.norm(np.asarray(approx, dtype=np.float64) - ref))
    den = float(np.linalg.norm(ref))
    return num / den if den else (0.0 if num == 0 else float("inf"))


def unit_piece(packed: dict[str, np.ndarray | None], proj: str, geo: ExpertGeometry, shard: int, u0: int, u1: int):
    """Units [u0, u1) of one expert's shard (counted inside the shard), cut straight from the packed bytes
    (ktlayouts.expert_shards.unit_piece). packed: {"qweight": (NB, KT, TB), "scales": (NB, G, 16) or None} of
    `proj` as stored for one expert -> (qweight, scales, MatrixGeometry) of the piece."""
    return expert_shards.unit_piece(packed["qweight"], packed.get("scales"), proj, geo.matrix_geometry(proj, shard),
                                    geo.shard_plan.unit, u0, u1)
