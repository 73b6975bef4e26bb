"""manifest.json of a converted directory (schema: ktlayouts.converted_dir), and the copied config/tokenizer files.

The manifest is deterministic (no timestamps, sorted keys) so an interrupted-and-resumed conversion is byte-identical
to an uninterrupted one, and it is written last: a directory without it is not a complete conversion.
"""
from __future__ import annotations

import json
from pathlib import Path

from ktlayouts import tiktoken_bpe
from ktlayouts.constants import FORMAT_VERSION
from ktlayouts.converted_dir import MANIFEST_NAME, SOURCE_RECORD_NAME, is_pad_tensor, validate_manifest
from ktlayouts.expert_placement import PLACEMENT_KIND
from ktlayouts.files import allowed_roots, resolve_inside, sha256_file

from ktconvert import __version__
from ktconvert.gpu import converted_config_json
from ktconvert.sources.side_files import side_files
from ktconvert.writer import atomic_write_bytes, build_header


def _converted_config(raw: bytes) -> bytes:
    """config.json without quantization_config: the converted weights are no longer FP8 blocks."""
    cfg = json.loads(raw)
    if "quantization_config" in cfg:
        cfg.pop("quantization_config")
        return (json.dumps(cfg, indent=2) + "\n").encode()
    return raw


def _side_file_reader(src) -> dict:
    """{name: () -> bytes} of the source's config and tokenizer files: files beside the shards, or, for sources
    that carry them inside (GGUF metadata), what the source's side_files() builds. A tiktoken tokenizer without
    tokenizer.json (Kimi-K2 / K2.5) also gets the tokenizer.json converted from it (ktlayouts.tiktoken_bpe).
    Files beside the shards were checked when the source opened (ktconvert.sources.side_files: inside the source
    or its hub cache, JSON that parses); they are read through their checked paths."""
    if hasattr(src, "side_files"):
        return {name: (lambda raw=raw: raw) for name, raw in src.side_files().items()}
    root = Path(src.path)
    paths = getattr(src, "side_paths", None)
    if paths is None:
        paths = side_files(root, allowed_roots(root))
    files = {name: p.read_bytes for name, p in paths.items()}
    if "tokenizer.json" not in files and "tiktoken.model" in files:
        files["tokenizer.json"] = lambda: tiktoken_bpe.tokenizer_files(root)["tokenizer.json"]
    return files


def copy_side_files(src, out_dir: Path, journal, encoder=None) -> list[str]:
    """Copy config and tokenizer files (atomically, journaled); returns their names."""
    readers = _side_file_reader(src)
    names = sorted(readers)
    for name in names:
        if journal.is_done(name):
            continue
        raw = readers[name]()
        if name == "config.json":
            raw = _converted_config(raw) if encoder is None else converted_config_json(raw, encoder)
        atomic_write_bytes(out_dir / name, raw)
        journal.record(name, len(raw), sha256_file(out_dir / name))
    return names


def source_record(src_dir: Path) -> dict:
    """repo_id / revision / commit of a pulled source, when its .ktconvert-source.json says so."""
    p = Path(src_dir) / SOURCE_RECORD_NAME
    try:
        rec = json.loads(resolve_inside(p, allowed_roots(src_dir)).read_text()) if p.is_file() else {}
    except (ValueError, UnicodeDecodeError):     # OutsideRootError too: a link out of the source is no record
        rec = {}
    return {k: rec[k] for k in ("repo_id", "revision", "commit") if isinstance(rec, dict) and rec.get(k)}


def _file_entry(job, journal) -> dict:
    _, offsets, size = build_header(job.specs, job.metadata)
    rec = journal.files[job.rel]
    if rec["size"] != size:
        raise RuntimeError(f"{job.rel}: written size {rec['size']} differs from the planned {size}")
    entry = {"kind": job.manifest_kind, "size": rec["size"], "sha256": rec["sha256"]}
    if job.layer is not None:
        entry["layer"] = job.layer
    if job.shard is not None:
        entry["shard"] = job.shard
    entry["tensors"] = {s.name: {"layout": job.layouts[s.name], "dtype": s.dtype, "shape": list(s.shape),
                                 "offset": offsets[s.name], "nbytes": s.nbytes}
                        for s in job.specs if not is_pad_tensor(s.name)}
    return entry


def build_manifest(src, opts, plan, journal, side_files: list[str], placement: str | None = None) -> dict:
    cfg = src.config
    adapter = src.arch
    files = {}
    for group in plan.jobs:
        for job in group:
            files[job.rel] = _file_entry(job, journal)
    for name in side_files:
        files[name] = {"kind": "config", **journal.files[name]}
    if placement is not None:                    # gpu_experts.json (quantize --profile)
        files[placement] = {"kind": PLACEMENT_KIND, **journal.files[placement]}
    return {
        "format_version": FORMAT_VERSION,
        "producer": f"ktconvert {__version__}",
        "source": {"path": str(Path(src.path).resolve()), **source_record(src.path), "nbytes": src.source_nbytes(),
                   "skipped_tensors": len(plan.skipped)},
        "architecture": (cfg.get("architectures") or [adapter.model_type])[0],
        "model_type": adapter.model_type,
        "num_layers": adapter.num_layers,
        "method": opts.method,
        "group_size": opts.group_size,
        "numa_nodes": opts.numa_nodes,
        "gpu_method": opts.gpu_method,
        **({"gpu_method_for": [list(r) for r in opts.gpu_method_for]} if getattr(opts, "gpu_method_for", ()) else {}),
        **({"gpu_mix": {"budget": opts.gpu_mix_budget, "method": opts.gpu_mix_method,
                        "upgraded": list(opts.gpu_mix_chosen)}} if getattr(opts, "gpu_mix_budget", 0) else {}),
        "expert_quantizer": getattr(opts, "expert_quantizer", "rtn"),
        "experts": plan.geometry.to_json(),
        **({"expert_scales": "bf16"} if getattr(opts, "bf16_scales", False) else {}),
        **({"mtp_layers": list(plan.mtp_layers)} if getattr(plan, "mtp_layers", None) else {}),
        "files": dict(sorted(files.items())),
    }


def write_manifest(src, out_dir: Path, opts, plan, journal, side_files: list[str], placement: str | None = None
                   ) -> Path:
    m = build_manifest(src, opts, plan, journal, side_files, placement)
    validate_manifest(m)
    path = Path(out_dir) / MANIFEST_NAME
    atomic_write_bytes(path, (json.dumps(m, indent=1, sort_keys=True) + "\n").encode())
    return path
