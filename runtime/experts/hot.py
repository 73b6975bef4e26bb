"""Hot experts at load: which placement applies (a budget given now, or the one written into the conversion), the
memory plan for `--gpu-mem`, and the executor that runs it (ktrun.experts.hybrid over the CPU executor).

    opts = HotExpertOptions(profile="profile.json", budget=Budget(per_layer=8), strategy="per-layer")
    lm = load_model("converted/", hot_experts=opts)       # lm.model.experts is a HybridExperts

Which placement: a budget given now (with --profile for frequency / per-layer) wins; else the conversion's
gpu_experts.json (written by `ktconvert quantize --profile`); else none, and the executor is the CPU one as before.
`--gpu-experts 0` turns a written placement off. `--dynamic-experts` starts from the static placement (or empty
slots without a profile) and keeps each layer's number of hot experts, swapping which ones.
"""
from __future__ import annotations

import torch
from ktlayouts.converted_dir import ExpertGeometry
from ktlayouts.expert_gpu import hot_expert_nbytes
from ktlayouts.expert_placement import PLACEMENT_NAME, ExpertPlacement, PlacementFileError, fit_hot_experts
from ktlayouts.expert_profile import ExpertProfile, ProfileError
from ktlayouts.files import sha256_file

from ..byte_sizes import human
from ..cache_budget import kv_bytes_per_token, state_bytes_per_request
from ..defaults import KV_BUDGET_TOKENS
from .dynamic import DynamicExperts
from .hot_store import HotExpertError, HotExpertStore, resolve_format
from .hybrid import HybridExperts
from .placement import HotExpertOptions, PlacementError, plan_placement
from .residency import ExpertResidency


def dense_device_bytes(converted) -> int:
    """Bytes of the dense (non-expert) weights as placed (tensors; packed Linears: MarlinLinear, KernelLinear)."""
    n = 0
    for v in converted.dense.values():
        n += v.numel() * v.element_size() if isinstance(v, torch.Tensor) else v.nbytes
    return n


def _written_placement(converted) -> ExpertPlacement | None:
    f = converted.manifest["files"].get(PLACEMENT_NAME)
    if f is None:
        return None
    try:
        return ExpertPlacement.load(converted.root / PLACEMENT_NAME)
    except PlacementFileError as e:
        raise PlacementError(str(e)) from None


def resolve_placement(converted, opts: HotExpertOptions, kv_tokens: int = KV_BUDGET_TOKENS,
                      kv_states: int = 1) -> tuple[ExpertPlacement | None, str]:
    """(the placement to apply or None, the GPU format) for a loaded conversion. The --gpu-mem plan leaves room
    for kv_tokens tokens of KV cache (unless --kv-mem says) and kv_states recurrent states (linear attention)."""
    geo: ExpertGeometry = converted.geometry
    cfg = converted.config
    profile = None
    if opts.profile:
        try:
            profile = ExpertProfile.load(opts.profile)
            profile.check_model(cfg.model_type, geo.n_experts, geo.moe_layers, what=opts.profile)
        except ProfileError as e:
            raise PlacementError(str(e)) from None
    written = _written_placement(converted)
    requested = opts.gpu_format
    if requested == "auto" and written is not None and not opts.budget.given:
        requested = written.gpu_format
    try:
        fmt = resolve_format(geo, requested, converted.device)
    except HotExpertError as e:
        raise PlacementError(str(e)) from None
    if opts.budget.given:
        if opts.budget.per_layer == 0 or opts.budget.ratio == 0:     # hot experts off (also a written placement)
            return None, fmt
        plan, fit = None, None
        if opts.budget.gpu_mem is not None:
            kv = opts.budget.kv_mem if opts.budget.kv_mem is not None else kv_tokens * kv_bytes_per_token(
                cfg, converted.dtype)
            state = kv_states * state_bytes_per_request(cfg, converted.dtype)
            dense = dense_device_bytes(converted)
            fit, plan = fit_hot_experts(opts.budget.gpu_mem, dense, kv,
                                        hot_expert_nbytes(geo, fmt, cfg.expert_activation.bias), state_bytes=state)
            if dense + kv + state + plan["reserve"] > opts.budget.gpu_mem:
                raise PlacementError(
                    f"--gpu-mem {human(opts.budget.gpu_mem)} cannot hold the dense weights ({human(dense)}) + the KV "
                    f"cache ({human(kv)}: {'--kv-mem' if opts.budget.kv_mem is not None else f'{kv_tokens} tokens'})"
                    + (f" + the recurrent state ({human(state)}: {kv_states} requests' linear-attention layers)"
                       if state else "")
                    + f" + the {human(plan['reserve'])} reserve: raise --gpu-mem or lower --ctx / --max-batch")
        strategy = opts.strategy if profile is not None or opts.strategy == "uniform" else "uniform"
        if profile is None and opts.strategy != "uniform" and not opts.dynamic:
            raise PlacementError(f"--placement {opts.strategy} chooses experts from a profile: give --profile P "
                                 "(from `ktconvert profile`), or --dynamic-experts")
        placement = plan_placement(profile, geo.n_experts, geo.moe_layers, opts.budget, strategy, fmt, fit,
                                   sha256_file(opts.profile) if opts.profile else None, plan)
        return (placement if placement.cells else None), fmt
    if written is not None:
        written.check(geo.n_experts, geo.moe_layers)
        return (written if written.cells else None), fmt
    if opts.dynamic:
        raise PlacementError("--dynamic-experts needs a budget: --gpu-experts N, --gpu-experts-ratio R or --gpu-mem")
    if opts.profile:
        raise PlacementError("--profile needs a budget: --gpu-experts N, --gpu-experts-ratio R or --gpu-mem SIZE")
    return None, fmt


