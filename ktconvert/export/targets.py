"""`ktconvert export --for ENGINE`: one directory the engine loads as it is, and the command that serves it.

    transformers  the hub-layout checkpoint of export.hf (what `ktconvert export` writes without --for); families
                  whose hub layout holds the experts fused (gpt-oss) get them that way, dequantized to BF16; the
                  text model of a multimodal release (Qwen3.5-MoE) is written as its own text-only checkpoint.
    vllm          the same checkpoint: vLLM reads compressed-tensors (and gptq) checkpoints; a Marlin conversion
                  is refused as before.
    sglang-kt     SGLang with kt-kernel's CPU experts: `--model OUT` is the hub checkpoint (GPU layers, and the
                  experts in the GPU format for the experts SGLang keeps on GPUs), `--kt-weight-path` holds the
                  experts in the chosen kt method (export.kt_kernel): OUT itself for GPTQ_INT4 / RAWINT4,
                  OUT/kt-experts for AMXINT4 / AMXINT8, split for `--kt-threadpool-count N` = --numa-nodes.
                  Refused for families whose experts kt-kernel cannot compute (KT_ACTIVATION_RULE).
Every rule is checked before anything is written; the export is written into a temporary sibling directory and
renamed into place when complete (export.hf), with ktconvert-export.json recording what was written and how it is
served.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from ktconvert.converted_reader import ConvertedDir
from ktconvert.export.hf import (
    DEFAULT_SHARD_BYTES,
    ExportError,
    export_hf,
    export_total_bytes,
    fused_layout,
    gpu_format_of,
)
from ktconvert.export.kt_kernel import (
    KtExportError,
    KtPlan,
    amx_total_bytes,
    plan_kt_export,
    write_amx_experts,
    write_plan_record,
)
from ktconvert.sources.roles import adapter_for

TARGETS = ("sglang-kt", "vllm", "transformers")
# kt-kernel 0.7.2's MoE (KTMoEWrapper over MOEConfig: gate/up/down weights and scales, no bias, no activation choice)
KT_ACTIVATION_RULE = ("kt-kernel's CPU MoE (KTMoEWrapper, kt-kernel 0.7.2) computes silu(gate) * up without "
                      "biases for every method")


@dataclass
class ExportResult:
    shards: list[str]
    launch: str                # the command that serves the export
    record: dict               # what ktconvert-export.json holds


def _quote(p: Path) -> str:
    return shlex.quote(str(p))


def launch_command(target: str, out: Path, plan: KtPlan | None = None) -> str:
    out = out.resolve()
    if target == "sglang-kt":
        weights = out if plan.weight_dir == "." else out / plan.weight_dir
        return (f"python -m sglang.launch_server --model {_quote(out)} --kt-weight-path {_quote(weights)} "
                f"--kt-method {plan.method} --kt-cpuinfer $(nproc) --kt-threadpool-count {plan.n_parts} "
                "--host 127.0.0.1 --port 30000")
    if target == "vllm":
        return f"vllm serve {_quote(out)} --host 127.0.0.1 --port 8000"
    return (f"python -c \"from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, dtype='bfloat16')\"")


def export_for(target: str, converted: str | Path, out: str | Path, kt_method: str | None = None,
               numa_nodes: int | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
               progress=None) -> ExportResult:
    """Export `converted` for `target` into `out` (must not exist); see the module docstring."""
    src, out = Path(converted), Path(out)
    if target not in TARGETS:
        raise ExportError(f"--for {target!r}: choose one of {', '.join(TARGETS)}")
    if target != "sglang-kt" and (kt_method is not None or numa_nodes is not None):
        raise ExportError(f"--kt-method / --numa-nodes are options of --for sglang-kt, not of --for {target}")
    if out.exists():
        raise ExportError(f"output {out} already exists; choose a new path or remove it")
    if not (src / "config.json").is_file():
        raise ExportError(f"{src}: no config.json (not a converted directory?)")
    record = {"target": target, "converted": str(src.resolve())}
    plan = None
    kwargs = {}
    config = json.loads((src / "config.json").read_text())
    adapter = adapter_for(config)
    if target == "sglang-kt":
        if kt_method is None:
            raise ExportError("--for sglang-kt needs --kt-method GPTQ_INT4|RAWINT4|AMXINT4|AMXINT8")
        act = adapter.cfg.expert_activation
        if act.kind != "silu" or act.bias:
            raise ExportError(f"--for sglang-kt: {KT_ACTIVATION_RULE}; {adapter.model_type}'s routed experts use "
                              f"the {act.kind} activation{' with per-expert biases' if act.bias else ''}, which it "
                              "cannot run: export --for vllm or --for transformers (or serve it with ktrun)")
        conv = ConvertedDir(src)
        try:
            plan = plan_kt_export(conv, config, adapter, gpu_format_of(conv), kt_method,
                                  numa_nodes or conv.geometry.numa_nodes)
        finally:
            conv.close()
        kwargs = {"expert_step": plan.expert_step,
                  "expert_scale_dtype": torch.bfloat16 if plan.bf16_scales else torch.float32}

        def before_rename(tmp: Path, conv: ConvertedDir) -> None:
            if plan.weight_dir != ".":
                plan.report = write_amx_experts(conv, tmp, plan.method, plan.n_parts, progress)
            record.update(kt_method=plan.method, kt_threadpool_count=plan.n_parts, kt_weight_path=plan.weight_dir,
                          expert_group=plan.expert_step, expert_error=plan.report or {"exact": True},
                          launch=launch_command(target, out, plan))
            write_plan_record(tmp, record)
        kwargs["before_rename"] = before_rename
    else:
        if fused_layout(adapter) is not None:        # gpt-oss: the hub's fused BF16 experts, as the engines read them
            kwargs["experts"] = "bf16"
            record["experts"] = (f"bf16: {adapter.model_type}'s fused hub layout (dequantized; no GPU Linear format "
                                 "quantizes fused experts)")
        if adapter.family.text_architecture is not None:     # the vision tower was never converted
            kwargs["text_only"] = True
            record["text_only"] = (f"the text model as {adapter.family.text_architecture} (the release's vision tower "
                                   "is not in the conversion)")

        def before_rename(tmp: Path, conv: ConvertedDir) -> None:
            record["launch"] = launch_command(target, out)
            write_plan_record(tmp, record)
        kwargs["before_rename"] = before_rename
    try:
        shards = export_hf(src, out, shard_bytes=shard_bytes, progress=progress, **kwargs)
    except KtExportError as e:
        raise ExportError(str(e)) from None
    return ExportResult(shards, record["launch"], record)


def export_total(target: str, converted: str | Path, kt_method: str | None, numa_nodes: int | None) -> int:
    """Bytes for a progress bar (export_total_bytes, plus the kt-experts files of AMX methods)."""
    fused = target != "sglang-kt" and fused_layout(adapter_for(
        json.loads((Path(converted) / "config.json").read_text()))) is not None
    total = export_total_bytes(converted, "bf16" if fused else "quantized")
    if target == "sglang-kt" and kt_method in ("AMXINT4", "AMXINT8"):
        conv = ConvertedDir(converted)
        try:
            total += amx_total_bytes(conv, kt_method, numa_nodes or conv.geometry.numa_nodes)
        except ValueError:
            pass                     # the export itself reports the rule that fails
        finally:
            conv.close()
    return total
