"""Open a converted directory for ktrun: validate, map experts, place dense (GPU) layers.

- manifest.json is validated by ktlayouts.converted_dir (structure, format version, expert geometry).
- Every listed file must exist with the listed size (a missing or truncated shard fails here, before generation);
  `verify=True` also checks sha256 (reads everything, with a progress bar).
- Expert files are mapped (a read-only mmap of the whole file, advised for huge pages where the files fit in memory;
  tensors as views at their header offsets): nothing is read at start-up, so start-up time does not grow with expert
  bytes. Each tensor's offset in the file header must equal the manifest's.
- Dense tensors (hub names) are read and placed on CUDA when available, else the CPU; GPU-quantized Linears are
  placed by ktrun.dense_placement (`gpu_weights`): on the CPU repacked once for the kernels' quantized Linear op
  (ktrun.ops.kernel_linear, the default), or dequantized at load, or kept packed in the Marlin layout and run by an
  installed Marlin kernel (else dequantized per call).
- Multi-token-prediction layers (manifest `mtp_layers`, files of kind mtp_dense / mtp_expert) are loaded only when
  asked for (`mtp=True`, for --speculative mtp) into ConvertedModel.mtp, the same way as the main layers; otherwise
  only their sizes are checked.
- NUMA: files written for S shards are assigned to this machine's M nodes (ktlayouts nodes_for_shards); with
  `numa_prefault=True` a thread bound to each node's CPUs faults that node's pieces in (page cache lands on the node).
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from ktlayouts import converted_dir
from ktlayouts.converted_dir import (
    DENSE_LAYOUT_BF16,
    DENSE_LAYOUT_F32,
    MTP_DENSE_KIND,
    PROJECTIONS,
    ExpertGeometry,
    ManifestError,
    expert_file,
    expert_tensor,
    is_pad_tensor,
    load_manifest,
    node_unit_ranges,
    safe_relpath,
)
from ktlayouts.expert_shards import unit_piece
from ktlayouts.families import MODEL_TYPE_ALIASES, ModelConfig, get_family, load_config
from ktlayouts.files import OutsideRootError, allowed_roots, resolve_inside, sha256_file
from ktlayouts.gpu_formats import is_gpu_layout

from .dense_placement import PlacementError, place_quantized, use_cpu_kernels
from .ops import float_linear

_NP_DTYPES = {"U8": np.uint8, "F32": np.float32, "BF16": np.uint16, "F16": np.float16, "I32": np.int32,
              "I64": np.int64, "I16": np.int16, "F8_E4M3": np.uint8}


class LoadError(ValueError):
    """A converted directory ktrun cannot serve; the message names the file (and tensor/offset) at fault."""


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(byte offset of the data section, header dict) — reads only the header."""
    try:
        return converted_dir.read_safetensors_header(path)
    except ManifestError as e:
        raise LoadError(str(e)) from None


def numa_nodes() -> list[list[int]]:
    """CPU lists of this machine's NUMA nodes (one node with all CPUs when unknown)."""
    base = Path("/sys/devices/system/node")
    nodes = []
    for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpus = []
        for part in (d / "cpulist").read_text().strip().split(","):
            if part:
                a, _, b = part.partition("-")
                cpus.extend(range(int(a), int(b or a) + 1))
        if cpus:
            nodes.append(cpus)
    return nodes or [sorted(os.sched_getaffinity(0))]


@dataclass
class MtpWeights:
    """The conversion's multi-token-prediction layers (loaded with mtp=True): hub-named dense tensors (enorm, hnorm,
    eh_proj, shared_head.*, the decoder layer's attention, router and shared experts) and the routed experts' maps,
    as ConvertedModel holds the main layers'."""
    layers: list[int]
    dense: dict[str, object]
    experts: dict[int, list[dict]]


