"""kt_gptq_block (ABI 19; ktrun.ops.gptq_block): one block of GPTQ's column loop in one C call. Held to the torch
loop (ktconvert.gpu.gptq._block_reference) bit for bit: the same codes, scales and proxy loss for searched group
scales (every stored dtype, 4 and 8 bits, groups of 32 / 64 / 128), one scale per row, the two-level layout's fixed
second pass, with an output count that is not a multiple of the kernel's chunk, a last block shorter than the others,
a dead input and an all-zero row; the same bits from every ISA copy (the baseline copy is the scalar twin);
KTCONVERT_SEARCH=torch runs the torch loop; bad arguments refused."""
from __future__ import annotations

import hashlib

import pytest
import torch
from isa_copies import outputs_per_isa
from ktrun.ops import gptq_block as kernel
from ktrun.ops.library import KernelError, kernels_available

from ktconvert.gpu import gptq as G

pytestmark = pytest.mark.skipif(not kernels_available(), reason="libktkernels is not built")


def _layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (N, K) with an all-zero row and an outlier row, and the Hessian of T = 3K/2 inputs of uneven
    energy with one dead input channel."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[3] = 0.0
    w[5, :7] *= 40.0
    x = torch.randn(3 * k // 2, k, generator=g) * (torch.rand(k, generator=g) * 2 + 0.05)
    x[:, 9] = 0.0
    return w, 2.0 * x.T @ x / x.shape[0]


def _digest(q, loss) -> str:
    return hashlib.sha256(q.codes_kn.tobytes() + q.scales_gn.tobytes() + repr(loss).encode()).hexdigest()


CONFIGS = {
    "int4 g64 f16": G.GptqConfig(bits=4, group_size=64, scale_dtype="f16"),
    "int4 g32 bf16": G.GptqConfig(bits=4, group_size=32, scale_dtype="bf16"),
    "int8 g128 f32": G.GptqConfig(bits=8, group_size=128, scale_dtype="f32"),
    "int4 per row": G.GptqConfig(bits=4, group_size=-1, scale_dtype="f16"),
    "int4 sub6 (fixed second pass)": G.GptqConfig(bits=4, group_size=32, scale_dtype="sub6"),
    "int4 g64 block 64": G.GptqConfig(bits=4, group_size=64, block=64, scale_dtype="f16"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_the_torch_loop_bit_for_bit(name, monkeypatch):
    cfg = CONFIGS[name]
    k = 320 if 320 % max(cfg.group_size, 1) == 0 else 384   # K = 2.5 blocks of 128 where the group allows it
    w, h = _layer(200, k, seed=len(name))            # N = 3 chunks of 64 + 8 (and addr_'s remainder loop)
    calls = []
    real = G._block_on_kernel
    monkeypatch.setattr(G, "_block_on_kernel", lambda *a: (calls.append(1), real(*a)))
    q_kernel, loss_kernel = G.gptq_quantize(w, h, cfg)
    assert calls, "the library's block was not used"
    monkeypatch.setattr(G, "_block_on_kernel", G._block_reference)
    q_ref, loss_ref = G.gptq_quantize(w, h, cfg)
    assert (q_kernel.codes_kn == q_ref.codes_kn).all()
    assert (q_kernel.scales_gn == q_ref.scales_gn).all()
    assert loss_kernel == loss_ref


def test_the_search_switch_runs_the_torch_loop(monkeypatch):
    monkeypatch.setenv("KTCONVERT_SEARCH", "torch")
    monkeypatch.setattr(G, "_block_on_kernel", lambda *a: pytest.fail("kt_gptq_block ran under KTCONVERT_SEARCH=torch"))
    w, h = _layer(64, 128, seed=1)
    G.gptq_quantize(w, h, CONFIGS["int4 g64 f16"])


_DIGEST = """
import hashlib, torch
from ktconvert.gpu import gptq as G
g = torch.Generator().manual_seed(3)
h = hashlib.sha256()
for bits, group, dt in ((4, 64, "f16"), (8, 32, "bf16"), (4, -1, "f32"), (4, 32, "sub6")):
    w = torch.randn(136, 256, generator=g) * 0.02
    x = torch.randn(300, 256, generator=g) * torch.rand(256, generator=g)
    q, loss = G.gptq_quantize(w, 2.0 * x.T @ x / 300, G.GptqConfig(bits=bits, group_size=group, scale_dtype=dt))
    h.update(q.codes_kn.tobytes()); h.update(q.scales_gn.tobytes()); h.update(repr(loss).encode())
print(h.hexdigest())
"""


def test_every_isa_copy_gives_the_same_bits():
    digests = outputs_per_isa(_DIGEST)
    assert len(set(digests.values())) == 1, digests


def test_bad_arguments():
    w, u = torch.randn(8, 32), torch.eye(8)
    scales, codes, err = torch.ones(1, 32), torch.empty(8, 32, dtype=torch.uint8), torch.empty(8, 32)
    with pytest.raises(KernelError, match="bad arguments"):
        kernel.gptq_block(w, u, 0, scales, codes, err, 4)                   # group 0
    with pytest.raises(KernelError, match="bad arguments"):
        kernel.gptq_block(w, u, 8, scales, codes, err, 9)                   # 9 bits
    with pytest.raises(KernelError, match="bad arguments"):
        kernel.gptq_block(w, u, 8, scales, codes, err, 4, torch.ones(8), "float16", [0.0])   # a zero divisor
    with pytest.raises(ValueError, match="u must be a 2-D CPU tensor with contiguous rows"):
        kernel.gptq_block(w, u.t(), 8, scales, codes, err, 4)                # column-major
    with pytest.raises(ValueError, match="codes must be uint8"):
        kernel.gptq_block(w, u, 8, scales, torch.empty(8, 32), err, 4)

