"""Kimi Delta Attention (Kimi Linear's linear-attention layers), plain torch, one request at a time over a varlen batch.

KDA is gated DeltaNet (linear_attention.py) with a decay per key channel instead of per head. Per layer and request
the state is (conv window, S): the last kernel-1 inputs of the causal depthwise conv over the q|k|v channels and S
(heads, dk, dv) in float32. Per token t (q, k L2-normalized, q scaled by dk^-1/2; g_t (heads, dk) log decays <= 0):
    S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - k_t S);  S <- S + k_t^T u_t;  o_t = q_t S
`kda_recurrent` runs that loop as written (decode). `kda_chunked` (prefill) computes the same C tokens at a time:
with gamma_t (dk,) the in-chunk cumulative log decay through token t and S0 the state entering the chunk,
    u = (I + A)^-1 (beta*v - beta*(k*exp(gamma)) S0),  A[t, s] = beta_t sum_d k_t[d] k_s[d] exp(gamma_t[d] - gamma_s[d])
    o_t = (q_t*exp(gamma_t)) S0 + sum_{s <= t} (sum_d q_t[d] k_s[d] exp(gamma_t[d] - gamma_s[d])) u_s
    S_C = exp(gamma_C) * S0 + sum_s (k_s*exp(gamma_C - gamma_s))^T u_s
Every exponent is <= 0 (no overflow whatever the decays); the per-channel pair decays make a (heads, C, C, dk) tensor
per chunk, so chunks are kept short (CHUNK). With the prefix cache a request's recurrence is cut at the block ends
whose state it keeps (SeqCache.snap_at), as for the gated DeltaNet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ktlayouts.families import ModelConfig

from ..ops.packed_linear import linear
from .kv_cache import Batch
from .linear_attention import causal_depthwise_conv, l2_normalize, request_state, state_shapes

CHUNK = 32   # tokens per chunk of the chunked rule: its pair-decay tensor is heads x C x C x dk floats


def kda_recurrent(q, k, v, g, beta, state):
    """q, k: (L, h, dk); v: (L, h, dv); g: (L, h, dk) log decays; beta: (L, h); state (h, dk, dv) float32 ->
    (o (L, h, dv) float32, new state). q and k already L2-normalized and q scaled."""
    S = state.clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, :, None]
        u = (v[t] - torch.einsum("hk,hkv->hv", k[t], S)) * beta[t][:, None]
        S = S + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return out, S


def kda_chunked(q, k, v, g, beta, state, chunk: int = CHUNK, position: int = 0):
    """Same arguments and result as kda_recurrent, `chunk` tokens at a time (the module docstring's form). position:
    the first token's position in its request; chunks end at multiples of `chunk` positions, so a prompt split into
    several forwards (or cut at a snapshot) is summed in the same chunks wherever the pieces allow."""
    S = state.clone()
    L = k.shape[0]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    a = 0
    while a < L:
        b = min(a + chunk - (position + a) % chunk, L)
        C = b - a
        qc, kc, vc = (t[a:b].transpose(0, 1) for t in (q, k, v))               # (h, C, d)
        gamma = g[a:b].transpose(0, 1).cumsum(1)                                # (h, C, dk)
        bc = beta[a:b].t()                                                      # (h, C)
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = (gamma[:, :, None, :] - gamma[:, None, :, :]).masked_fill(~lower[None, :, :, None], float("-inf"))
        kd = diff.exp() * kc[:, None, :, :]                                    # (h, C, C, dk): k_s exp(g_t - g_s)
        kk = torch.einsum("htd,htsd->hts", kc, kd)                             # (h, C, C), s <= t
        qk = torch.einsum("htd,htsd->hts", qc, kd)
        eye = torch.eye(C, dtype=torch.float32, device=q.device)
        m = eye + bc[:, :, None] * kk * (1 - eye)                              # unit lower triangular
        w_v = torch.linalg.solve_triangular(m, bc[..., None] * vc, upper=False, unitriangular=True)
        w_k = torch.linalg.solve_triangular(m, bc[..., None] * kc * gamma.exp(), upper=False, unitriangular=True)
        u = w_v - w_k @ S                                                       # (h, C, dv)
        out[a:b] = ((qc * gamma.exp()) @ S + qk @ u).transpose(0, 1)
        last = gamma[:, -1:, :]                                                 # (h, 1, dk)
        S = S * last.transpose(1, 2).exp() + (kc * (last - gamma).exp()).transpose(1, 2) @ u
        a = b
    return out, S


def forget_gate(w: dict, p: str, x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """x (T, H) -> per-channel log decays (T, heads, head_dim) float32: -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)
    (softplus linear past 20, as the reference)."""
    T = x.shape[0]
    f = linear(linear(x, w[p + "f_a_proj.weight"]), w[p + "f_b_proj.weight"]).float() + w[p + "dt_bias"].float()
    f = f.view(T, heads, head_dim)
    soft = torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))
    return -w[p + "A_log"].float().reshape(1, heads, 1).exp() * soft


def sigmoid_gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, weight and sigmoid(gate) applied in float32, cast to x's dtype (the reference's
    order: unlike the DeltaNet's gated norm, no cast before the weight and a sigmoid gate, not silu)."""
    h = x.float()
    h = weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
    return (h * torch.sigmoid(gate.float())).to(x.dtype)


