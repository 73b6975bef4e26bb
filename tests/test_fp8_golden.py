"""FP8 block dequantization against golden vectors from an independent implementation (compressed-tensors)."""
import json

import numpy as np
import pytest
import torch
from golden_data import GOLDEN

from ktconvert.sources.fp8 import (
    E4M3FN_TO_F32,
    dequant_fp8_block,
    dequant_fp8_block_bf16,
    dequant_fp8_block_bf16_bits,
    f32_to_bf16_bits,
    quantize_fp8_block,
)

FP8_FILES = ["fp8block_n200_k130.npz", "fp8block_n256_k384.npz", "fp8block_n576_k896.npz"]


def test_golden_index_lists_the_fp8_files():
    listed = json.dumps(json.loads((GOLDEN / "index.json").read_text()))
    for name in FP8_FILES:
        assert name in listed


@pytest.mark.parametrize("name", FP8_FILES)
def test_fp8_block_dequant_is_bit_exact(name):
    g = np.load(GOLDEN / name)
    bits, scale_inv, want = g["weight_fp8_bits"], g["weight_scale_inv"], g["dequant_bf16_bits"].view(np.uint16)
    got = dequant_fp8_block_bf16_bits(bits, scale_inv)
    assert got.shape == want.shape
    mismatch = np.flatnonzero(got != want)
    assert mismatch.size == 0, f"{mismatch.size} mismatches, first at flat index {mismatch[:5]}"
    # the torch bf16 variant holds the same bits
    assert np.array_equal(dequant_fp8_block_bf16(bits, scale_inv).view(torch.int16).numpy().view(np.uint16), want)
    # the f32 variant equals torch's own fp8 decode times the block scale
    ref = torch.from_numpy(bits).view(torch.float8_e4m3fn).float().numpy()
    n, k = bits.shape
    ref = ref * np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[:n, :k]
    assert np.array_equal(dequant_fp8_block(bits, scale_inv), ref)


def test_e4m3fn_table_matches_torch():
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(E4M3FN_TO_F32, want, equal_nan=True)
    assert np.isnan(E4M3FN_TO_F32[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(E4M3FN_TO_F32, [0x7F, 0xFF])).all()


def test_bf16_rounding_matches_torch():
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * 1e3
    x[:4] = [np.inf, -np.inf, 0.0, -0.0]
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(f32_to_bf16_bits(x), want)


def test_quantize_then_dequant_within_fp8_error():
    w = np.random.default_rng(1).standard_normal((200, 130)).astype(np.float32)
    bits, scale_inv = quantize_fp8_block(w)
    assert scale_inv.shape == (2, 2)
    back = dequant_fp8_block(bits, scale_inv)
    step = np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[:200, :130] * 2.0**-9  # smallest subnormal step
    assert np.all(np.abs(back - w) <= np.abs(w) * 2.0**-4 + step)


def test_scale_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="expected \\(2, 2\\)"):
        dequant_fp8_block(np.zeros((200, 130), np.uint8), np.ones((1, 2), np.float32))
