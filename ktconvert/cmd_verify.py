"""`ktconvert verify`: check a converted directory's structure, sizes and sha256, optionally its error vs the source."""
from __future__ import annotations

import sys
from pathlib import Path

import click
import numpy as np
from ktlayouts.constants import FILE_ALIGN
from ktlayouts.converted_dir import (
    PARTIAL_SUFFIX,
    PROGRESS_NAME,
    ManifestError,
    is_pad_tensor,
    read_safetensors_header,
    safe_relpath,
)
from ktlayouts.expert_formats import expert_formats

# Default limit on ||W_hat - W|| / ||W|| per tensor, per --method: each expert format's record (max_rel_error; int4
# 0.15, int8 0.01, bf16 0.005). A wrong layout or scale gives errors near 1 or above.
DEFAULT_MAX_REL_ERROR = {m: f.max_rel_error for f in expert_formats() for m in f.methods}
DENSE_MAX_REL_ERROR = 0.01     # BF16 rounding of non-expert tensors
# Experts quantized by GPTQ (manifest "expert_quantizer": "gptq") trade weight error for output error on the routed
# tokens, as the GPU layers' GPTQ does: a looser weight-space limit (a wrong layout or scale still gives ~1); the
# records' gptq_max_rel_error (int4 0.25, int8 0.02).
GPTQ_EXPERT_MAX_REL_ERROR = {m: f.gptq_max_rel_error for f in expert_formats() for m in f.methods
                             if f.gptq_max_rel_error is not None}


def _limits_help() -> str:
    fmts = sorted(expert_formats(), key=lambda f: f.bits)
    plain = ", ".join(f"{f.name} {f.max_rel_error:g}" for f in fmts)
    gptq = ", ".join(f"{f.name} {f.gptq_max_rel_error:g}" for f in fmts
                     if f.gptq_max_rel_error is not None)
    return f"default: {plain}; GPTQ-quantized experts: {gptq}"


def check_structure(root: Path, manifest: dict) -> list[str]:
    """Problems with files, sizes, sha256, headers and alignment (empty list = all good)."""
    from ktlayouts.files import sha256_file

    problems = []
    leftovers = [p.name for p in root.rglob(f"*{PARTIAL_SUFFIX}")] + \
        ([PROGRESS_NAME] if (root / PROGRESS_NAME).exists() else [])
    if leftovers:
        problems.append(f"unfinished conversion leftovers present: {', '.join(sorted(leftovers))}")
    for rel, f in manifest["files"].items():
        path = safe_relpath(root, rel)
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        if path.stat().st_size != f["size"]:
            problems.append(f"{rel}: size {path.stat().st_size}, manifest says {f['size']}")
            continue
        if sha256_file(path) != f["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest (corrupted or modified)")
            continue
        if "tensors" not in f:
            continue
        try:
            base, header = read_safetensors_header(path)
        except (ValueError, UnicodeDecodeError) as e:
            problems.append(f"{rel}: unreadable safetensors header: {e}")
            continue
        entries = {k: v for k, v in header.items() if k != "__metadata__" and not is_pad_tensor(k)}
        if set(entries) != set(f["tensors"]):
            problems.append(f"{rel}: tensors {sorted(entries)} differ from the manifest's {sorted(f['tensors'])}")
            continue
        for name, t in f["tensors"].items():
            e = entries[name]
            off = base + e["data_offsets"][0]
            if e["dtype"] != t["dtype"] or e["shape"] != t["shape"] or off != t["offset"]:
                problems.append(f"{rel}: tensor {name}: header {e['dtype']}{e['shape']}@{off} != manifest "
                                f"{t['dtype']}{t['shape']}@{t['offset']}")
            elif off % FILE_ALIGN:
                problems.append(f"{rel}: tensor {name} at byte offset {off} is not {FILE_ALIGN}-byte aligned")
    return problems


