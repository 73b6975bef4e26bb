"""The measured mixed-precision rule of the GPU layers (`--gpu-mix-budget`): which non-expert Linears get more bits.

A sensitivity pass runs the calibration forward once before the conversion (ktconvert.gpu.calib, the same tokens,
float weights carried from layer to layer, routed experts included). In every decoder layer, each Linear the
conversion quantizes is quantized alone the way the conversion would (its --gpu-method, GPTQ with its Hessian) and
the layer run again with it (routed experts off, as in GPTQ's pass 1): its error is the mean over calibration
tokens of ||y_q - y||^2 / ||y||^2, y the layer's output, i.e. the residual stream after the layer, which every
later layer reads. Upgrading a Linear of N x K weights from b to b' bits removes about (1 - 4^-(b'-b)) of that
error (quantization noise power falls 4x a bit) at (b' - b) N K bits; the Linears are upgraded in order of error
removed per added bit while the added bits stay within `budget` bits per GPU-layer weight (the quantized
non-expert Linears of the decoder layers; a Linear that does not fit is skipped, smaller ones after it may fit).

The result is a list of --gpu-method-for rules (exact names), placed after the user's own rules (which win: a
Linear a user rule matches is not a candidate). MTP layers and lm_head are not candidates (no calibration inputs /
no layer after them). What it measured and chose is logged.

Why the residual stream: on the embedded default model (bench/README.md, "mixed precision") restoring one set of
GPU Linears to BF16 in the default conversion moved the held-out KL from 0.00308 to 0.00215 for layer 0's dense
down_proj alone, 0.00264 for its gate_proj, and by under 3% for all attention projections of all layers together;
this error ranks layer 0's dense MLP first, as that KL does.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BUDGET_FLAG = "--gpu-mix-budget"


@dataclass(frozen=True)
class Measured:
    name: str
    weights: int           # N x K (logical)
    error: float           # mean relative residual-stream error with this Linear quantized alone
    score: float           # error removed per added bit


def measure(encoder, upgrade_bits: int) -> list[Measured]:
    """Run the sensitivity pass over `encoder`'s source (a calibrated GpuLayerEncoder) -> every candidate Linear."""
    from ktconvert.gpu.calib import make_calibrator

    src, opts = encoder.src, encoder.opts
    cands = set(encoder.upgrade_candidates(upgrade_bits))
    out: list[Measured] = []

    def is_target(hub: str) -> bool:
        return hub in cands

    @torch.no_grad()
    def on_layer(li, linears, hessians, ref, forward):
        ref = ref.float()
        ref_norm = ref.pow(2).sum(-1).clamp_min(1e-30)
        for hub, mod in linears.items():
            w0 = mod.weight.detach().clone()
            q = encoder.quantize_calibrated(hub, w0, hessians[hub])
            mod.weight.copy_(q.dequantize()[: mod.out_features, : mod.in_features].to(mod.weight.dtype))
            y = forward().float()
            mod.weight.copy_(w0)
            err = float(((y - ref).pow(2).sum(-1) / ref_norm).mean())
            n = mod.out_features * mod.in_features
            gained = err * (1 - 4.0 ** -(upgrade_bits - encoder.bits_of(hub)))
            out.append(Measured(hub, n, err, gained / ((upgrade_bits - encoder.bits_of(hub)) * n)))
            log.debug("sensitivity layer %d %s: error %.3g", li, hub, err)

    cal = make_calibrator(src, opts.calib, opts.calib_tokens, opts.seq_len, opts.seed, lambda *a: None, is_target)
    cal.on_layer = on_layer
    if cands:
        cal.run_layers(max(src.arch.classify(n).layer for n in cands))
    return out


def choose(measured: list[Measured], bits_of, upgrade_bits: int, budget: float, total_weights: int) -> list[str]:
    """Greedy by error removed per added bit within budget * total_weights added bits -> the names to upgrade."""
    left = budget * total_weights
    chosen = []
    for m in sorted(measured, key=lambda m: (-m.score, m.name)):
        cost = (upgrade_bits - bits_of(m.name)) * m.weights
        if cost <= left:
            chosen.append(m.name)
            left -= cost
    return chosen


def added_bytes_bound(encoder, budget: float, method: str) -> int:
    """Most tensor bytes the measured rule can add to the GPU files, known before it measures (`ktconvert inspect`):
    whatever choose() picks spends at most budget x decoder_weights() added logical bits, and each candidate adds
    its stored bytes at `method`'s bits minus at its own (Marlin's zero padding, gptq's wider qzeros included), so
    no choice adds more than the fractional knapsack (the candidates by added bytes per added bit, the last one
    only in part). Without padding that is budget x weights / 8 bytes. The files' headers are not counted."""
    upgrade_bits = encoder.method_algo(method)[1]
    items = []                   # (added logical bits, added file bytes) per candidate Linear
    for name in encoder.upgrade_candidates(upgrade_bits):
        n, k = encoder.src.info(name).shape
        bits = encoder.bits_of(name)
        items.append(((upgrade_bits - bits) * int(n) * int(k),
                      encoder.stored_nbytes(name, upgrade_bits) - encoder.stored_nbytes(name, bits)))
    left, bound = budget * encoder.decoder_weights(), 0.0
    for cost, added in sorted(items, key=lambda it: -it[1] / it[0]):
        share = min(1.0, left / cost)
        bound += share * added
        left -= share * cost
        if left <= 0:
            break
    return math.ceil(bound)


def sensitive_rules(encoder, budget: float, method: str) -> tuple[tuple[str, str], ...]:
    """The --gpu-method-for rules the measured rule adds to `encoder` (exact names -> `method`)."""
    upgrade_bits = encoder.method_algo(method)[1]
    measured = measure(encoder, upgrade_bits)
    total = encoder.decoder_weights()
    chosen = choose(measured, encoder.bits_of, upgrade_bits, budget, total)
    ranked = sorted(measured, key=lambda m: -m.score)
    log.info("GPU layers: %s %g with %s: measured %d Linears; most sensitive per added bit: %s", BUDGET_FLAG, budget,
             method, len(measured), ", ".join(f"{m.name} (error {m.error:.2e})" for m in ranked[:5]))
    added = sum((upgrade_bits - encoder.bits_of(n)) * m.weights for n in chosen for m in measured if m.name == n)
    log.info("GPU layers: upgraded to %s: %s (%.3f added bits per GPU-layer weight)", method,
             ", ".join(chosen) or "none", added / max(total, 1))
    return tuple((name, method) for name in chosen)
