"""`ktconvert inspect`: what a checkpoint (or converted directory) holds and whether it fits a GPU + CPU budget."""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import click
from ktlayouts.constants import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_SCALE_DTYPE,
    FILE_ALIGN,
    METHOD_TO_LAYOUT,
    SCALE_DTYPES,
    default_group_size,
)
from ktlayouts.converted_dir import MANIFEST_NAME, MTP_DENSE_KIND, MTP_EXPERT_KIND, ExpertGeometry
from ktlayouts.expert_formats import UNDECLARED_SCALE_DTYPE, expert_formats, scale_encoding, scale_encodings
from ktrun.byte_sizes import human, parse_bytes
from ktrun.defaults import KV_BUDGET_TOKENS

from ktconvert.gpu.options import gpu_click_options


def expert_bytes_per_method(geo_args: dict, group_size: int, scale_dtype: str = UNDECLARED_SCALE_DTYPE
                            ) -> dict[str, int]:
    """CPU bytes of all routed experts for each --method (one NUMA shard; more shards add no bytes), with scales of
    `scale_dtype` (the CLI passes quantize's default) where the method's layout stores it (two-level sub6: int4 only;
    int8 then shows the default 16-bit scales)."""
    out = {}
    enc = scale_encoding(scale_dtype)
    for fmt in expert_formats():
        sd = scale_dtype if not fmt.quantized or fmt.bits in enc.weight_bits() else DEFAULT_SCALE_DTYPE
        geo = ExpertGeometry(method=fmt.method, group_size=group_size, numa_nodes=1, scale_dtype=sd, **geo_args)
        per_expert = sum(g.qweight_nbytes + g.scales_nbytes
                         for g in (geo.matrix_geometry(p, 0) for p in ("gate", "up", "down")))
        out[fmt.method] = per_expert * geo.n_experts * len(geo.moe_layers)
    return out