@dataclass
class ConvertedModel:
    root: Path
    manifest: dict
    geometry: ExpertGeometry
    config: ModelConfig
    dense: dict[str, object]        # hub name -> tensor, or ktrun.ops.packed_linear.MarlinLinear (packed GPU Linear)
    # layer -> list over shards of {proj: (qweight (E, NB, KT, TB) u8, scales (E, NB, G, 16) f32 | None, geom)}
    experts: dict[int, list[dict]]
    device: torch.device
    dtype: torch.dtype
    numa_plan: list[list[tuple[int, int, int]]] = field(default_factory=list)   # per node: (shard, u0, u1)
    mapped_bytes: int = 0
    prefault_threads: list = field(default_factory=list)   # numa_prefault: join them to wait for the faulting
    gpu_weights: str = ""           # how the GPU-quantized Linears were placed (ktrun.dense_placement)
    # the kernel context (ktrun.ops.moe.MoEKernels) whose pool runs the quantized Linears on the CPU (--gpu-weights
    # kernels); the routed-expert executor runs on the same pool (one set of threads). None: not on the kernels.
    kernels: object = None
    mtp: MtpWeights | None = None   # the MTP layers, when loaded with mtp=True

    def close(self) -> None:
        if self.kernels is not None:
            self.kernels.close()


def _check_inside(root: Path, rels) -> None:
    """Every file ktrun reads resolves (links followed) inside the converted folder: a tokenizer_config.json linked
    to /etc/passwd is refused, naming both (ktlayouts.files.resolve_inside; contents are the manifest's sha256's
    business). A link to the whole folder is fine."""
    roots = allowed_roots(root)
    for rel in rels:
        try:
            resolve_inside(safe_relpath(root, rel), roots)
        except OutsideRootError as e:
            raise LoadError(str(e)) from None


def _check_files(root: Path, manifest: dict, verify: bool, quiet: bool) -> None:
    files = manifest["files"]
    for rel, f in files.items():
        p = safe_relpath(root, rel)
        if not p.is_file():
            raise LoadError(f"{p}: listed in manifest.json but missing")
        size = p.stat().st_size
        if size != f["size"]:
            raise LoadError(f"{p}: {size} bytes on disk, manifest.json says {f['size']} "
                            f"({'truncated' if size < f['size'] else 'grown'}); re-run ktconvert")
    if verify:
        from tqdm import tqdm
        total = sum(f["size"] for f in files.values())
        with tqdm(total=total, unit="B", unit_scale=True, desc="sha256", disable=quiet) as bar:
            for rel, f in files.items():
                if sha256_file(safe_relpath(root, rel), bar) != f["sha256"]:
                    raise LoadError(f"{safe_relpath(root, rel)}: sha256 mismatch (file corrupted); re-run ktconvert")


def _map_file(path: Path, huge_pages: bool) -> np.ndarray:
    """The whole file mapped read-only as uint8. huge_pages: advise transparent huge pages (MADV_HUGEPAGE) for a
    mapping read in place on every decode step (the routed experts): file pages the mapping faults in are then read
    into 2 MiB page-cache folios (Linux 6.x with large folios on the file system, e.g. ext4 from 6.16) and mapped
    as 2 MiB pages, so streaming a layer's experts takes neither a TLB miss nor a hardware-prefetcher stop every
    4 KiB (DeepSeek-V3-shaped decode on a 2-core AMX server: MoE job 22.3 -> 20.2 ms per step). Pages already in the
    page cache as 4 KiB folios (e.g. just written by ktconvert) stay so until evicted. A no-op where unsupported."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:       # THP disabled or not built in: 4 KiB pages, as without the advice
            pass
    return np.frombuffer(m, dtype=np.uint8)


def _map_tensors(path: Path, listed: dict, huge_pages: bool = False) -> dict[str, np.ndarray]:
    """Map a file once; return its listed tensors as array views. Offsets must agree with the file header."""
    data_start, header = read_safetensors_header(path)
    mm = _map_file(path, huge_pages)
    out = {}
    for name, t in listed.items():
        if is_pad_tensor(name):
            continue
        h = header.get(name)
        if h is None:
            raise LoadError(f"{path}: tensor {name!r} listed in manifest.json is not in the file header")
        begin, end = data_start + h["data_offsets"][0], data_start + h["data_offsets"][1]
        if begin != t["offset"] or end - begin != t["nbytes"] or list(h["shape"]) != list(t["shape"]):
            raise LoadError(f"{path}: tensor {name!r} at offset {begin} ({end - begin} bytes, shape {h['shape']}) "
                            f"disagrees with manifest.json (offset {t['offset']}, {t['nbytes']} bytes)")
        if end > mm.shape[0]:
            raise LoadError(f"{path}: tensor {name!r} ends at byte {end}, past the end of the file ({mm.shape[0]})")
        out[name] = mm[begin:end].view(_NP_DTYPES[t["dtype"]]).reshape(t["shape"])
    return out


def memory_limit_bytes() -> int:
    """Memory this process may fill, page cache included: physical RAM, or less where its memory cgroup sets a limit
    (v2 `memory.max`, v1 `memory.limit_in_bytes`)."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return limit
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            f = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max"
        elif "memory" in controllers.split(","):
            f = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes"
        else:
            continue
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def _map_experts(root: Path, manifest: dict, geo: ExpertGeometry, moe_layers=None
                 ) -> tuple[dict[int, list[dict]], int]:
    """moe_layers: the layers whose expert files to map (default: the main model's, geo.moe_layers)."""
    # Huge pages only for expert files that fit in memory: where they do not, the page cache evicts and re-reads
    # them, and each fault on a huge-page mapping then reads 2 MiB instead of 4 KiB (plain mmap at 2x the memory
    # cgroup's cap read 324-500 MB per token with the advice against 110-130 MB without it: bench_expert_tier.py).
    moe_layers = geo.moe_layers if moe_layers is None else moe_layers
    files = {expert_file(layer, s, geo.numa_nodes) for layer in moe_layers for s in range(geo.numa_nodes)}
    huge_pages = sum(int(manifest["files"][rel]["size"]) for rel in files) <= memory_limit_bytes()
    layers, nbytes = {}, 0
    for layer in moe_layers:
        shards = []
        for s in range(geo.numa_nodes):
            rel = expert_file(layer, s, geo.numa_nodes)
            arrays = _map_tensors(safe_relpath(root, rel), manifest["files"][rel]["tensors"], huge_pages)
            shard = {}
            for p in PROJECTIONS:
                qw = arrays[expert_tensor(p, "qweight")]
                sc = arrays.get(expert_tensor(p, "scales"))
                shard[p] = (qw, sc, geo.matrix_geometry(p, s))
                nbytes += qw.nbytes + (0 if sc is None else sc.nbytes)
            shards.append(shard)
        layers[layer] = shards
    return layers, nbytes