def build_hot_executor(converted, cpu, opts: HotExpertOptions | None, kv_tokens: int = KV_BUDGET_TOKENS,
                       kv_states: int = 1):
    """The executor for these options: `cpu` itself without hot experts, else a HybridExperts over it."""
    if opts is None:
        opts = HotExpertOptions()
    placement, fmt = resolve_placement(converted, opts, kv_tokens, kv_states)
    if placement is None:
        return cpu
    geo = converted.geometry
    capacity = {L: len(placement.experts.get(L, ())) for L in geo.moe_layers}
    if opts.dynamic and opts.profile is None and opts.budget.given:   # no profile: slots fill from the window
        placement = ExpertPlacement({L: () for L in geo.moe_layers}, placement.strategy, fmt, placement.budget, {})
    spare = opts.spare_slots if opts.dynamic else 0
    slots = {L: n + (spare if n else 0) for L, n in capacity.items()}
    try:
        store = HotExpertStore(converted, slots, fmt)
    except HotExpertError as e:
        raise PlacementError(str(e)) from None
    residency = ExpertResidency(geo.n_experts, slots)
    for L, experts in placement.experts.items():
        for e in experts:
            slot = residency.take_free(L)
            store.load(L, slot, e)
            residency.place(L, e, slot)
    dynamic = DynamicExperts(store, residency, capacity, opts.window, opts.hysteresis, opts.min_gap,
                             opts.asynchronous) if opts.dynamic else None
    return HybridExperts(cpu, store, residency, dynamic, placement)


def describe(executor) -> str:
    """One line for logs and `ktrun bench`: what runs where."""
    if not isinstance(executor, HybridExperts):
        return "hot experts: none (every routed expert on the CPU)"
    p, st = executor.placement, executor.store
    n_all = st.geo.n_experts * len(st.geo.moe_layers)
    cap = sum(len(v) for v in p.experts.values()) if p is not None else 0
    how = f"{p.strategy}" + (f" from {p.profile.get('source') or 'a profile'}" if p and p.profile else "")
    dyn = (f"; dynamic: window {executor.dynamic.counts.window} tokens, hysteresis {executor.dynamic.hysteresis}"
           if executor.dynamic is not None else "")
    return (f"hot experts: {executor.residency.n_resident()} of {n_all} on {st.device.type} ({cap} placed, {how}; "
            f"{st.format}, {human(st.nbytes)} in {sum(len(s) for s in st.slots.values())} slots){dyn}")
