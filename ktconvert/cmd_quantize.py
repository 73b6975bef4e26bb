"""`ktconvert quantize`: convert a checkpoint into a ktrun directory (CPU expert tiles + non-expert tensors)."""
from __future__ import annotations

import logging

import click
from ktlayouts.constants import DEFAULT_GROUP_SIZE, DEFAULT_SCALE_DTYPE, METHOD_TO_LAYOUT, SCALE_DTYPES
from ktlayouts.converted_dir import ManifestError
from ktlayouts.cpu_expert import LayoutError
from ktrun.cli.hot_experts_option import hot_experts_from, hot_experts_options

from ktconvert.convert_plan import ConvertError
from ktconvert.gpu import gpu_errors
from ktconvert.gpu.options import gpu_click_options
from ktconvert.progress import OutputDirError
from ktconvert.sources.roles import SourceError

CONVERT_ERRORS = (ConvertError, SourceError, OutputDirError, LayoutError, ManifestError)


def log_estimate(src, opts, plan, encoder, quantizer, out_dir) -> None:
    """The conversion's estimated wall time on this machine, logged before it starts (ktconvert.estimate); a
    calibrated conversion's large arrays kept in the heap from here on (malloc_policy.keep_large_arrays)."""
    from ktrun.malloc_policy import keep_large_arrays

    from ktconvert.estimate import estimate_conversion

    if getattr(quantizer, "calibrated", False) or getattr(encoder, "calibrated", False):
        keep_large_arrays()

    logging.getLogger("ktconvert").info(estimate_conversion(src, opts, plan, encoder, quantizer, out_dir).line())


def resolve_source_arg(src: str | None):
    """SRC as a local directory or .gguf file, a hub repo id (pulled first), or None: the most recent pull."""
    from ktconvert.hub import resolve_source  # its PullError is a ClickException: a clean message and exit 1
    return resolve_source(src)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src", required=False)
@click.option("-o", "--output", "out_dir", default="converted", show_default=True, type=click.Path(file_okay=False),
              help="Output directory.")
@click.option("--method", type=click.Choice([*METHOD_TO_LAYOUT, "auto"]), default="int4-amx", show_default=True,
              help="Routed-expert format for the CPU kernels; auto: the layout that holds an already-quantized "
                   "source's experts exactly (its codes and scales copied), else int4-amx.")
@click.option("--group-size", type=int, default=None,
              help=f"Input channels per scale: 32, a multiple of 64, or -1 for one scale per row (default "
                   f"{DEFAULT_GROUP_SIZE}, 32 with --scale-dtype sub6; with --method auto, the source's).")
@click.option("--numa-nodes", type=int, default=1, show_default=True,
              help="Split every expert into this many shards (one file per node); servable on any node count.")
@click.option("--expert-quantizer", type=click.Choice(["auto", "gptq", "search", "rtn"]), default="auto",
              show_default=True,
              help="Routed experts: gptq on each expert's routed calibration tokens where it got enough of them, "
                   "else importance-weighted scale search (auto: gptq with calibration text, else search); rtn: "
                   "largest magnitude onto the most negative code, no calibration.")
