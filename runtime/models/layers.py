"""Building blocks shared by the model forwards: RMSNorm, RoPE (default and YaRN), dense SwiGLU MLP.

Numerics follow the transformers reference: norms in float32, RoPE tables in float32 then cast to the compute
dtype, router math in float32.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from ktlayouts.families import RopeConfig, yarn_mscale

from ..ops import glue
from ..ops.kernel_linear import KernelLinear, run_together
from ..ops.packed_linear import linear

SERIAL_MAX_ROWS = 8   # token rows up to which serial_torch() keeps a forward's small torch ops on the calling thread
# activations (rows x hidden floats) up to which a whole CPU forward keeps torch on the calling thread when its dense
# Linears run on the kernels (MoEModel.decoder; torch then computes glue only): a short prompt's ops are too small
# to pay for waking torch's OpenMP team beside the kernel pool's workers (the default model's 60-token prefill:
# 23-50 ms with 2 torch threads, 5.4-6.1 ms with 1, on 2 Zen 4 cores)
SERIAL_MAX_ELEMENTS = 1 << 16
LORA_NORM_EPS = 1e-6     # MLA's q_a_layernorm / kv_a_layernorm: the reference's default eps, not rms_norm_eps
ROPE_TABLE_STEP = 1024   # positions the cos/sin table grows by (a multiple of 16: no scalar tail, see Rope._table)


@contextlib.contextmanager
def serial_torch(on: bool = True):
    """Run the torch ops of the block on the calling thread only (when on). For decode-sized glue: an op above torch's
    grain (32768 elements, e.g. MLA's (128, 1, 576) absorbed query) or an MKL matmul opens a parallel region, which
    wakes the sleeping OpenMP team (OMP_WAIT_POLICY=PASSIVE, so idle threads leave the cores to the expert kernels):
    ~80 us per op on an idle 2-core machine against ~9 us serial, several hundred when the other core is busy.
    Only for ops whose results do not depend on the thread count (elementwise ops; matmuls of the shapes used, checked
    equal: tests/test_runtime_serial_torch.py), so a token's bits do not depend on the batch it runs in."""
    n = torch.get_num_threads()
    if not on or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., D). Normalize in float32, cast back, then scale (transformers order). float32 x and weight: torch's
    one fused op, the same float32 operations in the same order (bit-identical, checked in
    tests/test_runtime_serial_torch.py), one op instead of seven: a decode step runs 13 norms. On the CPU that op
    is itself 8 aten ops: libktkernels' kt_rms_norm computes the same bits in one call (ktrun.ops.glue)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if glue.supported(x, weight):
            return glue.rms_norm(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dt)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x + delta, rms_norm(x + delta, weight, eps)): a residual add and the next norm, in one kt_rms_norm call
    for float32 CPU rows (the same bits as the two torch ops: ktrun.ops.glue)."""
    if (delta.shape == x.shape and delta.dtype == x.dtype and delta.device == x.device and delta.stride(-1) == 1
            and glue.supported(x, weight)):
        return glue.add_rms_norm(x, delta, weight, eps)
    s = x + delta
    return s, rms_norm(s, weight, eps)


def linears(x: torch.Tensor, ws: list, biases: list | None = None) -> list[torch.Tensor]:
    """x (..., K) through several Linears (tensors or packed) -> their outputs. On the CPU kernels, Linears sharing
    the input (same K and group: gate + up, q_a + kv_a) run in one submission (x quantized once, one job)."""
    if len(ws) > 1 and all(isinstance(w, KernelLinear) and ws[0].shares_input_with(w) for w in ws):
        ys = run_together(ws, x)          # a KernelLinear adds its bias after the op as well: the same bits
        return ys if biases is None else [y if b is None else y + b for y, b in zip(ys, biases)]
    return [linear(x, w, b) for w, b in zip(ws, biases or [None] * len(ws))]   # (torch fuses the bias: addmm)


def swiglu_mlp(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    """x: (T, H); gate/up: (I, H); down: (H, I) (tensors or packed Linears). On the CPU kernels gate and up run
    in one submission (x quantized once)."""
    g, u = linears(x, [gate, up])
    return linear(F.silu(g) * u, down)


# --- RoPE -----------------------------------------------------------------------------------------

def rope_inv_freq(r: RopeConfig) -> tuple[torch.Tensor, float]:
    """-> (inv_freq (dim/2,) float32, attention factor applied to cos/sin)."""
    dim = r.dim
    pos_freqs = r.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if r.kind == "default":
        return 1.0 / pos_freqs, 1.0
    # YaRN: blend interpolated and extrapolated frequencies with a linear ramp over the correction range.
    if r.attention_factor is not None:
        attn = float(r.attention_factor)
    elif r.mscale and r.mscale_all_dim:
        attn = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
    else:
        attn = yarn_mscale(r.factor)

    def corr_dim(rot: float) -> float:
        return dim * math.log(r.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = corr_dim(r.beta_fast), corr_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    inv = (1.0 / (r.factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, attn


class Rope:
    """cos/sin for given positions. Interleaved (DeepSeek) rotates pairs (x[2i], x[2i+1]); else halves."""

    def __init__(self, r: RopeConfig, device=None):
        inv, self.attn_factor = rope_inv_freq(r)
        self.inv_freq = inv.to(device)
        self.interleaved = r.interleaved
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}   # dtype -> cos, sin (P, dim/2)

    def _table(self, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions 0 .. >= n, computed once (grown in steps of ROPE_TABLE_STEP positions). Each entry
        comes from the same elementwise ops whatever the table's size: one thread (no chunk boundaries) over a
        multiple of 16 elements (no scalar tail), so a position's cos/sin are the same bits in every forward, however
        many tokens it has. A decode step's cos/sin were ~8 torch ops, ~100 us with cold caches; now one lookup."""
        t = self._tables.get(dtype)
        if t is None or t[0].shape[0] < n:
            P = -(-max(n, 1) // ROPE_TABLE_STEP) * ROPE_TABLE_STEP
            with serial_torch():
                pos = torch.arange(P, device=self.inv_freq.device)
                freqs = pos[:, None].float() * self.inv_freq[None, :]
                t = self._tables[dtype] = ((freqs.cos() * self.attn_factor).to(dtype),
                                           (freqs.sin() * self.attn_factor).to(dtype))
        return t

    def cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) -> cos, sin: (T, dim/2): on the CPU rows of the table (_table); elsewhere computed (no
        device-to-host read of the positions per forward)."""
        if positions.device.type != "cpu":
            freqs = positions[:, None].float() * self.inv_freq[None, :]
            return (freqs.cos() * self.attn_factor).to(dtype), (freqs.sin() * self.attn_factor).to(dtype)
        if positions.numel() == 1:                          # decode: a view of the row, no gather
            p = int(positions[0])
            cos, sin = self._table(p + 1, dtype)
            return cos[p:p + 1], sin[p:p + 1]
        cos, sin = self._table(int(positions.max()) + 1 if positions.numel() else 0, dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              interleaved: bool | None = None) -> torch.Tensor:
        """x: (T, heads, D); cos/sin: (T, dim/2). The first dim of the D dims are rotated, the rest pass through
        (partial rotary: GLM, MiniMax-M2). Interleaved output keeps pair order as [evens', odds'] — a fixed
        permutation applied to both q and k, so q.k is the same as with interleaved output. interleaved=None: this
        model's layout (DeepSeek-V3.2's indexer ropes halves although its MLA ropes pairs)."""
        dim = 2 * cos.shape[-1]
        if glue.rope_supported(x, cos, sin):      # float32 CPU: the same bits in one call
            return glue.rope(x, cos, sin, self.interleaved if interleaved is None else interleaved)
        if x.shape[-1] > dim:
            return torch.cat([self.apply(x[..., :dim], cos, sin, interleaved), x[..., dim:]], dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        if self.interleaved if interleaved is None else interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            h = x.shape[-1] // 2
            x1, x2 = x[..., :h], x[..., h:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