def _conv_taps(w: dict, p: str) -> torch.Tensor:
    """The three short convs' weights (C, 1, kernel) as taps (kernel, 3C) over q|k|v, derived once per layer."""
    key = p + "qkv_conv.taps"
    if key not in w:
        conv = torch.cat([w[p + f"{n}_conv1d.weight"] for n in "qkv"], dim=0)      # (3C, 1, kernel)
        w[key] = conv[:, 0].t().contiguous()
    return w[key]


def kda_attention(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int) -> torch.Tensor:
    """x: (T, H) -> (T, H). p: this layer's self_attn prefix, e.g. 'model.layers.0.self_attn.'."""
    la = cfg.linear_attention
    T, nh, d = x.shape[0], la.num_v_heads, la.k_head_dim
    mixed = torch.cat([linear(x, w[p + f"{n}_proj.weight"]) for n in "qkv"], dim=-1)   # (T, 3 nh d)
    g = forget_gate(w, p, x, nh, d)                                                      # (T, nh, d)
    beta = linear(x, w[p + "b_proj.weight"]).float().sigmoid()                          # (T, nh)
    taps = _conv_taps(w, p)                                                              # (kernel, 3 nh d)
    conv_shape, s_shape = state_shapes(cfg)
    K1 = conv_shape[0]
    core = torch.empty((T, nh, d), dtype=x.dtype, device=x.device)
    for s in batch.seqs:
        rows = slice(s.offset, s.offset + s.n)
        window, S = request_state(s, layer, conv_shape, s_shape, taps.dtype, x.device)
        xin = torch.cat([window, mixed[rows].to(taps.dtype)], dim=0)                     # (K-1 + n, 3 nh d)
        conv = F.silu(causal_depthwise_conv(xin, taps, s.n)).to(x.dtype)
        qc, kc, vc = (t.reshape(s.n, nh, d).float() for t in torch.split(conv, nh * d, dim=-1))
        qc, kc = l2_normalize(qc) * d ** -0.5, l2_normalize(kc)
        gs, bs = g[rows], beta[rows]
        # pieces ending where the prefix cache wants a snapshot (as linear_attention.gated_deltanet)
        if s.start in s.cache.snap_at:
            s.cache.snaps.setdefault(s.start, {})[layer] = (window, S)
        cuts = sorted(c - s.start for c in s.cache.snap_at if s.start < c < s.start + s.n) + [s.n]
        a = 0
        for c in cuts:
            if c - a == 1:
                o, S = kda_recurrent(qc[a:c], kc[a:c], vc[a:c], gs[a:c], bs[a:c], S)
            else:
                o, S = kda_chunked(qc[a:c], kc[a:c], vc[a:c], gs[a:c], bs[a:c], S, position=s.start + a)
            core[s.offset + a:s.offset + c] = o.to(x.dtype)
            if c < s.n:
                s.cache.snaps.setdefault(s.start + c, {})[layer] = (xin[c:c + K1].clone(), S)
            a = c
        s.cache.recurrent[layer] = (xin[xin.shape[0] - K1:].clone(), S)
    gate = linear(linear(x, w[p + "g_a_proj.weight"]), w[p + "g_b_proj.weight"]).view(T, nh, d)
    out = sigmoid_gated_rms_norm(core, w[p + "o_norm.weight"], gate, cfg.rms_norm_eps)   # (T, nh, d)
    return linear(out.reshape(T, nh * d), w[p + "o_proj.weight"])