def gpu_layer_bytes(src, gpu: dict | None = None) -> dict:
    """The GPU files (dense layers and globals) a conversion of `src` with the GPU options `gpu` (ConvertOptions'
    gpu_* fields; None or a missing one: ConvertOptions' default) writes, sized from its own plan, headers included:
    {"method": the GPU method it resolves to, "gpu": bytes, "mtp": the MTP layers' bytes, "mix": None, or
    {"budget", "method", "bound"} where the measured upgrades (--gpu-mix-budget) will run: bound = the most bytes
    they can add, which no plan shows (they are chosen by measurement during the conversion)."""
    from ktconvert.convert_plan import make_plan
    from ktconvert.gpu import GPU_OPTION_FIELDS, dense_encoder_for
    from ktconvert.pipeline import ConvertOptions
    from ktconvert.writer import build_header

    defaults = ConvertOptions()
    encoder = dense_encoder_for(src, **{k: getattr(defaults, k) for k in GPU_OPTION_FIELDS} | (gpu or {}))
    # the experts' method does not change the GPU files (bf16: no group size to check)
    plan = make_plan(src, src.arch, "bf16", DEFAULT_GROUP_SIZE, 1, encoder, keep_mtp=True)
    jobs = [j for g in plan.jobs for j in g if j.kind != "expert"]
    size = {j.rel: build_header(j.specs, j.metadata)[2] for j in jobs}
    out = {"method": encoder.name, "gpu": sum(size[j.rel] for j in jobs if not j.mtp),
           "mtp": sum(size[j.rel] for j in jobs if j.mtp), "mix": None}
    if hasattr(encoder, "measures_mix") and encoder.measures_mix():
        from ktconvert.gpu.sensitivity import added_bytes_bound

        o = encoder.opts
        upgradable = set(encoder.upgrade_candidates(encoder.method_algo(o.mix_method)[1]))
        # a header grows too: int4 -> int8 at most doubles each number in it (shapes, offsets), one more digit for
        # each of the <= 8 numbers of a tensor's entry and its alignment pad's; the header is padded to FILE_ALIGN
        headers = sum(-(-8 * len(j.specs) // FILE_ALIGN) * FILE_ALIGN for j in jobs
                      if any(name in upgradable for name, _role in j.sources))
        out["mix"] = {"budget": o.mix_budget, "method": o.mix_method,
                      "bound": added_bytes_bound(encoder, o.mix_budget, o.mix_method) + headers}
    return out


def inspect_source(path: Path, group_size: int, scale_dtype: str = UNDECLARED_SCALE_DTYPE, gpu: dict | None = None
                   ) -> dict:
    """What the checkpoint at `path` holds; its GPU bytes are those of a conversion with the GPU options `gpu`
    (gpu_layer_bytes)."""
    from ktconvert.exact_paths import choose_method, quant_format
    from ktconvert.sources import open_source

    with open_source(path) as src:
        a = src.arch
        params: dict[str, int] = defaultdict(int)
        skipped: dict[str, int] = defaultdict(int)     # skip reason -> parameters (vision tower, MTP layers)
        formats: dict[str, list[int]] = {}      # stored format -> [tensors, bytes] (quantized: all their parts)
        mtp = {"params": 0, "moe_layers": set()}   # MTP layers: written unless --no-keep-mtp
        keep_mtp = bool(a.mtp_layers(src.tensor_names()))
        for name in src.tensor_names():
            role = a.classify(name, keep_mtp=keep_mtp)
            if role.mtp:
                n = math.prod(src.info(name).shape)
                mtp["params"] += n
                if role.kind == "expert":
                    mtp["moe_layers"].add(role.layer)
                continue
            if role.kind == "skip":
                if role.reason:
                    skipped[role.reason] += math.prod(src.info(name).shape)
                continue
            info = src.info(name)
            fmt = quant_format(src, name)
            entry = formats.setdefault(fmt.label if fmt is not None else str(info.dtype), [0, 0])
            entry[0] += 1
            entry[1] += info.nbytes
            n = math.prod(info.shape)
            params[role.kind] += n
        geo_args = {"n_experts": a.n_experts, "hidden": a.hidden_size, "intermediate": a.moe_intermediate_size,
                        "moe_layers": tuple(a.moe_layers())}
        cpu = expert_bytes_per_method(geo_args, group_size, scale_dtype)
        mtp_cpu = expert_bytes_per_method({**geo_args, "moe_layers": tuple(sorted(mtp["moe_layers"]))}, group_size,
                                          scale_dtype)
        method, group, why = choose_method(src)
        gpu_layers = gpu_layer_bytes(src, gpu)
        return {"kind": "source", "model_type": a.model_type, "layers": a.num_layers, "params": dict(params),
                "formats": formats, "auto": {"method": method, "group_size": group, "why": why},
                "quantized": getattr(src, "quant", None) is not None,   # a hub checkpoint with a quantization_config
                "geo_args": geo_args, "group_size": group_size, "config": dict(src.config),
                "n_experts": a.n_experts, "top_k": a.top_k, "moe_layers": a.moe_layers(),
                "shared_experts": a.n_shared_experts, "gpu": {m: gpu_layers["gpu"] for m in cpu}, "cpu": cpu,
                "gpu_layers": {"method": gpu_layers["method"], "mix": gpu_layers["mix"]},
                "zero_experts": a.cfg.zero_experts,      # LongCat-Flash's identity experts (no tensors)
                "source_bytes": src.source_nbytes(), "skipped": dict(skipped),
                "mtp": {"layers": a.mtp_layers(src.tensor_names()), "params": mtp["params"],
                        "gpu": {m: gpu_layers["mtp"] for m in cpu}, "cpu": mtp_cpu}}


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
    cpu = gpu = mtp_cpu = mtp_gpu = 0
    for f in m["files"].values():
        mtp_cpu += f["size"] if f["kind"] == MTP_EXPERT_KIND else 0
        mtp_gpu += f["size"] if f["kind"] == MTP_DENSE_KIND else 0
        if f["kind"] == "expert":
            cpu += f["size"]
        elif f["kind"] in ("dense", "globals"):
            gpu += f["size"]
            for name, t in f["tensors"].items():
                params[_role_kind(adapter, name)] += math.prod(t["shape"])
    params["expert"] = 3 * geo.hidden * geo.intermediate * geo.n_experts * len(geo.moe_layers)
    geo_args = {"n_experts": geo.n_experts, "hidden": geo.hidden, "intermediate": geo.intermediate,
                "moe_layers": tuple(geo.moe_layers)}
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    return {"kind": "converted", "model_type": m["model_type"], "layers": m.get("num_layers"), "params": dict(params),
            "geo_args": geo_args, "group_size": geo.group_size, "config": config, "numa": geo.numa_nodes,
            "n_experts": geo.n_experts, "top_k": adapter.top_k if adapter else None, "moe_layers": list(geo.moe_layers),
            "shared_experts": adapter.n_shared_experts if adapter else None,
            "zero_experts": adapter.cfg.zero_experts if adapter else 0,
            "gpu": {geo.method: gpu}, "cpu": {geo.method: cpu}, "method": geo.method, "numa_nodes": geo.numa_nodes,
            "gpu_layers": {"method": m.get("gpu_method"), "mix": m.get("gpu_mix")},   # mix: what was upgraded
            "mtp": {"layers": m.get("mtp_layers", []), "gpu": {geo.method: mtp_gpu}, "cpu": {geo.method: mtp_cpu}}}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(exists=True))
