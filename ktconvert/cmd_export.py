"""`ktconvert export`: a converted directory (--gpu-format compressed-tensors or gptq) as a standard hub checkpoint."""
from __future__ import annotations

from pathlib import Path

import click

from ktconvert.export.hf import DEFAULT_SHARD_BYTES, EXPERT_MODES, ExportError, export_hf, export_total_bytes


@click.command("export")
@click.argument("converted", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="New directory to write (must not exist).")
@click.option("--shard-size", default=DEFAULT_SHARD_BYTES, show_default=True, type=click.IntRange(min=1),
              help="Bytes per model-XXXXX-of-YYYYY.safetensors shard (about).")
@click.option("--experts", type=click.Choice(EXPERT_MODES), default="quantized", show_default=True,
              help="Routed experts: 'quantized' takes the CPU codes and scales over losslessly into the GPU format "
                   "(loads in transformers); 'bf16' dequantizes them (for engines that want dense experts).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export(converted: Path, out: Path, shard_size: int, experts: str, quiet: bool):
    """Write CONVERTED (made by `ktconvert quantize --gpu-format compressed-tensors|gptq`) as a checkpoint in the
    hub layout (for transformers / vLLM): GPU layers in their quantized format under their hub names, routed
    experts in the same format with their own bits and group size (codes and scales of the CPU tiles, not
    re-quantized; a second quantization_config scheme) or, with --experts bf16, dequantized to BF16 (marked as not
    quantized), sharded safetensors + model.safetensors.index.json, config.json, tokenizer files.

    \b
    Examples:
      ktconvert quantize ./DeepSeek-V3 -o conv/ --gpu-method rtn-int4 --gpu-format compressed-tensors
      ktconvert export conv/ -o DeepSeek-V3-ct-int4/
    """
    from tqdm import tqdm

    if out.exists():
        raise click.ClickException(f"output {out} already exists; choose a new path or remove it")
    try:
        total = export_total_bytes(converted, experts)
        with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=quiet) as bar:
            shards = export_hf(converted, out, shard_bytes=shard_size, progress=bar.update, experts=experts)
    except (ExportError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out} ({len(shards)} shard(s) + model.safetensors.index.json)")
