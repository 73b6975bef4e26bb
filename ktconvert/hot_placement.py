"""`ktconvert quantize --profile P --gpu-experts N | --gpu-experts-ratio R | --gpu-mem SIZE`: the hot-expert placement
written into the conversion (gpu_experts.json, ktlayouts.expert_placement), computed with ktrun's strategies from the
profile once every expert and dense file is written (the --gpu-mem plan uses the dense files' stored bytes).

The GPU format is resolved here ('auto': Marlin when the CPU codes fit it exactly, else bf16), because the memory plan
depends on it; ktrun uses the written format unless told otherwise."""
from __future__ import annotations

from dataclasses import dataclass

from ktlayouts.expert_gpu import hot_expert_nbytes, hot_format_ok
from ktlayouts.expert_placement import PLACEMENT_NAME, fit_hot_experts
from ktlayouts.expert_profile import ExpertProfile, ProfileError
from ktlayouts.files import sha256_file

from ktconvert.convert_plan import ConvertError
from ktconvert.writer import atomic_write_bytes

KV_TOKENS = 4096    # the KV budget of a --gpu-mem plan when --kv-mem is not given: one sequence of 4096 tokens


@dataclass(frozen=True)
class HotPlacementOptions:
    """What quantize was asked for (the CLI's hot-expert options without the dynamic ones)."""
    profile: str
    per_layer: int | None = None
    ratio: float | None = None
    gpu_mem: int | None = None
    kv_mem: int | None = None
    strategy: str = "frequency"
    gpu_format: str = "auto"

    def params(self) -> dict:
        """What makes two runs write the same placement (the resume journal compares these)."""
        return {"profile_sha256": sha256_file(self.profile), "per_layer": self.per_layer, "ratio": self.ratio,
                "gpu_mem": self.gpu_mem, "kv_mem": self.kv_mem, "strategy": self.strategy,
                "gpu_format": self.gpu_format}


def load_checked_profile(opts: HotPlacementOptions, src) -> ExpertProfile:
    a = src.arch
    try:
        prof = ExpertProfile.load(opts.profile)
        prof.check_model(a.model_type, a.n_experts, tuple(a.moe_layers()), what=f"--profile {opts.profile}")
    except ProfileError as e:
        raise ConvertError(str(e)) from None
    return prof


def write_placement(src, out_dir, opts: HotPlacementOptions, geometry, journal) -> str:
    """Compute the placement and write gpu_experts.json (atomically, journaled); returns its name."""
    import torch
    from ktlayouts.families import parse_config
    from ktrun.experts.hot import kv_bytes_per_token
    from ktrun.experts.placement import Budget, PlacementError, plan_placement

    prof = load_checked_profile(opts, src)
    fmt = opts.gpu_format
    if fmt == "auto":
        fmt = "marlin" if hot_format_ok(geometry, "marlin") is None else "bf16"
    why = hot_format_ok(geometry, fmt)
    if why:
        raise ConvertError(f"--gpu-expert-format {fmt}: {why}")
    try:
        budget = Budget(opts.per_layer, opts.ratio, opts.gpu_mem, opts.kv_mem)
        fit = plan = None
        if opts.gpu_mem is not None:
            dense = sum(rec["size"] for rel, rec in journal.files.items() if rel.startswith("dense/"))
            kv = opts.kv_mem if opts.kv_mem is not None else KV_TOKENS * kv_bytes_per_token(
                parse_config(src.config, "config.json"), torch.bfloat16)
            biases = parse_config(src.config, "config.json").expert_activation.bias
            fit, plan = fit_hot_experts(opts.gpu_mem, dense, kv, hot_expert_nbytes(geometry, fmt, biases))
        placement = plan_placement(prof, geometry.n_experts, geometry.moe_layers, budget, opts.strategy, fmt, fit,
                                   sha256_file(opts.profile), plan)
    except PlacementError as e:
        raise ConvertError(str(e)) from None
    raw = placement.dumps()
    atomic_write_bytes(out_dir / PLACEMENT_NAME, raw)
    journal.record(PLACEMENT_NAME, len(raw), sha256_file(out_dir / PLACEMENT_NAME))
    return PLACEMENT_NAME
