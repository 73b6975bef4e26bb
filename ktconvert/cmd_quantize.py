"""`ktconvert quantize`: convert a checkpoint into a ktrun directory (CPU expert tiles + non-expert tensors)."""
from __future__ import annotations

import logging

import click
from ktlayouts.constants import DEFAULT_GROUP_SIZE, DEFAULT_SCALE_DTYPE, METHOD_TO_LAYOUT
from ktlayouts.converted_dir import ManifestError
from ktlayouts.cpu_expert import LayoutError

from ktconvert.convert_plan import ConvertError
from ktconvert.gpu import gpu_errors
from ktconvert.gpu.options import gpu_click_options
from ktconvert.progress import OutputDirError
from ktconvert.sources.roles import SourceError

CONVERT_ERRORS = (ConvertError, SourceError, OutputDirError, LayoutError, ManifestError)


def resolve_source_arg(src: str | None):
    """SRC as a local directory or .gguf file, a hub repo id (pulled first), or None: the most recent pull."""
    from ktconvert.hub import resolve_source  # its PullError is a ClickException: a clean message and exit 1
    return resolve_source(src)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src", required=False)
@click.option("-o", "--output", "out_dir", default="converted", show_default=True, type=click.Path(file_okay=False),
              help="Output directory.")
@click.option("--method", type=click.Choice(list(METHOD_TO_LAYOUT)), default="int4-amx", show_default=True,
              help="Routed-expert format for the CPU kernels.")
@click.option("--group-size", type=int, default=DEFAULT_GROUP_SIZE, show_default=True,
              help="Input channels per scale: 32, a multiple of 64, or -1 for one scale per row.")
@click.option("--numa-nodes", type=int, default=1, show_default=True,
              help="Split every expert into this many shards (one file per node); servable on any node count.")
@click.option("--expert-quantizer", type=click.Choice(["auto", "gptq", "search", "rtn"]), default="auto",
              show_default=True,
              help="Routed experts: gptq on each expert's routed calibration tokens where it got enough of them, "
                   "else importance-weighted scale search (auto: gptq with calibration text, else search); rtn: "
                   "largest magnitude onto the most negative code, no calibration.")
@click.option("--expert-gptq-min-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="Routed calibration tokens an expert needs for GPTQ (0: half the matrix's input size).")
@click.option("--scale-dtype", type=click.Choice(["f32", "f16", "bf16"]), default=DEFAULT_SCALE_DTYPE, show_default=True,
              help="Expert scales: f16 or bf16 (layout version 2: 16 bits per scale, 0.5 bit/weight less at group "
                   "32), or f32 (version 1, readable by older ktrun).")
@click.option("--report-kl", is_flag=True,
              help="After converting, print the conversion's perplexity and KL divergence against the source (float32, "
                   "layer by layer) on the held-out quarter of the calibration text (ktrun perplexity's protocol).")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion in the output directory.")
@click.option("--force", is_flag=True, help="Discard a previous conversion in the output directory and start over.")
@click.option("--workers", type=int, default=2, show_default=True, help="Threads quantizing experts.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@gpu_click_options
def quantize(src, out_dir, method, group_size, numa_nodes, expert_quantizer, expert_gptq_min_tokens, scale_dtype,
             report_kl, resume, force, workers, quiet, **gpu):
    """Convert the checkpoint SRC into OUTPUT.

    SRC is a local checkpoint directory (safetensors shards + config.json), a GGUF file (or the first part of a
    split set), or a hub repo id (pulled first, see `ktconvert pull`); without SRC, the most recent pull.

    Routed experts become INT4/INT8 (or BF16) AMX/VNNI tiles in experts/layer-*.shard-*.safetensors; the other
    Linears (attention, shared experts, dense MLPs; lm_head with --quantize-head) become GPTQ or RTN INT4/INT8 GPU
    layers in dense/ (Marlin layout, or gptq / compressed-tensors for vLLM), calibrated layer by layer on the
    shipped text (or --calib FILE); embeddings, norms and routers stay BF16/F32; config and tokenizer files are copied;
    manifest.json (written last) lists every file with size and sha256. Memory stays at about one expert;
    a killed run continues with --resume and yields byte-identical output.

    \b
    Examples:
      ktconvert quantize ./DeepSeek-V3 -o converted/
      ktconvert quantize deepseek-ai/DeepSeek-V3 --method int4-amx      # pull, then convert
      ktconvert quantize --method int4-amx                               # the most recent pull
      ktconvert quantize ./DeepSeek-V3-Q8_0-00001-of-00016.gguf -o dsv3/  # GGUF input
      ktconvert quantize ./Qwen3-30B-A3B --method int8-amx --group-size 64 --numa-nodes 2 -o q3/
      ktconvert quantize ./DeepSeek-V3 -o converted/ --resume     # after an interruption
      ktconvert quantize ./Mixtral-8x7B --method bf16 -o mixtral-ref/ --force
      ktconvert quantize ./DeepSeek-V3 --gpu-method rtn-int8 --gpu-group-size -1 -o dsv3-int8/
      ktconvert quantize ./Qwen3-30B-A3B --gpu-format compressed-tensors --calib my_text.txt -o q3-ct/
      ktconvert quantize ./DeepSeek-V3 --calib domain.txt --calib-tokens 65536 -o dsv3/    # more experts get GPTQ
      ktconvert quantize ./Qwen3-30B-A3B -o q3/ --report-kl     # then: ppl / kl_mean / kl_p99 / top1_agreement
    """
    from ktconvert.pipeline import ConvertOptions, convert

    try:
        logging.basicConfig(level=logging.INFO, format="ktconvert: %(message)s")
        opts = ConvertOptions(method=method, group_size=group_size, numa_nodes=numa_nodes, workers=workers,
                              expert_quantizer=expert_quantizer, expert_gptq_min_tokens=expert_gptq_min_tokens,
                              scale_dtype=scale_dtype, **gpu)
        src_path = resolve_source_arg(src)
        manifest = convert(src_path, out_dir, opts, resume=resume, force=force, show_progress=not quiet)
    except (*CONVERT_ERRORS, *gpu_errors()) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {manifest.parent} ({manifest.name} lists every file); check it with: "
               f"ktconvert verify {manifest.parent} --against {src_path}")
    if report_kl:
        from ktconvert.report_kl import ReportError
        from ktconvert.report_kl import report_kl as run_report
        try:
            run_report(src_path, manifest.parent, gpu.get("calib"))
        except (ReportError, *gpu_errors()) as e:
            raise click.ClickException(str(e)) from None