def _to_torch(name: str, a: np.ndarray, dtype_name: str) -> torch.Tensor:
    if dtype_name == "BF16":
        return torch.from_numpy(np.array(a).view(np.int16)).view(torch.bfloat16)     # copy: dense is read now
    if dtype_name in ("F32", "F16"):
        return torch.from_numpy(np.array(a))
    raise LoadError(f"dense tensor {name!r}: dtype {dtype_name} is not a float layout")


def _return_freed_heap() -> None:
    """Give the heap the repack's temporaries left free back to the OS (glibc's malloc_trim): what stays counts
    against the RSS bound of a CPU run (converted directory + KV + 300 MB). A no-op without glibc."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_dense(root: Path, manifest: dict, device, dtype, gpu_weights: str, linear_kernels=None,
                keep_stored: tuple[str, ...] = (), kinds: tuple[str, ...] = ("dense", "globals"),
                routers_stored: bool = False) -> tuple[dict, str]:
    """keep_stored: tensors kept in their stored float dtype (an untied embedding table: only rows are read, and
    the forward widens those; a float32 copy of V3's 129280 x 7168 table would add 1.85 GB to the RSS).
    kinds: the manifest file kinds to read (the MTP layers': (MTP_DENSE_KIND,)).
    routers_stored: router weights (`*.gate.weight`) stored as bfloat16 stay so (the CPU kernels' routers widen them
    exactly in their dot products: the logits of the float32 copy from half the bytes a decode step reads; torch's
    router paths widen them per call); else they are widened to float32, as the reference keeps them."""
    dense, quantized = {}, {}
    for rel, f in manifest["files"].items():
        if f["kind"] not in kinds:
            continue
        arrays = _map_tensors(safe_relpath(root, rel), f.get("tensors", {}))
        for name, a in arrays.items():
            lay = f["tensors"][name]["layout"]
            if lay in (DENSE_LAYOUT_BF16, DENSE_LAYOUT_F32):
                t = _to_torch(name, a, f["tensors"][name]["dtype"])
                # router weights, score biases and DeepSeek-V3.2's indexer head weights stay float32, as the
                # reference keeps them (bf16 routers the CPU kernels compute: as stored, routers_stored)
                keep32 = name.endswith(("e_score_correction_bias", ".gate.weight", "indexer.weights_proj.weight"))
                stored = name in keep_stored or (routers_stored and t.dtype == torch.bfloat16
                                                 and name.endswith(".gate.weight"))
                dense[name] = t.to(device=device, dtype=t.dtype if stored else torch.float32 if keep32 else dtype)
            else:
                quantized.setdefault(str(safe_relpath(root, rel)), {})[name] = (a, f["tensors"][name])
    try:
        placed, how = place_quantized(quantized, device, dtype, gpu_weights, linear_kernels)
    except PlacementError as e:
        raise LoadError(str(e)) from None
    dense.update(placed)
    return dense, how


def piece_arrays(shard: dict, u0: int, u1: int, unit: int) -> list[np.ndarray]:
    """Views of the bytes a node needs for units [u0, u1) of one shard (ktlayouts.expert_shards.unit_piece on the
    stacked (E, ...) tensors): gate/up column blocks, down K tiles and scale groups."""
    out = []
    for proj, (qw, sc, geom) in shard.items():
        q, s, _ = unit_piece(qw, sc, proj, geom, unit, u0, u1, stacked=True)
        out += [q] if s is None else [q, s]
    return out


def prefault_numa(model: ConvertedModel, nodes: list[list[int]]) -> list[threading.Thread]:
    """Fault each node's expert pieces in from a thread bound to that node's CPUs (first touch places the pages)."""
    plan, unit = model.numa_plan, model.geometry.shard_plan.unit
    page = os.sysconf("SC_PAGE_SIZE")

    def touch(node: int):
        os.sched_setaffinity(0, nodes[node])            # this thread only
        for s, u0, u1 in plan[node]:
            for shards in model.experts.values():
                for a in piece_arrays(shards[s], u0, u1, unit):
                    b = a.view(np.uint8) if a.dtype == np.uint8 else a
                    step = max(1, page // b.itemsize // max(1, b.shape[-1]))
                    int(b.reshape(-1, b.shape[-1])[::step, 0].sum())   # about one element per page

    threads = [threading.Thread(target=touch, args=(m,), daemon=True) for m in range(len(plan))]
    for t in threads:
        t.start()
    return threads


def _config_for(root: Path, manifest: dict, geo: ExpertGeometry) -> ModelConfig:
    """config.json's ModelConfig, with the MoE layers the converter wrote into manifest.json (experts.moe_layers):
    the manifest says which layers the files hold experts for. What config.json and the manifest both record
    (family, layer count, expert count and sizes) must agree."""
    cfg = load_config(root / "config.json")
    arch = (cfg.raw.get("architectures") or [None])[0]
    if arch and manifest.get("architecture") and arch != manifest["architecture"]:
        raise LoadError(f"{root}: config.json architecture {arch} != manifest.json architecture "
                        f"{manifest['architecture']}")
    if MODEL_TYPE_ALIASES.get(manifest["model_type"], manifest["model_type"]) != cfg.model_type:
        raise LoadError(f"{root}: config.json is model_type {cfg.model_type}, manifest.json model_type is "
                        f"{manifest['model_type']}")
    agree = [("num_layers", manifest.get("num_layers", cfg.num_layers), cfg.num_layers, "num_hidden_layers"),
             ("experts.n_experts", geo.n_experts, cfg.num_experts, "routed experts"),
             ("experts.hidden", geo.hidden, cfg.hidden_size, "hidden_size"),
             ("experts.intermediate", geo.intermediate, cfg.moe_intermediate_size, "expert intermediate size")]
    for key, theirs, ours, what in agree:
        if theirs != ours:
            raise LoadError(f"{root}: manifest.json {key}={theirs} but config.json says {what}={ours}")
    outside = [layer for layer in geo.moe_layers if not 0 <= layer < cfg.num_layers]
    if outside:
        raise LoadError(f"{root}: manifest.json experts.moe_layers lists layer {outside[0]}, but config.json has "
                        f"{cfg.num_layers} layers")
    return dataclasses.replace(cfg, moe_layers=tuple(geo.moe_layers))


def _check_routers(root: Path, cfg: ModelConfig, dense: dict) -> None:
    """Every MoE layer of the manifest has its router among the dense tensors (else the forward would fail later)."""
    names = get_family(cfg.model_type).names
    prefixes = dict.fromkeys((names.moe_prefix, "mlp.", "block_sparse_moe."))
    for layer in cfg.moe_layers:
        candidates = [f"{names.layer(layer)}{p}{names.router}.weight" for p in prefixes]
        if not any(c in dense for c in candidates):
            raise LoadError(f"{root}: manifest.json lists MoE layer {layer}, but no dense file holds its router "
                            f"{candidates[0]}")


def _check_mtp(root: Path, manifest: dict) -> list[int]:
    """The conversion's MTP layers; LoadError naming the directory and the flag when it has none."""
    layers = list(manifest.get("mtp_layers", ()))
    if not layers:
        raise LoadError(f"{root}: --speculative mtp drafts with the checkpoint's multi-token-prediction (MTP) layers, "
                        f"and this conversion has none (manifest.json lists no mtp_layers: the family ships none, "
                        f"or it was converted with `ktconvert quantize --no-keep-mtp`); use --speculative ngram, or "
                        f"convert the checkpoint again without --no-keep-mtp")
    return layers


def load_converted(model_dir: str | Path, device=None, dtype=None, verify: bool = False, quiet: bool = True,
                   numa_prefault: bool = False, gpu_weights: str = "auto", mtp: bool = False) -> ConvertedModel:
    """mtp: also load the multi-token-prediction layers (ConvertedModel.mtp; LoadError when there are none)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise LoadError(f"{root}: not a directory")
    _check_inside(root, [converted_dir.MANIFEST_NAME])
    try:
        manifest, geo = load_manifest(root)
    except ManifestError as e:
        raise LoadError(f"{root}: {e}") from None
    _check_inside(root, manifest["files"])
    cfg = _config_for(root, manifest, geo)
    mtp_layers = _check_mtp(root, manifest) if mtp else []
    _check_files(root, manifest, verify, quiet)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    experts, nbytes = _map_experts(root, manifest, geo)
    try:
        on_kernels = use_cpu_kernels(gpu_weights, device)
    except PlacementError as e:
        raise LoadError(str(e)) from None
    kernels = lin = None
    dense_kinds = ("dense", "globals", *((MTP_DENSE_KIND,) if mtp else ()))
    if on_kernels and any(is_gpu_layout(t["layout"]) for f in manifest["files"].values()
                          if f["kind"] in dense_kinds for t in f.get("tensors", {}).values()):
        from .ops.linear import LinearKernels
        from .ops.moe import MoEKernels
        kernels = MoEKernels()
        lin = LinearKernels(kernels)
    try:
        names = get_family(cfg.model_type).names
        cpu = device.type == "cpu"
        # on the CPU the output head stays as stored (bf16: half a float32 copy's bytes, read every step) when the
        # kernels compute it (ktrun.ops.float_linear); then a tied embedding table, which is the head, does too
        head_stored = cpu and float_linear.available() and cfg.hidden_size % 16 == 0
        keep = (names.embed,) if cpu and (head_stored or not cfg.tie_word_embeddings) else ()
        keep += (names.head,) if head_stored else ()
        # routers as stored (bf16) where the kernels compute them (kt_route_*; ABI 25): Qwen3-30B-A3B's 128 x 2048
        # gate is 0.5 MB of a ~33 MB decode step per layer instead of 1 MB, DeepSeek-V3's 3.7 MB instead of 7.3
        routers_stored = cpu and float_linear.available()
        dense, how = _load_dense(root, manifest, device, dtype, gpu_weights, lin, keep,
                                 routers_stored=routers_stored)
        mtp_weights = None
        if mtp_layers:
            mtp_keep = tuple(names.layer(li) + n for li in mtp_layers for n, k in
                             (("embed_tokens.weight", keep), ("shared_head.head.weight", head_stored)) if k)
            mtp_dense, _ = _load_dense(root, manifest, device, dtype, gpu_weights, lin, mtp_keep, (MTP_DENSE_KIND,),
                                       routers_stored=routers_stored)
            moe = [li for li in mtp_layers if expert_file(li, 0, geo.numa_nodes) in manifest["files"]]
            mtp_weights = MtpWeights(mtp_layers, mtp_dense, _map_experts(root, manifest, geo, moe)[0])
        if lin is not None:
            _return_freed_heap()
        _check_routers(root, cfg, dense)
    except BaseException:
        if kernels is not None:
            kernels.close()
        raise
    nodes = numa_nodes()
    model = ConvertedModel(root, manifest, geo, cfg, dense, experts, device, dtype,
                           numa_plan=node_unit_ranges(geo.shard_plan, len(nodes)), mapped_bytes=nbytes,
                           gpu_weights=how, kernels=kernels, mtp=mtp_weights)
    if numa_prefault:
        model.prefault_threads = prefault_numa(model, nodes)
    return model
