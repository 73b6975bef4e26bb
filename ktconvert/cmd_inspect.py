"""`ktconvert inspect`: what a checkpoint (or converted directory) holds and whether it fits a GPU + CPU budget."""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

import click
from ktlayouts.constants import METHOD_TO_LAYOUT
from ktlayouts.converted_dir import MANIFEST_NAME, ExpertGeometry, ManifestError

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
          "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str, flag: str) -> int:
    """'24GB' -> 24e9, '24GiB' -> 24 * 2^30, '512G' -> 512e9, '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text or "")
    if not m or m.group(2).upper() not in _UNITS:
        raise click.BadParameter(f"{text!r} is not a size like 24GB, 24GiB or 512G", param_hint=flag)
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n}"


def expert_bytes_per_method(geo_args: dict, group_size: int) -> dict[str, int]:
    """CPU bytes of all routed experts for each --method (one NUMA shard; more shards add no bytes)."""
    out = {}
    for method in METHOD_TO_LAYOUT:
        geo = ExpertGeometry(method=method, group_size=group_size, numa_nodes=1, **geo_args)
        per_expert = sum(g.qweight_nbytes + g.scales_nbytes
                         for g in (geo.matrix_geometry(p, 0) for p in ("gate", "up", "down")))
        out[method] = per_expert * geo.n_experts * len(geo.moe_layers)
    return out


def inspect_source(path: Path, group_size: int) -> dict:
    from ktconvert.sources import open_source

    with open_source(path) as src:
        a = src.arch
        params: dict[str, int] = defaultdict(int)
        skipped: dict[str, int] = defaultdict(int)
        gpu_bytes = 0
        for name in src.tensor_names():
            role = a.classify(name)
            if role.kind == "skip":
                if role.reason:
                    skipped[role.reason] += math.prod(src.info(name).shape)
                continue
            n = math.prod(src.info(name).shape)
            params[role.kind] += n
            if role.kind != "expert":
                gpu_bytes += n * (4 if role.kind == "router_bias" else 2)
        geo_args = {"n_experts": a.n_experts, "hidden": a.hidden_size, "intermediate": a.moe_intermediate_size,
                        "moe_layers": tuple(a.moe_layers())}
        cpu = expert_bytes_per_method(geo_args, group_size)
        return {"kind": "source", "model_type": a.model_type, "layers": a.num_layers, "params": dict(params),
                "n_experts": a.n_experts, "top_k": a.top_k, "moe_layers": a.moe_layers(),
                "shared_experts": a.n_shared_experts, "gpu": {m: gpu_bytes for m in cpu}, "cpu": cpu,
                "source_bytes": src.source_nbytes(), "skipped": dict(skipped)}


def _converted_adapter(path: Path):
    """The architecture adapter of the config.json a conversion copied (the source's), or None if unreadable."""
    from ktconvert.sources.roles import SourceError, adapter_for

    try:
        return adapter_for(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, SourceError):
        return None


def _role_kind(adapter, name: str) -> str:
    """Role of a converted dense tensor; "non-expert" where the name is not a plain hub tensor (e.g. packed
    GPU-layer tensors) or the config could not be read."""
    from ktconvert.sources.roles import SourceError

    try:
        return adapter.classify(name).kind if adapter is not None else "non-expert"
    except SourceError:
        return "non-expert"


def inspect_converted(path: Path) -> dict:
    from ktconvert.converted_reader import ConvertedDir

    conv = ConvertedDir(path)
    m, geo = conv.manifest, conv.geometry
    adapter = _converted_adapter(Path(path))
    params: dict[str, int] = defaultdict(int)
    cpu = gpu = 0
    for f in m["files"].values():
        if f["kind"] == "expert":
            cpu += f["size"]
        elif f["kind"] in ("dense", "globals"):
            gpu += f["size"]
            for name, t in f["tensors"].items():
                params[_role_kind(adapter, name)] += math.prod(t["shape"])
    params["expert"] = 3 * geo.hidden * geo.intermediate * geo.n_experts * len(geo.moe_layers)
    return {"kind": "converted", "model_type": m["model_type"], "layers": m.get("num_layers"), "params": dict(params),
            "n_experts": geo.n_experts, "top_k": adapter.top_k if adapter else None, "moe_layers": list(geo.moe_layers),
            "shared_experts": adapter.n_shared_experts if adapter else None,
            "gpu": {geo.method: gpu}, "cpu": {geo.method: cpu}, "method": geo.method, "numa_nodes": geo.numa_nodes}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(exists=True))
