"""Qwen3-Next's gated delta rule (chunked and recurrent) against transformers' torch implementations. The hybrid
stack, the engine's per-request state, the KV blocks, bf16 and GPTQ are checked for Qwen3-Next and Qwen3.5-MoE
alike in tests/test_hybrid_runtime.py."""
from __future__ import annotations

import pytest
import torch
from ktrun.models.linear_attention import delta_rule_chunked, delta_rule_recurrent, l2_normalize

# both sides compute in float32 from identical bf16 weights (observed max |logit diff| ~4e-6 at logit scale ~7)
LOGIT_ATOL = 1e-4
DELTA_ATOL = 1e-4   # float32 delta rule, chunked vs per-token orders of summation (observed ~1e-6)


def _inputs(L: int, h: int = 4, dk: int = 16, dv: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(L, h, dk, generator=gen), torch.randn(L, h, dk, generator=gen)
    v = torch.randn(L, h, dv, generator=gen)
    g = -torch.rand(L, h, generator=gen) * 0.5             # log decay <= 0
    beta = torch.rand(L, h, generator=gen)
    s0 = torch.randn(h, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("L, chunk", [(1, 64), (5, 64), (64, 64), (100, 32), (37, 8)])
def test_delta_rule_matches_transformers(L, chunk):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )
    q, k, v, g, beta, s0 = _inputs(L)
    # transformers: (B, L, h, d) raw q/k, L2-normalized and scaled inside
    want_o, want_s = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=
                                                      s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_c, want_cs = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], chunk_size=chunk,
                                                   initial_state=s0[None], output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    qn, kn = l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)
    for o, s in (delta_rule_recurrent(qn, kn, v, g, beta, s0), delta_rule_chunked(qn, kn, v, g, beta, s0, chunk)):
        for a, b in ((o, want_o[0]), (s, want_s[0]), (o, want_c[0]), (s, want_cs[0])):
            assert (a - b).abs().max() < DELTA_ATOL
