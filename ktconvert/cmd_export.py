"""`ktconvert export`: a converted directory (--gpu-format compressed-tensors or gptq) as a standard hub checkpoint,
or with --for ENGINE a directory that engine serves as it is (export.targets)."""
from __future__ import annotations

from pathlib import Path

import click
from ktlayouts.kt_kernel import KT_METHODS

from ktconvert.export.hf import DEFAULT_SHARD_BYTES, EXPERT_MODES, ExportError, export_hf, export_total_bytes
from ktconvert.export.targets import TARGETS


@click.command("export")
@click.argument("converted", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="New directory to write (must not exist).")
@click.option("--shard-size", default=DEFAULT_SHARD_BYTES, show_default=True, type=click.IntRange(min=1),
              help="Bytes per model-XXXXX-of-YYYYY.safetensors shard (about).")
@click.option("--experts", type=click.Choice(EXPERT_MODES), default="quantized", show_default=True,
              help="Routed experts: 'quantized' takes the CPU codes and scales over losslessly into the GPU format "
                   "(loads in transformers); 'bf16' dequantizes them (for engines that want dense experts; gpt-oss's "
                   "only form: its fused hub layout with biases).")
@click.option("--for", "target", type=click.Choice(TARGETS), default=None,
              help="Write what this engine serves as it is, and print its launch command: 'sglang-kt' (SGLang with "
                   "kt-kernel's CPU experts, needs --kt-method), 'vllm', 'transformers'.")
@click.option("--kt-method", type=click.Choice(KT_METHODS), default=None,
              help="--for sglang-kt: kt-kernel's expert format. GPTQ_INT4 (gptq conversions) and RAWINT4 "
                   "(compressed-tensors, group 32, bf16 scales) are exact; AMXINT4/AMXINT8 are per-row tiles "
                   "(the error against the conversion is reported).")
@click.option("--numa-nodes", type=click.IntRange(min=1), default=None,
              help="--for sglang-kt: kt-kernel's thread-pool count (--kt-threadpool-count) the experts are split "
                   "for [default: the conversion's --numa-nodes].")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export(converted: Path, out: Path, shard_size: int, experts: str, target: str | None, kt_method: str | None,
           numa_nodes: int | None, quiet: bool):
    """Write CONVERTED (made by `ktconvert quantize --gpu-format compressed-tensors|gptq`) as a checkpoint in the
    hub layout (for transformers / vLLM): GPU layers in their quantized format under their hub names, routed
    experts in the same format with their own bits and group size (codes and scales of the CPU tiles, not
    re-quantized; a second quantization_config scheme) or, with --experts bf16, dequantized to BF16 (marked as not
    quantized), sharded safetensors + model.safetensors.index.json, config.json, tokenizer files.

    With --for ENGINE the directory is what that engine loads as it is, and the command that serves it is printed
    (also recorded in OUT/ktconvert-export.json). --for sglang-kt adds the routed experts in kt-kernel's
    --kt-method: GPTQ_INT4 / RAWINT4 read the export's own expert tensors (--kt-weight-path OUT), AMXINT4 /
    AMXINT8 go to OUT/kt-experts/ split into --numa-nodes parts. kt-kernel's size rules are checked first.

    \b
    Examples:
      ktconvert quantize ./DeepSeek-V3 -o conv/ --gpu-method rtn-int4 --gpu-format compressed-tensors
      ktconvert export conv/ -o DeepSeek-V3-ct-int4/
      ktconvert export conv/ --for vllm -o DeepSeek-V3-vllm/
      ktconvert quantize ./DeepSeek-V3 -o conv-gptq/ --gpu-format gptq --group-size 128
      ktconvert export conv-gptq/ --for sglang-kt --kt-method GPTQ_INT4 --numa-nodes 2 -o DeepSeek-V3-kt/
      ktconvert quantize ./Qwen3-30B-A3B -o q3/ --gpu-format compressed-tensors --group-size 32 --bf16-scales
      ktconvert export q3/ --for sglang-kt --kt-method RAWINT4 -o Qwen3-kt-raw/
      ktconvert export q3/ --for sglang-kt --kt-method AMXINT4 --numa-nodes 2 -o Qwen3-kt-amx/
      ktconvert export gpt-oss-conv/ --for vllm -o gpt-oss-vllm/      # experts: the fused bf16 hub layout
    """
    from tqdm import tqdm

    if out.exists():
        raise click.ClickException(f"output {out} already exists; choose a new path or remove it")
    if target is None and (kt_method is not None or numa_nodes is not None):
        raise click.ClickException("--kt-method / --numa-nodes need --for sglang-kt")
    if target is not None and experts != "quantized":
        raise click.ClickException(f"--experts {experts} is an option of the plain export, not of --for {target}")
    try:
        if target is None:
            total = export_total_bytes(converted, experts)
            with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=quiet) as bar:
                shards = export_hf(converted, out, shard_bytes=shard_size, progress=bar.update, experts=experts)
            click.echo(f"wrote {out} ({len(shards)} shard(s) + model.safetensors.index.json)")
            return
        from ktconvert.export.targets import export_for, export_total

        total = export_total(target, converted, kt_method, numa_nodes)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"export --for {target}", disable=quiet) as bar:
            result = export_for(target, converted, out, kt_method=kt_method, numa_nodes=numa_nodes,
                                shard_bytes=shard_size, progress=bar.update)
    except (ExportError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out} ({len(result.shards)} shard(s) + model.safetensors.index.json"
               + (f", kt-kernel {result.record['kt_method']} experts in {result.record['kt_weight_path']}"
                  if target == "sglang-kt" else "") + ")")
    err = result.record.get("expert_error")
    if err and "rel_error" in err:
        rel = ", ".join(f"{p} {v:.4g}" for p, v in err["rel_error"].items())
        worst = max(err["worst_matrix_rel_error"].values())
        click.echo(f"{result.record['kt_method']}: relative error against the conversion's experts: {rel} "
                   f"(worst matrix {worst:.4g}; {err['rows_on_conversion_grid']} rows kept on the conversion's code "
                   f"grid, {err['rows_requantized']} re-quantized per row)")
    elif target == "sglang-kt":
        click.echo(f"{result.record['kt_method']}: the experts' codes and scales are taken over exactly")
    click.echo("serve it with:\n  " + result.launch)