@click.option("--gpu-mem", default=None, help="GPU memory to check against, e.g. 24GB or 80GiB.")
@click.option("--cpu-mem", default=None, help="CPU memory (RAM) to check against, e.g. 512GB.")
@click.option("--group-size", type=int, default=128, show_default=True, help="Group size for the int4/int8 sizes.")
def inspect(path, gpu_mem, cpu_mem, group_size):
    """Show the architecture, parameter counts by role, experts, and the bytes each --method puts on the GPU
    (non-expert layers, BF16) and on the CPU (routed experts) for PATH (a checkpoint directory, a GGUF file or the
    first part of a split set, or a converted directory),
    and whether they fit --gpu-mem / --cpu-mem (weights only; KV cache and activations come on top).

    \b
    Examples:
      ktconvert inspect ./DeepSeek-V3
      ktconvert inspect ./DeepSeek-V3 --gpu-mem 24GB --cpu-mem 512GB
      ktconvert inspect ./DeepSeek-V3-Q4_K_M-00001-of-00009.gguf --cpu-mem 512GB
      ktconvert inspect converted/ --gpu-mem 24GB --cpu-mem 512GB
    """
    from ktconvert.cmd_quantize import resolve_source_arg
    from ktconvert.sources.roles import SourceError

    gpu_limit = parse_bytes(gpu_mem, "--gpu-mem") if gpu_mem else None
    cpu_limit = parse_bytes(cpu_mem, "--cpu-mem") if cpu_mem else None
    p = Path(path)
    try:
        info = inspect_converted(p) if (p / MANIFEST_NAME).exists() else inspect_source(resolve_source_arg(path),
                                                                                        group_size)
    except (SourceError, ManifestError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{info['kind']}: {p}")
    click.echo(f"architecture: {info['model_type']}, {info['layers']} layers, {len(info['moe_layers'])} MoE layers, "
               f"{info['n_experts']} routed experts" + (f" (top {info['top_k']})" if info["top_k"] else "")
               + (f", {info['shared_experts']} shared" if info["shared_experts"] else ""))
    if info["kind"] == "converted":
        click.echo(f"method: {info['method']}, {info['numa_nodes']} NUMA shard(s)")
    total = sum(info["params"].values())
    click.echo(f"parameters: {total / 1e9:.3f} B total")
    for kind, n in sorted(info["params"].items(), key=lambda kv: -kv[1]):
        click.echo(f"  {kind:<14} {n:>16,d}  ({100 * n / max(total, 1):.1f}%)")
    for reason, n in sorted(info.get("skipped", {}).items()):
        click.echo(f"not converted: {n:,d} parameters of the {reason}")
    verdicts = []
    for method in info["cpu"]:
        g, c = info["gpu"][method], info["cpu"][method]
        line = f"{method:<9} GPU {human(g):>10}  CPU {human(c):>10}"
        fits = []
        if gpu_limit is not None:
            fits.append(f"GPU {'fits' if g <= gpu_limit else 'does NOT fit'} {human(gpu_limit)}")
        if cpu_limit is not None:
            fits.append(f"CPU {'fits' if c <= cpu_limit else 'does NOT fit'} {human(cpu_limit)}")
        verdicts.append(line + ("  -> " + ", ".join(fits) if fits else ""))
    click.echo("bytes (weights):")
    for v in verdicts:
        click.echo("  " + v)
