"""The converted directory: file names, tensor names, manifest schema and validation (spec: README.md).

    converted/
      manifest.json                       written LAST: a directory without it is not a complete conversion
      config.json, tokenizer files        copied from the source (config.json without quantization_config)
      experts/layer-{L:04d}.shard-{s}-of-{S}.safetensors
          gate.qweight (E, NB, KT, TB) U8   gate.scales (E, NB, G, 16) F16 / BF16 (layout version 2) or F32
          (version 1)   (same for up, down; bf16: qweight only)
      dense/layer-{L:04d}.safetensors     non-expert tensors of layer L under their hub names (BF16; router F32 ok)
      dense/globals.safetensors           embeddings, final norm, head
      (MTP layers, manifest `mtp_layers`: the same two file kinds at layer L >= num_layers, listed with kind
      `mtp_expert` / `mtp_dense`, so readers of the main model never take them for its own)

Every tensor starts at a multiple of FILE_ALIGN bytes in its file; tensors named `__pad__.N` are U8 filler that
keeps safetensors' contiguous offsets aligned, and readers ignore them.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .constants import FILE_ALIGN, FORMAT_VERSION
from .cpu_expert import LayoutError, MatrixGeometry
from .expert_formats import (
    UNDECLARED_SCALE_DTYPE,
    ExpertFormat,
    expert_format_of_method,
    layout_versions,
    methods,
    scale_encoding,
    scale_encodings,
)
from .expert_shards import ShardPlan

MANIFEST_NAME = "manifest.json"
PROGRESS_NAME = ".ktconvert-progress.json"     # resume journal of an unfinished conversion
SOURCE_RECORD_NAME = ".ktconvert-source.json"  # in a source dir: {"repo_id": ..., "revision": ...} when known
PARTIAL_SUFFIX = ".partial"                    # files being written; never part of a complete conversion
EXPERT_DIR = "experts"
DENSE_DIR = "dense"
GLOBALS_FILE = f"{DENSE_DIR}/globals.safetensors"
PAD_PREFIX = "__pad__."
PROJECTIONS = ("gate", "up", "down")

# Layout names of non-expert tensors (the GPU-layer encoders add their own).
DENSE_LAYOUT_BF16 = "dense-bf16"
DENSE_LAYOUT_F32 = "dense-f32"

# manifest file kinds of a multi-token-prediction layer's files (dense/layer-L, experts/layer-L.*), beside the main
# model's "dense" / "expert": ktrun loads them only to draft with them (--speculative mtp)
MTP_DENSE_KIND = "mtp_dense"
MTP_EXPERT_KIND = "mtp_expert"

# safetensors __metadata__ keys of expert files (besides constants.META_*)
META_GEOMETRY = "kt.geometry"   # JSON: {"n_experts", "hidden", "intermediate", "shard", "n_shards", "i0", "i1", ...}

_EXPERT_RE = re.compile(r"^experts/layer-(\d{4})\.shard-(\d+)-of-(\d+)\.safetensors$")
_DENSE_RE = re.compile(r"^dense/layer-(\d{4})\.safetensors$")


class ManifestError(ValueError):
    """A manifest.json that does not follow this spec."""


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(byte offset of the data section, header dict) of a safetensors file; reads only the header.
    A short or corrupt header -> ManifestError naming the file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ManifestError(f"{path}: truncated (no safetensors header)")
        n = struct.unpack("<Q", head)[0]
        raw = f.read(n)
    if len(raw) < n:
        raise ManifestError(f"{path}: truncated safetensors header")
    try:
        return 8 + n, json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: corrupt safetensors header ({e})") from None


def expert_file(layer: int, shard: int, n_shards: int) -> str:
    return f"{EXPERT_DIR}/layer-{layer:04d}.shard-{shard}-of-{n_shards}.safetensors"


def dense_file(layer: int) -> str:
    return f"{DENSE_DIR}/layer-{layer:04d}.safetensors"


def expert_tensor(proj: str, part: str) -> str:
    """proj in gate|up|down, part in qweight|scales -> e.g. 'gate.qweight'."""
    return f"{proj}.{part}"


def is_pad_tensor(name: str) -> bool:
    return name.startswith(PAD_PREFIX)


def safe_relpath(root: Path, rel: str) -> Path:
    """root / rel, refusing absolute paths and paths that escape root."""
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or not rel:
        raise ManifestError(f"path {rel!r} in manifest escapes the converted directory")
    return Path(root) / p


@dataclass(frozen=True)
class ExpertGeometry:
    """Routed-expert geometry of a conversion (manifest["experts"])."""
    method: str
    group_size: int
    n_experts: int
    hidden: int
    intermediate: int
    numa_nodes: int
    moe_layers: tuple[int, ...]
    scale_dtype: str = UNDECLARED_SCALE_DTYPE   # f32 (layout version 1) | f16 | bf16 (version 2) | sub6 (version 3,
                                                # two-level); unused by the bf16 method

    @property
    def format(self) -> ExpertFormat:
        """The method's record (ktlayouts.expert_formats)."""
        return expert_format_of_method(self.method)

    @property
    def layout(self) -> str:
        return self.format.layout

    @property
    def layout_version(self) -> int:
        return self.format.layout_version(self.scale_dtype)

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def shard_plan(self) -> ShardPlan:
        return ShardPlan(self.intermediate, self.group_size, self.numa_nodes, bits=self.bits,
                         scale_dtype=self.format.scale_dtype_of(self.scale_dtype))

    def matrix_geometry(self, proj: str, shard: int) -> MatrixGeometry:
        plan = self.shard_plan
        return plan.down_geometry(shard, self.hidden) if proj == "down" else plan.gate_up_geometry(shard, self.hidden)

    def to_json(self) -> dict:
        plan = self.shard_plan
        return {"method": self.method, "layout": self.layout, "layout_version": self.layout_version,
                **({"scale_dtype": self.scale_dtype} if self.format.quantized else {}),
                "bits": self.bits, "group_size": self.group_size, "n_experts": self.n_experts, "hidden": self.hidden,
                "intermediate": self.intermediate, "intermediate_pad": plan.intermediate_pad, "unit": plan.unit,
                "numa_nodes": self.numa_nodes, "shard_ranges": [list(r) for r in plan.shard_ranges()],
                "moe_layers": list(self.moe_layers)}

    @classmethod
    def from_json(cls, d: dict) -> ExpertGeometry:
        try:
            g = cls(method=d["method"], group_size=int(d["group_size"]), n_experts=int(d["n_experts"]),
                    hidden=int(d["hidden"]), intermediate=int(d["intermediate"]), numa_nodes=int(d["numa_nodes"]),
                    moe_layers=tuple(int(x) for x in d["moe_layers"]),
                    scale_dtype=str(d.get("scale_dtype", UNDECLARED_SCALE_DTYPE)))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"manifest 'experts' section is malformed: {e!r}") from None
        if g.method not in methods():
            raise ManifestError(f"manifest 'experts.method' {g.method!r} is not one of {sorted(methods())}")
        if g.scale_dtype not in {r.name for r in scale_encodings()}:
            raise ManifestError(f"manifest 'experts.scale_dtype' {g.scale_dtype!r} is not one of "
                                f"{sorted(r.name for r in scale_encodings())}")
        version = d.get("layout_version", 1)
        if version not in layout_versions():
            raise ManifestError(f"manifest 'experts.layout_version' {version!r}: this reader knows versions "
                                f"{list(layout_versions())}; upgrade ktconvert")
        try:
            want = cls.to_json(g)
        except LayoutError as e:
            raise ManifestError(f"manifest 'experts' geometry is invalid: {e}") from None
        for key in ("intermediate_pad", "unit", "shard_ranges", "layout", "layout_version"):
            if key in d and d[key] != want[key]:
                raise ManifestError(f"manifest 'experts.{key}' = {d[key]!r} disagrees with the geometry ({want[key]!r})")
        return g

    def expert_tensor_shapes(self, shard: int) -> dict[str, tuple[list[int], str]]:
        """Tensors of one expert file: name -> (shape, dtype)."""
        out = {}
        for proj in PROJECTIONS:
            geom = self.matrix_geometry(proj, shard)
            out[expert_tensor(proj, "qweight")] = ([self.n_experts, *geom.qweight_shape], "U8")
            if self.format.quantized:
                out[expert_tensor(proj, "scales")] = ([self.n_experts, *geom.scales_shape],
                                                      scale_encoding(self.scale_dtype).safetensors_dtype)
        return out


