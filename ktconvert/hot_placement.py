"""`ktconvert quantize --profile P --gpu-experts N | --gpu-experts-ratio R | --gpu-mem SIZE`: the hot-expert placement
written into the conversion (gpu_experts.json, ktlayouts.expert_placement), computed with ktrun's strategies from the
profile once every expert and dense file is written (the --gpu-mem plan uses the dense files' stored bytes).

The GPU format is resolved here ('auto': Marlin when the CPU codes fit it exactly, else bf16), because the memory plan
depends on it; ktrun uses the written format unless told otherwise."""
from __future__ import annotations

from ktlayouts.expert_gpu import hot_expert_nbytes, hot_format_ok
from ktlayouts.expert_placement import PLACEMENT_NAME, fit_hot_experts
from ktlayouts.expert_profile import ExpertProfile, ProfileError
from ktlayouts.files import sha256_file
from ktrun.defaults import KV_BUDGET_TOKENS
from ktrun.experts.placement import HotExpertOptions

from ktconvert.convert_plan import ConvertError
from ktconvert.writer import atomic_write_bytes


def placement_params(opts: HotExpertOptions) -> dict:
    """What makes two runs write the same placement (the resume journal compares these)."""
    b = opts.budget
    return {"profile_sha256": sha256_file(opts.profile), "per_layer": b.per_layer, "ratio": b.ratio,
            "gpu_mem": b.gpu_mem, "kv_mem": b.kv_mem, "strategy": opts.strategy, "gpu_format": opts.gpu_format}


def load_checked_profile(opts: HotExpertOptions, src) -> ExpertProfile:
    a = src.arch
    try:
        prof = ExpertProfile.load(opts.profile)
        prof.check_model(a.model_type, a.n_experts, tuple(a.moe_layers()), what=f"--profile {opts.profile}")
    except ProfileError as e:
        raise ConvertError(str(e)) from None
    return prof


def write_placement(src, out_dir, opts: HotExpertOptions, geometry, journal) -> str:
    """Compute the placement and write gpu_experts.json (atomically, journaled); returns its name."""
    import torch
    from ktlayouts.families import parse_config
    from ktrun.cache_budget import kv_bytes_per_token
    from ktrun.experts.placement import PlacementError, plan_placement

    prof = load_checked_profile(opts, src)
    fmt = opts.gpu_format
    if fmt == "auto":
        fmt = "marlin" if hot_format_ok(geometry, "marlin") is None else "bf16"
    why = hot_format_ok(geometry, fmt)
    if why:
        raise ConvertError(f"--gpu-expert-format {fmt}: {why}")
    try:
        budget = opts.budget
        fit = plan = None
        if budget.gpu_mem is not None:
            dense = sum(rec["size"] for rel, rec in journal.files.items() if rel.startswith("dense/"))
            kv = budget.kv_mem if budget.kv_mem is not None else KV_BUDGET_TOKENS * kv_bytes_per_token(
                parse_config(src.config, "config.json"), torch.bfloat16)
            biases = parse_config(src.config, "config.json").expert_activation.bias
            fit, plan = fit_hot_experts(budget.gpu_mem, dense, kv, hot_expert_nbytes(geometry, fmt, biases))
        placement = plan_placement(prof, geometry.n_experts, geometry.moe_layers, budget, opts.strategy, fmt, fit,
                                   sha256_file(opts.profile), plan)
    except PlacementError as e:
        raise ConvertError(str(e)) from None
    raw = placement.dumps()
    atomic_write_bytes(out_dir / PLACEMENT_NAME, raw)
    journal.record(PLACEMENT_NAME, len(raw), sha256_file(out_dir / PLACEMENT_NAME))
    return PLACEMENT_NAME
