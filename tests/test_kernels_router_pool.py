"""The routers' logits on the kernel pool (ABI 16: kt_route_sigmoid / kt_route_softmax take a context; MoEModel runs
its routers inside ktrun.ops.glue.routers_on(its kernels)): a gate of 2^18 floats or more has its experts' rows split
between the pool's workers, each expert's dot products computed whole by one of them, so ids and weights are the bits
the calling thread alone gives, for any token count; a small gate stays on the calling thread."""
from __future__ import annotations

import pytest
import torch
from ktrun.ops import glue

# (experts, groups, groups kept, top-k, hidden): DeepSeek-V3's gate (256 x 7168, 7.3 MB), Qwen3-30B-A3B's (128 x
# 2048: exactly the threshold), one below it
GATES = [(256, 8, 4, 8, 7168), (128, 1, 1, 8, 2048), (64, 1, 1, 6, 1024)]


@pytest.mark.parametrize("E,n_group,topk_group,top_k,K", GATES)
@pytest.mark.parametrize("T", [1, 3, 8])
def test_pool_gives_the_calling_threads_bits(kernel_pool, E, n_group, topk_group, top_k, K, T):
    g = torch.Generator().manual_seed(E + K + T)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(E, K, generator=g) / K ** 0.5
    bias = torch.randn(E, generator=g) / 10
    alone = (glue.route_sigmoid(x, w, bias, n_group, topk_group, top_k, True, 2.5),
             glue.route_softmax(x, w, n_group, topk_group, top_k, True, 1.0))
    with glue.routers_on(kernel_pool):
        pooled = (glue.route_sigmoid(x, w, bias, n_group, topk_group, top_k, True, 2.5),
                  glue.route_softmax(x, w, n_group, topk_group, top_k, True, 1.0))
    for (ia, wa), (ip, wp) in zip(alone, pooled):
        assert torch.equal(ia, ip) and torch.equal(wa, wp)


def test_routers_on_is_scoped(kernel_pool):
    with glue.routers_on(kernel_pool):
        assert glue._router_handle() == kernel_pool.handle
        with glue.routers_on(None):
            assert glue._router_handle() is None
        assert glue._router_handle() == kernel_pool.handle
    assert glue._router_handle() is None