@click.option("--gpu-mem", default=None, help="GPU memory to check against, e.g. 24GB or 80GiB.")
@click.option("--cpu-mem", default=None, help="CPU memory (RAM) to check against, e.g. 512GB.")
@click.option("--group-size", type=int, default=None,
              help=f"Group size for the int4/int8 sizes (default: what `ktconvert quantize` writes, {DEFAULT_GROUP_SIZE}, "
                   + ", ".join(f"or {r.fixed_group} with --scale-dtype {r.name}" for r in scale_encodings()
                               if r.fixed_group) + ").")
@click.option("--scale-dtype", type=click.Choice(list(SCALE_DTYPES)), default=DEFAULT_SCALE_DTYPE,
              show_default=True, help="Expert scale dtype for the int4/int8 sizes (sub6: two-level, int4 only).")
@click.option("--kv-mem", default=None, metavar="SIZE",
              help=f"KV-cache budget the hot-expert plan leaves free (default: {KV_BUDGET_TOKENS} tokens of one sequence).")
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Expert activation profile (ktconvert profile): print its summary and, with --gpu-mem, the hit "
                   "ratio each placement strategy gets on it.")
@click.option("--method", type=click.Choice([*METHOD_TO_LAYOUT, "auto"]), default=None,
              help="Also estimate how long `ktconvert quantize --method METHOD` (with the options below) takes on "
                   "this machine, from a short timed sample of the checkpoint (a checkpoint PATH only).")
@click.option("--expert-quantizer", type=click.Choice(["auto", "gptq", "search", "rtn"]), default="auto",
              show_default=True, help="As for quantize (with --method).")
@click.option("--workers", type=click.IntRange(1), default=2, show_default=True,
              help="As for quantize (with --method).")