def node_unit_ranges(plan: ShardPlan, n_nodes: int) -> list[list[tuple[int, int, int]]]:
    """Files with plan.n_shards shards served on n_nodes nodes: per node, (shard, unit_begin, unit_end) pieces.

    Units are counted inside the shard (0 = the shard's first unit), so a piece of shard s covers padded
    intermediate rows [i0 + u0 * unit, i0 + u1 * unit) where (i0, _) = plan.shard_range(s). Integer arithmetic
    version of expert_shards.nodes_for_shards; when more nodes share a shard than it has units, some of them get
    no piece (an empty list).
    """
    from .expert_shards import nodes_for_shards
    out = []
    for m, pieces in enumerate(nodes_for_shards(plan.n_shards, n_nodes)):
        node = []
        for s, _f0, _f1 in pieces:
            i0, i1 = plan.shard_range(s)
            n_units = (i1 - i0) // plan.unit
            sharers = [j for j in range(n_nodes) if n_nodes > plan.n_shards and j * plan.n_shards // n_nodes == s]
            if sharers:
                k, c = sharers.index(m), len(sharers)
                u0, u1 = k * n_units // c, (k + 1) * n_units // c
                if u1 > u0:              # more sharers than units: some nodes get no piece of this shard
                    node.append((s, u0, u1))
            else:
                node.append((s, 0, n_units))
        out.append(node)
    return out


REQUIRED_KEYS = ("format_version", "producer", "source", "architecture", "model_type", "method", "group_size",
                 "numa_nodes", "experts", "files")


def validate_manifest(m: dict) -> ExpertGeometry:
    """Check manifest.json against this spec; returns the expert geometry. Raises ManifestError naming the field."""
    if not isinstance(m, dict):
        raise ManifestError("manifest.json must hold a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in m]
    if missing:
        raise ManifestError(f"manifest.json lacks {', '.join(missing)}")
    fv = m["format_version"]
    if not isinstance(fv, int) or fv < 1:
        raise ManifestError(f"manifest 'format_version' must be a positive integer, got {fv!r}")
    if fv > FORMAT_VERSION:
        raise ManifestError(f"manifest format_version {fv} is newer than this reader ({FORMAT_VERSION}); upgrade ktconvert")
    geo = ExpertGeometry.from_json(m["experts"])
    if (m["method"], m["group_size"], m["numa_nodes"]) != (geo.method, geo.group_size, geo.numa_nodes):
        raise ManifestError("manifest method/group_size/numa_nodes disagree with its 'experts' section")
    files = m["files"]
    if not isinstance(files, dict) or not files:
        raise ManifestError("manifest 'files' must be a non-empty object")
    for rel, f in files.items():
        safe_relpath(Path("."), rel)
        for key in ("size", "sha256", "kind"):
            if key not in f:
                raise ManifestError(f"manifest entry for {rel} lacks {key!r}")
        if not re.fullmatch(r"[0-9a-f]{64}", str(f["sha256"])):
            raise ManifestError(f"manifest entry for {rel}: sha256 is not 64 hex digits")
        for name, t in f.get("tensors", {}).items():
            for key in ("layout", "dtype", "shape", "offset", "nbytes"):
                if key not in t:
                    raise ManifestError(f"manifest tensor {name!r} in {rel} lacks {key!r}")
            if t["offset"] % FILE_ALIGN:
                raise ManifestError(f"manifest tensor {name!r} in {rel}: offset {t['offset']} is not {FILE_ALIGN}-aligned")
    mtp_experts = {f.get("layer") for f in files.values() if f["kind"] == MTP_EXPERT_KIND}
    if not mtp_experts <= set(m.get("mtp_layers", ())):
        raise ManifestError(f"manifest lists MTP expert files of layers {sorted(mtp_experts)} but mtp_layers is "
                            f"{m.get('mtp_layers', [])}")
    for layer in [*geo.moe_layers, *sorted(mtp_experts)]:
        for s in range(geo.numa_nodes):
            rel = expert_file(layer, s, geo.numa_nodes)
            if rel not in files:
                raise ManifestError(f"manifest lists MoE layer {layer} but not its expert file {rel}")
            want = geo.expert_tensor_shapes(s)
            got = {n: (t["shape"], t["dtype"]) for n, t in files[rel].get("tensors", {}).items() if not is_pad_tensor(n)}
            if got != want:
                raise ManifestError(f"manifest tensors of {rel} do not match the expert geometry: {got} != {want}")
    return geo


def load_manifest(root: str | Path) -> tuple[dict, ExpertGeometry]:
    """Read and validate root/manifest.json."""
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{root} is not a complete ktconvert output: {MANIFEST_NAME} is missing")
    try:
        m = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    return m, validate_manifest(m)


def parse_file_name(rel: str) -> tuple[str, int | None, int | None]:
    """'experts/layer-0003.shard-1-of-2.safetensors' -> ('expert', 3, 1); dense -> ('dense', L, None)."""
    if (mo := _EXPERT_RE.match(rel)):
        return "expert", int(mo.group(1)), int(mo.group(2))
    if (mo := _DENSE_RE.match(rel)):
        return "dense", int(mo.group(1)), None
    if rel == GLOBALS_FILE:
        return "globals", None, None
    return "other", None, None
