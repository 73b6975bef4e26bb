"""The conversion plan: which output file holds which tensors, with every shape known before any data is read.

Built from tensor names, dtypes and shapes only (no tensor data; the one exception: an MTP layer's embed_tokens and
shared_head.head are compared with the main model's, and not written when equal), so headers can be written first and
a resumed run plans exactly the same files as the run it continues.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ktlayouts.constants import (
    FORMAT_VERSION,
    META_FORMAT_VERSION,
    META_LAYOUT,
    META_LAYOUT_VERSION,
)
from ktlayouts.converted_dir import (
    GLOBALS_FILE,
    META_GEOMETRY,
    MTP_DENSE_KIND,
    MTP_EXPERT_KIND,
    PROJECTIONS,
    ExpertGeometry,
    dense_file,
    expert_file,
)
from ktlayouts.cpu_expert import LayoutError
from ktlayouts.expert_formats import UNDECLARED_SCALE_DTYPE, expert_format_of_method

from ktconvert.writer import TensorSpec


class ConvertError(Exception):
    """A conversion that cannot proceed; the message names the tensor, file or flag at fault."""


@dataclass
class FileJob:
    rel: str                                   # path relative to the output directory
    kind: str                                  # expert | dense | globals
    layer: int | None
    specs: list[TensorSpec]
    layouts: dict[str, str]                    # output tensor name -> layout name
    metadata: dict[str, str]
    sources: list[tuple[str, object]] = field(default_factory=list)   # dense: (hub name, role) in write order
    shard: int | None = None
    source_nbytes: int = 0                     # bytes of source tensors this job reads (progress)
    mtp: bool = False                          # a multi-token-prediction layer's file (manifest kind mtp_*)

    @property
    def manifest_kind(self) -> str:
        return {"dense": MTP_DENSE_KIND, "expert": MTP_EXPERT_KIND}[self.kind] if self.mtp else self.kind


@dataclass
class ConvertPlan:
    geometry: ExpertGeometry
    jobs: list[list[FileJob]]                  # groups written together (a layer's expert shards), in order
    skipped: list[str]
    source_nbytes: int
    mtp_layers: list[int] = field(default_factory=list)   # MTP layers written (keep_mtp), after the main ones
    mtp_copies: list[str] = field(default_factory=list)   # MTP tensors equal to the main model's: not written again


def _expert_jobs(geo: ExpertGeometry, layer: int, src, adapter) -> list[FileJob]:
    plan = geo.shard_plan
    layout = geo.layout
    nbytes = sum(src.info(adapter.expert_tensor_name(layer, e, p)).nbytes
                 for e in range(geo.n_experts) for p in PROJECTIONS)
    jobs = []
    for s in range(geo.numa_nodes):
        i0, i1 = plan.shard_range(s)
        shapes = geo.expert_tensor_shapes(s)
        specs = [TensorSpec(n, dt, tuple(shape)) for n, (shape, dt) in shapes.items()]
        meta = {META_LAYOUT: layout, META_LAYOUT_VERSION: str(geo.layout_version),
                META_FORMAT_VERSION: str(FORMAT_VERSION),
                META_GEOMETRY: json.dumps({"layer": layer, "shard": s, "n_shards": geo.numa_nodes, "i0": i0, "i1": i1,
                                           "n_experts": geo.n_experts, "hidden": geo.hidden,
                                           "intermediate": geo.intermediate, "bits": geo.bits,
                                           "group_size": geo.group_size}, sort_keys=True)}
        jobs.append(FileJob(expert_file(layer, s, geo.numa_nodes), "expert", layer, specs,
                            {n: layout for n in shapes}, meta, shard=s, source_nbytes=nbytes if s == 0 else 0))
    return jobs


def _check_expert_shapes(src, adapter, geo: ExpertGeometry, present: set[str], layers) -> None:
    want = {"gate": (geo.intermediate, geo.hidden), "up": (geo.intermediate, geo.hidden),
            "down": (geo.hidden, geo.intermediate)}
    for layer in layers:
        for e in range(geo.n_experts):
            for p in PROJECTIONS:
                name = adapter.expert_tensor_name(layer, e, p)
                if name not in present:
                    raise ConvertError(f"routed expert tensor {name} is missing from the checkpoint "
                                       f"(config promises {geo.n_experts} experts in layer {layer})")
                shape = tuple(src.info(name).shape)
                if shape != want[p]:
                    raise ConvertError(f"tensor {name} has shape {shape}, but config.json (hidden_size="
                                       f"{geo.hidden}, expert intermediate={geo.intermediate}) implies {want[p]}; "
                                       f"cannot tile it")


def make_plan(src, adapter, method: str, group_size: int, numa_nodes: int, encoder,
              scale_dtype: str = UNDECLARED_SCALE_DTYPE, keep_mtp: bool = False) -> ConvertPlan:
    """keep_mtp: the checkpoint's MTP layers (adapter.mtp_layers() present in it) are written too, after the main
    layers: routed experts (when the layer has them) as expert files, the rest as a dense file, marked mtp."""
    try:
        fmt = expert_format_of_method(method)
        if fmt.quantized:
            fmt.check_group_size(group_size)
    except LayoutError as e:
        raise ConvertError(f"--group-size: {e}") from None
    try:
        geo = ExpertGeometry(method, group_size, adapter.n_experts, adapter.hidden_size, adapter.moe_intermediate_size,
                             numa_nodes, tuple(adapter.moe_layers()), scale_dtype=scale_dtype)
        geo.to_json()   # validates the shard plan (too many --numa-nodes, empty dims)
    except LayoutError as e:
        raise ConvertError(str(e)) from None
    names = sorted(src.tensor_names())
    present = set(names)
    mtp_layers = adapter.mtp_layers(present) if keep_mtp else []
    mtp_moe = [li for li in mtp_layers if adapter.expert_tensor_name(li, 0, "gate") in present]
    _check_expert_shapes(src, adapter, geo, present, [*geo.moe_layers, *mtp_moe])

    copies = _mtp_copies(src, adapter, mtp_layers, present)
    per_layer: dict[int | None, list] = {}
    skipped = []
    for name in names:
        role = adapter.classify(name, keep_mtp=bool(mtp_layers))
        if name in copies:
            continue
        if role.kind == "skip":
            skipped.append(name)
        elif role.kind != "expert":
            per_layer.setdefault(role.layer, []).append((name, role))
    source_nbytes = 0
    jobs: list[list[FileJob]] = []

    def dense_job(rel, kind, layer, items, mtp=False):
        nonlocal source_nbytes
        specs, layouts, nbytes = [], {}, 0
        for name, role in items:
            info = src.info(name)
            nbytes += info.nbytes
            for out in encoder.plan(name, str(info.dtype), tuple(info.shape), role):
                specs.append(TensorSpec(out.name, out.dtype, out.shape))
                layouts[out.name] = out.layout
        source_nbytes += nbytes
        meta = {META_LAYOUT: f"dense-{encoder.name}", META_FORMAT_VERSION: str(FORMAT_VERSION)}
        return FileJob(rel, kind, layer, specs, layouts, meta, sources=list(items), source_nbytes=nbytes, mtp=mtp)

    for layer in [*range(adapter.num_layers), *mtp_layers]:
        mtp = layer >= adapter.num_layers
        group = []
        if per_layer.get(layer):
            group.append(dense_job(dense_file(layer), "dense", layer, per_layer[layer], mtp))
        if layer in geo.moe_layers or layer in mtp_moe:
            ejobs = _expert_jobs(geo, layer, src, adapter)
            for j in ejobs:
                j.mtp = mtp
            source_nbytes += ejobs[0].source_nbytes
            group.extend(ejobs)
        if group:
            jobs.append(group)
    if per_layer.get(None):
        jobs.append([dense_job(GLOBALS_FILE, "globals", None, per_layer[None])])
    return ConvertPlan(geo, jobs, skipped, source_nbytes, mtp_layers, copies)


def _mtp_copies(src, adapter, mtp_layers: list[int], present: set[str]) -> list[str]:
    """An MTP layer's embed_tokens / shared_head.head that equal the main model's embedding / lm_head (DeepSeek-V3's
    release repeats both: 2 x 1.85 GB): not written again; ktrun's MTP drafter then uses the main ones."""
    import torch

    names = adapter.family.names
    out = []
    for layer in mtp_layers:
        for own, main in (("embed_tokens.weight", names.embed), ("shared_head.head.weight", names.head)):
            own = names.layer(layer) + own
            if own in present and main in present and tuple(src.info(own).shape) == tuple(src.info(main).shape) \
                    and torch.equal(src.read(own), src.read(main)):
                out.append(own)
    return out