def compare_to_source(conv, src_path: str, per_expert: bool = False) -> list[tuple[str, float, float, bool]]:
    """Per-tensor relative errors [(what, error, limit, is_expert)]: every dense tensor, and every routed expert tensor
    (per_expert) or the worst expert per (layer, proj)."""
    from ktlayouts.gpu_formats import is_gpu_layout, max_rel_error
    from tqdm import tqdm

    from ktconvert.converted_reader import relative_error
    from ktconvert.sources import open_source

    geo = conv.geometry
    limit = DEFAULT_MAX_REL_ERROR[geo.method]
    if conv.manifest.get("expert_quantizer") == "gptq":
        limit = GPTQ_EXPERT_MAX_REL_ERROR.get(geo.method, limit)
    rows = []
    with open_source(src_path) as src:
        adapter = src.arch
        for name in conv.dense_names():
            layout = conv.dense_layout(name)
            dense_limit = max_rel_error(layout) if is_gpu_layout(layout) else DENSE_MAX_REL_ERROR
            rows.append((name, relative_error(conv.read_dense(name), src.read(name).numpy()), dense_limit, False))
        bar = tqdm(total=len(geo.moe_layers) * geo.n_experts, desc="comparing experts", unit="expert",
                   disable=None)
        for layer in geo.moe_layers:
            worst = {p: (0.0, "") for p in ("gate", "up", "down")}
            for e in range(geo.n_experts):
                for p, w in conv.read_expert(layer, e).items():
                    name = adapter.expert_tensor_name(layer, e, p)
                    err = relative_error(w, src.read(name).numpy())
                    if per_expert:
                        rows.append((name, err, limit, True))
                    worst[p] = max(worst[p], (err, name))
                bar.update(1)
            if not per_expert:
                for p, (err, name) in worst.items():
                    rows.append((f"layer {layer} {p} of {geo.n_experts} experts, worst {name}", err, limit, True))
        bar.close()
    return rows


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--against", "src", default=None,
              help="Source checkpoint (directory or GGUF) to compare dequantized weights to; a quantized source is "
                   "compared with its own dequantization.")
@click.option("--max-rel-error", type=float, default=None,
              help=f"Fail above this relative error for experts ({_limits_help()}).")
@click.option("--per-expert", is_flag=True, help="With --against: one line per routed expert tensor, not per layer.")
@click.option("--quiet", is_flag=True, help="Print only failures and the summary.")
def verify(directory, src, max_rel_error, per_expert, quiet):
    """Verify the converted DIRECTORY: manifest schema, every file's size and sha256, safetensors headers and
    64-byte alignment; with --against SRC also the relative error ||W_hat - W|| / ||W|| of every dequantized
    tensor against the source. Exits non-zero on any problem.

    \b
    Examples:
      ktconvert verify converted/
      ktconvert verify converted/ --against ./DeepSeek-V3
      ktconvert verify converted/ --against ./DeepSeek-V3 --max-rel-error 0.15 --per-expert
    """
    from ktconvert.converted_reader import ConvertedDir
    from ktconvert.sources.roles import SourceError

    root = Path(directory)
    try:
        conv = ConvertedDir(root)
    except ManifestError as e:
        raise click.ClickException(str(e)) from None
    problems = check_structure(root, conv.manifest)
    for p in problems:
        click.echo(f"FAIL {p}")
    n_files = len(conv.manifest["files"])
    click.echo(f"structure: {n_files} files, {'OK' if not problems else f'{len(problems)} problem(s)'}")
    if problems:
        sys.exit(1)
    if src is not None:
        try:
            rows = compare_to_source(conv, src, per_expert)
        except (SourceError, KeyError) as e:
            raise click.ClickException(f"cannot compare against {src}: {e}") from None
        bad = 0
        for what, err, limit, is_expert in rows:
            if max_rel_error is not None and is_expert:
                limit = max_rel_error
            ok = np.isfinite(err) and err <= limit
            bad += not ok
            if not quiet or not ok:
                click.echo(f"{'ok  ' if ok else 'FAIL'} {what}: relative error {err:.3e} (limit {limit:g})")
        exact = sum(1 for _w, err, _l, _e in rows if err == 0)
        click.echo(f"against {src}: {len(rows)} tensors compared, {exact} equal to the source's own dequantized "
                   f"values (error 0), {bad} above the limit")
        if bad:
            sys.exit(1)
    click.echo("verify: OK")