@gpu_click_options
def inspect(path, gpu_mem, cpu_mem, group_size, scale_dtype, kv_mem, profile_path, method, expert_quantizer, workers,
            **gpu):
    """Show the architecture, parameter counts by role, experts, and the bytes each --method puts on the GPU
    (non-expert layers, as quantize writes them with the GPU options below) and on the CPU (routed experts) for PATH
    (a checkpoint directory, a GGUF file or the first part of a split set, or a converted directory),
    and whether they fit --gpu-mem / --cpu-mem (weights only; KV cache and activations come on top).

    \b
    Examples:
      ktconvert inspect ./DeepSeek-V3
      ktconvert inspect ./DeepSeek-V3 --gpu-mem 24GB --cpu-mem 512GB
      ktconvert inspect ./DeepSeek-V3 --gpu-mem 24GB --gpu-mix-budget 0   # GPU bytes without the int8 upgrades
      ktconvert inspect ./DeepSeek-V3 --scale-dtype sub6      # int4 bytes with two-level scales
      ktconvert inspect ./DeepSeek-V3-Q4_K_M-00001-of-00009.gguf --cpu-mem 512GB
      ktconvert inspect converted/ --gpu-mem 24GB --cpu-mem 512GB
      ktconvert inspect converted/ --gpu-mem 24GB --kv-mem 4GB --profile profile.json   # hot experts that fit
      ktconvert inspect ./DeepSeek-V3 --method int4-amx --gpu-method rtn-int4     # and how long quantize takes

    With --gpu-mem, the memory plan also says how many routed experts fit on the GPU next to the dense layers, the
    KV budget and a 5% reserve, held as Marlin int codes or bf16 (ktrun --gpu-mem uses the same plan).

    Which GPU Linears the measured int8 upgrades (--gpu-mix-budget) pick is known only once the conversion measures
    them: for a checkpoint, GPU is the bytes without them, and the line below the table the most they can add
    (the fit checks count it); a converted directory lists the Linears it upgraded.
    """
    from ktconvert.cmd_quantize import CONVERT_ERRORS, resolve_source_arg
    from ktconvert.gpu import gpu_errors

    if group_size is None:
        group_size = default_group_size(scale_dtype)
    gpu_limit = parse_bytes(gpu_mem, "--gpu-mem") if gpu_mem else None
    cpu_limit = parse_bytes(cpu_mem, "--cpu-mem") if cpu_mem else None
    p = Path(path)
    try:
        info = inspect_converted(p) if (p / MANIFEST_NAME).exists() else inspect_source(resolve_source_arg(path),
                                                                                        group_size, scale_dtype, gpu)
    except (*CONVERT_ERRORS, *gpu_errors()) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{info['kind']}: {p}")
    click.echo(f"architecture: {info['model_type']}, {info['layers']} layers, {len(info['moe_layers'])} MoE layers, "
               f"{info['n_experts']} routed experts" + (f" (top {info['top_k']})" if info["top_k"] else "")
               + (f", {info['shared_experts']} shared" if info["shared_experts"] else "")
               + (f", {info['zero_experts']} zero (identity) experts" if info.get("zero_experts") else ""))
    if info["kind"] == "converted":
        click.echo(f"method: {info['method']}, {info['numa_nodes']} NUMA shard(s)")
    elif info["quantized"]:
        click.echo("stored as:")
        for label, (count, nbytes) in sorted(info["formats"].items(), key=lambda kv: -kv[1][1]):
            click.echo(f"  {label:<34} {count:>7,d} tensors  {human(nbytes):>10}")
        auto = info["auto"]
        click.echo(f"--method auto: {auto['method']} --group-size {auto['group_size']} ({auto['why']})")
    total = sum(info["params"].values())
    click.echo(f"parameters: {total / 1e9:.3f} B total")
    for kind, n in sorted(info["params"].items(), key=lambda kv: -kv[1]):
        click.echo(f"  {kind:<14} {n:>16,d}  ({100 * n / max(total, 1):.1f}%)")
    for reason, n in sorted(info.get("skipped", {}).items()):
        click.echo(f"not converted: {n:,d} parameters of the {reason}")
    click.echo(gpu_layers_line(info))
    verdicts = []
    for m in info["cpu"]:
        g, c = info["gpu"][m], info["cpu"][m]
        line = f"{m:<9} GPU {human(g):>10}  CPU {human(c):>10}"
        fits = []
        if gpu_limit is not None:       # with what the measured upgrades may add
            fits.append(f"GPU {'fits' if g + mix_bound(info) <= gpu_limit else 'does NOT fit'} {human(gpu_limit)}")
        if cpu_limit is not None:
            fits.append(f"CPU {'fits' if c <= cpu_limit else 'does NOT fit'} {human(cpu_limit)}")
        verdicts.append(line + ("  -> " + ", ".join(fits) if fits else ""))
    click.echo("bytes (weights):")
    for v in verdicts:
        click.echo("  " + v)
    mix = info["gpu_layers"]["mix"]
    if info["kind"] == "source" and mix:
        click.echo(f"  GPU: up to +{human(mix['bound'])} for the measured int8 upgrades, --gpu-mix-budget "
                   f"{mix['budget']:g} (which Linears: measured during the conversion; the fit checks count it)")
    for line in mtp_lines(info):
        click.echo(line)
    prof = None
    if profile_path:
        from ktlayouts.expert_profile import ExpertProfile, ProfileError, summary_lines
        try:
            prof = ExpertProfile.load(profile_path)
            prof.check_model(info["model_type"], info["n_experts"], tuple(info["moe_layers"]), what=profile_path)
        except ProfileError as e:
            raise click.ClickException(str(e)) from None
        for line in summary_lines(prof):
            click.echo(line)
    if gpu_limit is not None:
        for line in hot_expert_plan(info, gpu_limit, parse_bytes(kv_mem, "--kv-mem") if kv_mem else None, prof):
            click.echo(line)
    if method is not None:
        if info["kind"] != "source":
            raise click.ClickException("--method estimates a conversion of a checkpoint; PATH is a converted "
                                       "directory")
        click.echo(estimate_line(resolve_source_arg(path), method, group_size, scale_dtype, expert_quantizer,
                                 workers, gpu))


def estimate_line(src_path, method: str, group_size: int, scale_dtype: str, expert_quantizer: str, workers: int,
                  gpu: dict) -> str:
    """`ktconvert quantize`'s estimated wall time with these options (ktconvert.estimate), as one line."""
    import logging

    from ktconvert.cmd_quantize import CONVERT_ERRORS
    from ktconvert.estimate import estimate_conversion
    from ktconvert.gpu import gpu_errors
    from ktconvert.pipeline import ConvertOptions, conversion_parts
    from ktconvert.sources import open_source

    logging.getLogger("ktconvert").setLevel(logging.WARNING)     # the encoder's choices are quantize's to log
    try:
        opts = ConvertOptions(method=method, group_size=group_size, scale_dtype=scale_dtype, workers=workers,
                              expert_quantizer=expert_quantizer, **gpu)
        with open_source(src_path) as src:
            opts, encoder, quantizer, plan = conversion_parts(src, opts, measure=False)
            return estimate_conversion(src, opts, plan, encoder, quantizer).line()
    except (*CONVERT_ERRORS, *gpu_errors()) as e:
        raise click.ClickException(str(e)) from None


