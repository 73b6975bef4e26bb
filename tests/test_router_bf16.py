"""Routers on the checkpoint's bfloat16 gate (ABI 25: kt_route_sigmoid / kt_route_softmax's w_dtype,
kt_moe_decode_args.gate_dtype): the CPU loader keeps a bf16 `*.gate.weight` as stored and the kernels widen it in their
dot products. bf16 -> float32 is exact, so every logit is the product-sum of the float32 copy in the same order: the
ids and weights must be the float32 gate's bits, on the calling thread and on the pool, and a converted model's logits
(prompt, decode steps, the one-call step) the bits of the same model with its routers widened. Half the router bytes
a decode step reads (decode_bytes counts them)."""
from __future__ import annotations

import pytest
import torch
from ktrun.cli.decode_bytes import weight_bytes_per_token
from ktrun.generate import decode_one_token, prefill
from ktrun.ops import glue
from ktrun.ops.library import KernelError
from one_call_helpers import absorbed_conversion
from runtime_helpers import PROMPT, converted

# (experts, groups, groups kept, top-k, hidden): DeepSeek-V3's gate (on the pool), Qwen3-30B-A3B's (the pool's
# threshold), a small one (the calling thread)
GATES = [(256, 8, 4, 8, 7168), (128, 1, 1, 8, 2048), (64, 1, 1, 6, 1024)]


def _routes(x, w, bias, n_group, topk_group, top_k):
    return (glue.route_sigmoid(x, w, bias, n_group, topk_group, top_k, True, 2.5),
            glue.route_softmax(x, w, n_group, topk_group, top_k, True, 1.0))


@pytest.mark.parametrize("E,n_group,topk_group,top_k,K", GATES)
@pytest.mark.parametrize("T", [1, 5])
def test_a_bf16_gate_gives_its_float32_copys_bits(kernel_pool, E, n_group, topk_group, top_k, K, T):
    g = torch.Generator().manual_seed(7 * E + K + T)
    x = torch.randn(T, K, generator=g)
    w16 = (torch.randn(E, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    bias = torch.randn(E, generator=g) / 10
    assert glue.route_sigmoid_supported(x, w16, bias)
    for pool in (None, kernel_pool):
        with glue.routers_on(pool):
            want = _routes(x, w16.float(), bias, n_group, topk_group, top_k)
            got = _routes(x, w16, bias, n_group, topk_group, top_k)
        for (iw, ww), (ig, wg) in zip(want, got):
            assert torch.equal(iw, ig) and torch.equal(ww, wg)
    # and the choice is the float64 reference's where it is clear (the 8th best against the 9th by a margin)
    logits = x.double() @ w16.double().T
    if n_group == 1:
        top = logits.softmax(-1).topk(top_k + 1, dim=-1)
        clear = (top.values[:, top_k - 1] - top.values[:, top_k]) > 1e-4
        assert torch.equal(got[1][0][clear].sort(-1).values, top.indices[clear, :top_k].sort(-1).values)


def test_other_gate_dtypes_are_refused(kernel_pool):
    x = torch.randn(1, 64)
    w = torch.randn(8, 64).half()
    assert not glue.route_sigmoid_supported(x, w, None)
    lib = glue._library()
    ids = torch.empty((1, 2), dtype=torch.int64)
    wts = torch.empty((1, 2), dtype=torch.float32)
    for fn, extra in ((lib.kt_route_sigmoid, (None,)), (lib.kt_route_softmax, ())):
        args = (None, 1, 8, 64, x.data_ptr(), 64, w.data_ptr(), 2, 64, *extra, 1, 1, 2, 1, 1.0, ids.data_ptr(),
                wts.data_ptr())
        assert fn(*args) == -1
    with pytest.raises(KernelError, match="kt_route_softmax"):     # a bf16 gate's other checks still hold
        glue.route_softmax(x, w.bfloat16(), 3, 1, 2, True, 1.0)          # 8 experts in 3 groups


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_model_with_bf16_routers_gives_the_widened_routers_logits(tmp_path_factory, request, arch):
    """The loader keeps the fixture's bf16 routers as stored; the model's logits over a prompt and decode steps (the
    one-call step after the first) equal those of the same model with every router widened to float32."""
    from ktrun.loaded_model import load_model

    src = absorbed_conversion(tmp_path_factory, arch) if arch == "deepseek_v3" else \
        converted(tmp_path_factory, arch, "int4-amx", gpu_method="rtn-int4")     # MLA on the kernels: rank 64
    lm = load_model(src, device="cpu", dtype=torch.float32)
    request.addfinalizer(lm.close)
    m = lm.model
    gates = {n: t for n, t in m.w.items() if n.endswith(".gate.weight")}
    assert gates and all(t.dtype == torch.bfloat16 for t in gates.values())
    ids = lm.tokenizer.encode(PROMPT)[:12]

    def run():
        m.moe_plans, m.step_plan = {}, None          # plans hold the gate they were made with
        cache = m.new_cache(64)
        out = [prefill(m, cache, ids)]
        for _ in range(5):
            out.append(decode_one_token(m, cache, int(torch.argmax(out[-1]))))
        cache.release()
        return out

    stored = run()
    assert m.step_plan is not None                   # the decode steps took the one call
    read16 = weight_bytes_per_token(m, lm.converted)["dense"]
    m.w.update({n: t.float() for n, t in gates.items()})
    widened = run()
    for a, b in zip(stored, widened):
        assert torch.equal(a, b)
    assert weight_bytes_per_token(m, lm.converted)["dense"] - read16 == sum(t.numel() * 2 for t in gates.values())
