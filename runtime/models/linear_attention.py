"""Gated DeltaNet linear attention (Qwen3-Next), plain torch, one request at a time over a varlen batch.

Per layer and request the state is (conv window, S): the last kernel-1 inputs of the causal depthwise conv over the
q|k|v channels, and S (v_heads, dk, dv) in float32. Per token t (q, k L2-normalized, q scaled by dk^-1/2):
    S <- exp(g_t) S;  u_t = beta_t (v_t - k_t S);  S <- S + k_t^T u_t;  o_t = q_t S
`delta_rule_recurrent` runs that loop as written (decode: one token). `delta_rule_chunked` (prefill) computes the
same in chunks of C tokens: with gamma the in-chunk cumulative log decay and S0 the state entering the chunk,
    u = (I + A)^-1 (beta*v - beta*exp(gamma)*k S0),   A[t, s] = beta_t exp(gamma_t - gamma_s) k_t.k_s  (s < t)
    o_t = exp(gamma_t) q_t S0 + sum_{s <= t} exp(gamma_t - gamma_s) (q_t.k_s) u_s
    S_C = exp(gamma_C) S0 + sum_s exp(gamma_C - gamma_s) k_s^T u_s
(the unit lower-triangular solves do not depend on S0, so they run for every chunk at once).
With the prefix cache a request's recurrence is cut at the block ends whose state it keeps (SeqCache.snap_at): the
pieces chain through the state, so only the grouping of the float sums changes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ktlayouts.families import ModelConfig

from ..ops.packed_linear import linear
from .kv_cache import Batch

CHUNK = 64   # tokens per chunk of the chunked delta rule (prefill)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the reference's eps placement)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """q, k: (L, h, dk); v: (L, h, dv); g, beta: (L, h); state (h, dk, dv) float32 -> (o (L, h, dv) float32,
    new state). q and k already L2-normalized and q scaled."""
    S = state.clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        u = (v[t] - torch.einsum("hk,hkv->hv", k[t], S)) * beta[t][:, None]
        S = S + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return out, S


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Same arguments and result as delta_rule_recurrent, C = chunk tokens at a time (see the module docstring)."""
    L, h = k.shape[:2]
    dv = v.shape[-1]
    pad = (-L) % chunk
    # padded tokens: k = v = 0, beta = 0, g = 0 -> no update and no decay, so the final state is unchanged
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    n = (L + pad) // chunk
    # (h, n, C, d): heads first, then chunks
    q, k, v = (t.view(n, chunk, h, -1).permute(2, 0, 1, 3) for t in (q, k, v))
    g, beta = (t.view(n, chunk, h).permute(2, 0, 1) for t in (g, beta))
    gamma = g.cumsum(-1)                                                       # (h, n, C)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()                                                        # exp(gamma_t - gamma_s), s <= t
    eye = torch.eye(chunk, dtype=torch.float32, device=q.device)
    a = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay * (1 - eye)   # strictly lower
    m = eye + a
    w_v = torch.linalg.solve_triangular(m, beta[..., None] * v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(m, (beta * gamma.exp())[..., None] * k, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay                                    # (h, n, C, C)
    q_in = q * gamma.exp()[..., None]                                         # reads S0
    k_out = k * (gamma[..., -1:] - gamma).exp()[..., None]                    # writes S_C
    chunk_decay = gamma[..., -1].exp()                                        # (h, n)
    S = state.clone()
    out = torch.empty((h, n, chunk, dv), dtype=torch.float32, device=q.device)
    for i in range(n):
        u = w_v[:, i] - w_k[:, i] @ S                                         # (h, C, dv)
        out[:, i] = q_in[:, i] @ S + qk[:, i] @ u
        S = S * chunk_decay[:, i, None, None] + k_out[:, i].transpose(-1, -2) @ u
    return out.permute(1, 2, 0, 3).reshape(n * chunk, h, dv)[:L], S


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim scaled by weight, times silu(gate) (in float32), in x's dtype."""
    dt = x.dtype
    h = x.float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    return (h * F.silu(gate.float())).to(dt)


def causal_depthwise_conv(xin: torch.Tensor, taps: torch.Tensor, n: int) -> torch.Tensor:
    """xin (kernel-1 + n, C): the window then n new inputs; taps (kernel, C) -> (n, C), out[t] = sum_j taps[j] *
    xin[t + j]. Written as kernel shifted multiply-adds: at decode (n = 1) F.conv1d's depthwise path costs ~1000x
    the arithmetic (mkldnn setup per call)."""
    out = xin[:n] * taps[0]
    for j in range(1, taps.shape[0]):
        out = out + xin[j:j + n] * taps[j]
    return out


def state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A request's state in one linear-attention layer: conv window (kernel-1, conv_dim), S (v_heads, dk, dv)."""
    la = cfg.linear_attention
    return (la.conv_kernel - 1, la.conv_dim), (la.num_v_heads, la.k_head_dim, la.v_head_dim)


def request_state(s, layer: int, conv_shape, s_shape, conv_dtype: torch.dtype, device) -> tuple:
    """One request's (conv window, recurrent state S) of a linear-attention layer: the cached one, or zeros at
    position 0; a request continuing elsewhere without it is an error (the state cannot be rebuilt from KV blocks)."""
    state = s.cache.recurrent.get(layer)
    if state is not None:
        return state
    if s.start != 0:
        raise RuntimeError(f"layer {layer}: request continues at position {s.start} without its recurrent state (a "
                           f"linear-attention cache cannot be rebuilt from KV blocks)")
    return (torch.zeros(conv_shape, dtype=conv_dtype, device=device),
            torch.zeros(s_shape, dtype=torch.float32, device=device))


def project_fused(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor):
    """Qwen3-Next's fused input projections -> mixed (T, conv_dim) in q|k|v order, z (T, nv, dv), b, a (T, nv)."""
    la = cfg.linear_attention
    T, nk, nv, dk, dv = x.shape[0], la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim
    r = nv // nk
    # in_proj_qkvz rows are grouped per key head: [q (dk), k (dk), v (r*dv), z (r*dv)]; in_proj_ba: [b (r), a (r)]
    qkvz = linear(x, w[p + "in_proj_qkvz.weight"]).view(T, nk, 2 * dk + 2 * r * dv)
    q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
    b, a = torch.split(linear(x, w[p + "in_proj_ba.weight"]).view(T, nk, 2 * r), [r, r], dim=-1)
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)     # (T, conv_dim)
    return mixed, z.reshape(T, nv, dv), b.reshape(T, nv), a.reshape(T, nv)


def project_split(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor):
    """Qwen3.5's four plain projections: in_proj_qkv is already q|k|v (the conv's order); z, b, a by themselves."""
    la = cfg.linear_attention
    T = x.shape[0]
    mixed = linear(x, w[p + "in_proj_qkv.weight"])                                        # (T, conv_dim)
    z = linear(x, w[p + "in_proj_z.weight"]).view(T, la.num_v_heads, la.v_head_dim)
    return mixed, z, linear(x, w[p + "in_proj_b.weight"]), linear(x, w[p + "in_proj_a.weight"])


def gated_deltanet(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int,
                   project=project_fused) -> torch.Tensor:
    """x: (T, H) -> (T, H). p: this layer's linear_attn prefix, e.g. 'model.layers.0.linear_attn.'. project: how
    the family lays out the input projections (project_fused: Qwen3-Next, project_split: Qwen3.5)."""
    la = cfg.linear_attention
    T, nk, nv, dk, dv = x.shape[0], la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim
    r = nv // nk
    mixed, z, b, a = project(cfg, w, p, x)
    beta = b.sigmoid().float()
    g = -w[p + "A_log"].float().exp() * F.softplus(a.float() + w[p + "dt_bias"].float())
    conv_w = w[p + "conv1d.weight"]                                             # (conv_dim, 1, kernel)
    taps = conv_w[:, 0].t()                                                     # (kernel, conv_dim)
    conv_shape, s_shape = state_shapes(cfg)
    core = torch.empty((T, nv, dv), dtype=x.dtype, device=x.device)
    K1 = conv_shape[0]
    for s in batch.seqs:
        rows = slice(s.offset, s.offset + s.n)
        window, S = request_state(s, layer, conv_shape, s_shape, conv_w.dtype, x.device)
        xin = torch.cat([window, mixed[rows].to(conv_w.dtype)], dim=0)           # (K-1 + n, conv_dim)
        conv = causal_depthwise_conv(xin, taps, s.n)                             # (n, conv_dim)
        conv = F.silu(conv).to(x.dtype)
        qc, kc, vc = torch.split(conv, [nk * dk, nk * dk, nv * dv], dim=-1)
        qc = l2_normalize(qc.reshape(s.n, nk, dk).float()).repeat_interleave(r, dim=1) * dk ** -0.5
        kc = l2_normalize(kc.reshape(s.n, nk, dk).float()).repeat_interleave(r, dim=1)
        vc = vc.reshape(s.n, nv, dv).float()
        gs, bs = g[rows], beta[rows]
        # the recurrence runs in pieces ending at the positions the cache wants a snapshot of (prefix cache); one at
        # this forward's start (a prompt prefilled in several forwards) is the state it starts from
        if s.start in s.cache.snap_at:
            s.cache.snaps.setdefault(s.start, {})[layer] = (window, S)
        cuts = sorted(p - s.start for p in s.cache.snap_at if s.start < p < s.start + s.n) + [s.n]
        a = 0
        for c in cuts:
            rule = delta_rule_recurrent if c - a == 1 else delta_rule_chunked
            o, S = rule(qc[a:c], kc[a:c], vc[a:c], gs[a:c], bs[a:c], S)
            core[s.offset + a:s.offset + c] = o.to(x.dtype)
            if c < s.n:                                                          # the window after c new inputs
                s.cache.snaps.setdefault(s.start + c, {})[layer] = (xin[c:c + K1].clone(), S)
            a = c
        s.cache.recurrent[layer] = (xin[xin.shape[0] - K1:].clone(), S)
    out = gated_rms_norm(core, w[p + "norm.weight"], z, cfg.rms_norm_eps)        # (T, nv, dv)
    return linear(out.reshape(T, nv * dv), w[p + "out_proj.weight"])