@click.option("--expert-gptq-min-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="Routed calibration tokens an expert needs for GPTQ (0: half the matrix's input size).")
@click.option("--scale-dtype", type=click.Choice(list(SCALE_DTYPES)), default=DEFAULT_SCALE_DTYPE, show_default=True,
              help="Expert scales: f16 or bf16 (layout version 2: 16 bits per scale, 0.5 bit/weight less at group "
                   "32), f32 (version 1, readable by older ktrun), or sub6: two-level scales like GGUF's Q4_K (layout "
                   "version 3, int4 only, group 32 by default): a float16 super-scale per 256 input channels and a "
                   "6-bit sub-scale per 32, searched together; 4.25 bits/weight, the bytes of group 64 with f16.")
@click.option("--report-kl", is_flag=True,
              help="After converting, print the conversion's perplexity and KL divergence against the source (float32, "
                   "layer by layer) on the held-out quarter of the calibration text (ktrun perplexity's protocol).")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion in the output directory.")
@click.option("--force", is_flag=True, help="Discard a previous conversion in the output directory and start over.")
@click.option("--workers", type=int, default=2, show_default=True, help="Threads quantizing experts.")
@click.option("--bf16-scales", is_flag=True,
              help="Round every expert scale to bfloat16 before quantizing (codes computed against the rounded "
                   "scale), so formats with bf16 scales take them over exactly: `ktconvert export --for sglang-kt "
                   "--kt-method RAWINT4` needs it.")
@click.option("--keep-mtp/--no-keep-mtp", default=True, show_default=True,
              help="Write the checkpoint's multi-token-prediction (MTP) layers too (DeepSeek-V3/V3.2, GLM-4.5+ ship "
                   "one), listed in the manifest as mtp_dense / mtp_expert files; ktrun drafts with them under "
                   "--speculative mtp and ignores them otherwise.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@gpu_click_options
@hot_experts_options(dynamic=False)
def quantize(src, out_dir, method, group_size, numa_nodes, expert_quantizer, expert_gptq_min_tokens, scale_dtype,
             report_kl, resume, force, workers, keep_mtp, quiet, bf16_scales, **gpu):
    """Convert the checkpoint SRC into OUTPUT.

    SRC is a local checkpoint directory (safetensors shards + config.json), a GGUF file (or the first part of a
    split set), or a hub repo id (pulled first, see `ktconvert pull`); without SRC, the most recent pull.

    Routed experts become INT4/INT8 (or BF16) AMX/VNNI tiles in experts/layer-*.shard-*.safetensors; the other
    Linears (attention, shared experts, dense MLPs; lm_head with --quantize-head) become GPTQ or RTN INT4/INT8 GPU
    layers in dense/ (Marlin layout, or gptq / compressed-tensors for vLLM), calibrated layer by layer on the
    shipped text (or --calib FILE); embeddings, norms and routers stay BF16/F32; config and tokenizer files are copied;
    already-quantized sources (compressed-tensors, GPTQ, AWQ, FP8, MXFP4/MXFP8) keep their codes where a layout holds
    them exactly, and the log says which tensors were re-quantized and with what error;
    manifest.json (written last) lists every file with size and sha256. Memory stays at about one expert;
    a killed run continues with --resume and yields byte-identical output.

    \b
    Examples:
      ktconvert quantize ./DeepSeek-V3 -o converted/
      ktconvert quantize deepseek-ai/DeepSeek-V3 --method int4-amx      # pull, then convert
      ktconvert quantize --method int4-amx                               # the most recent pull
      ktconvert quantize ./DeepSeek-V3-Q8_0-00001-of-00016.gguf -o dsv3/  # GGUF input
      ktconvert quantize ./Kimi-K2-Thinking --method auto -o kimi/       # int4 g32 experts taken over exactly
      ktconvert quantize ./Qwen3-30B-A3B --method int8-amx --group-size 64 --numa-nodes 2 -o q3/
      ktconvert quantize ./DeepSeek-V3 -o converted/ --resume     # after an interruption
      ktconvert quantize ./Mixtral-8x7B --method bf16 -o mixtral-ref/ --force
      ktconvert quantize ./DeepSeek-V3 --gpu-method rtn-int8 --gpu-group-size -1 -o dsv3-int8/
      ktconvert quantize ./DeepSeek-V3 --gpu-mix-budget 0.5 -o dsv3/    # fewer measured int8 upgrades (0: none)
      ktconvert quantize ./DeepSeek-V3 --gpu-method-for 'model.layers.0.mlp.*=gptq-int8' -o dsv3/   # per Linear
      ktconvert quantize ./Qwen3-30B-A3B --gpu-format compressed-tensors --calib my_text.txt -o q3-ct/
      ktconvert quantize ./DeepSeek-V3 --calib domain.txt --calib-tokens 65536 -o dsv3/    # more experts get GPTQ
      ktconvert quantize ./Qwen3-30B-A3B -o q3/ --report-kl     # then: ppl / kl_mean / kl_p99 / top1_agreement
      ktconvert quantize ./Qwen3-30B-A3B --group-size 32 --bf16-scales --gpu-format compressed-tensors -o q3-raw/
      ktconvert quantize ./DeepSeek-V3 --scale-dtype sub6 -o dsv3-k/   # two-level expert scales, 4.25 bits/weight
      ktconvert quantize ./DeepSeek-V3 -o converted/ --profile profile.json --gpu-mem 24GB --placement per-layer
      ktconvert quantize ./DeepSeek-V3 -o converted/ --no-keep-mtp    # without the MTP layer (no --speculative mtp)

    With --profile (from `ktconvert profile`) and a budget (--gpu-experts N per MoE layer, --gpu-experts-ratio R,
    or --gpu-mem SIZE after the dense layers and --kv-mem), the hot experts are chosen by --placement and written
    to gpu_experts.json; ktrun keeps them on the GPU.
    """
    from ktconvert.pipeline import ConvertOptions, convert

    hot = hot_experts_from(gpu, written=True)
    try:
        logging.basicConfig(level=logging.INFO, format="ktconvert: %(message)s")
        opts = ConvertOptions(method=method, group_size=group_size, numa_nodes=numa_nodes, workers=workers,
                              expert_quantizer=expert_quantizer, expert_gptq_min_tokens=expert_gptq_min_tokens,
                              scale_dtype=scale_dtype, bf16_scales=bf16_scales, hot_experts=hot, keep_mtp=keep_mtp,
                              **gpu)
        src_path = resolve_source_arg(src)
        manifest = convert(src_path, out_dir, opts, resume=resume, force=force, show_progress=not quiet,
                           on_plan=log_estimate)
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