def mix_bound(info: dict) -> int:
    """The most GPU bytes the measured upgrades may add to a source's conversion (0: none, or a converted
    directory, whose bytes are real)."""
    mix = info["gpu_layers"]["mix"]
    return mix["bound"] if info["kind"] == "source" and mix else 0


def gpu_layers_line(info: dict) -> str:
    """The GPU layers' method; of a converted directory also the Linears the measured rule upgraded (its
    manifest's gpu_mix record)."""
    gl, mix = info["gpu_layers"], info["gpu_layers"]["mix"]
    line = f"GPU layers: {gl['method'] or 'not recorded'}"
    if info["kind"] == "converted" and mix:
        names = [n.removesuffix(".weight") for n in mix["upgraded"]]
        line += (f"; measured upgrades to {mix['method']} (--gpu-mix-budget {mix['budget']:g}): "
                 + (", ".join(names) or "none"))
    return line


def mtp_lines(info: dict) -> list[str]:
    """The multi-token-prediction layers' bytes (not in the totals above: ktrun loads them only for
    --speculative mtp)."""
    mtp = info.get("mtp") or {}
    if not mtp.get("layers"):
        return []
    what = ("written" if info["kind"] == "converted" else "written unless --no-keep-mtp") + \
        ", loaded by ktrun --speculative mtp only"
    lines = [f"MTP layer(s) {mtp['layers']} ({what})"
             + (f": {mtp['params']:,d} parameters" if "params" in mtp else "") + ":"]
    lines += [f"  {m:<9} GPU {human(mtp['gpu'][m]):>10}  CPU {human(mtp['cpu'][m]):>10}" for m in mtp["cpu"]]
    return lines


def hot_expert_plan(info: dict, gpu_mem: int, kv_mem: int | None, prof) -> list[str]:
    """Lines: per --method and hot-expert format, how many routed experts fit on the GPU after the dense bytes, the
    KV budget and the reserve (ktlayouts.expert_placement.fit_hot_experts); with a profile, the hit ratio each
    strategy's placement gets on the profile's own text (in-sample: rank and count on the same tokens)."""
    from ktlayouts.expert_gpu import HOT_FORMATS, hot_expert_nbytes, hot_format_ok
    from ktlayouts.expert_placement import STRATEGIES, fit_hot_experts
    from ktlayouts.families import parse_config

    if info.get("config") is None:
        return ["hot experts: config.json unreadable, no KV budget"]
    biases = parse_config(info["config"]).expert_activation.bias      # gpt-oss: float32 biases beside each expert
    if kv_mem is None:
        import torch
        from ktrun.cache_budget import kv_bytes_per_token
        kv_mem = KV_BUDGET_TOKENS * kv_bytes_per_token(parse_config(info["config"]), torch.bfloat16)
        kv_what = f"{human(kv_mem)} ({KV_BUDGET_TOKENS} tokens)"
    else:
        kv_what = human(kv_mem)
    n_layers, E = len(info["moe_layers"]), info["n_experts"]
    upgrades = " and their measured upgrades' bound" if mix_bound(info) else ""
    lines = [f"hot experts on a {human(gpu_mem)} GPU (after the dense layers{upgrades}, KV {kv_what}, 5% reserve):"]
    for method in info["cpu"]:
        geo = ExpertGeometry(method=method, group_size=info["group_size"], numa_nodes=info.get("numa", 1),
                             **info["geo_args"])
        for fmt in HOT_FORMATS:
            if hot_format_ok(geo, fmt):
                continue
            n, plan = fit_hot_experts(gpu_mem, info["gpu"][method] + mix_bound(info), kv_mem,
                                      hot_expert_nbytes(geo, fmt, biases))
            n = min(n, E * n_layers)
            line = (f"  {method:<9} {fmt:<6} {human(plan['per_expert_bytes'])} each: {n} of {E * n_layers} experts "
                    f"({100 * n / max(1, E * n_layers):.1f}%, {n / max(1, n_layers):.1f} per MoE layer)")
            if prof is not None and n:
                from ktrun.experts.placement import Budget, hit_ratio, plan_placement
                hits = []
                for strategy in STRATEGIES:
                    pl = plan_placement(prof, E, info["moe_layers"], Budget(ratio=n / (E * n_layers)), strategy)
                    hits.append(f"{strategy} {hit_ratio(prof.counts(), pl.experts):.3f}")
                line += "; hit ratio on the profile (in-sample): " + ", ".join(hits)
            lines.append(line)
    return lines
