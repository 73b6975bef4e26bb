"""ktlayouts.bf16: the one float32 -> bf16 rounding, against torch's cast (an independent implementation)."""
import numpy as np
import torch
from ktlayouts import cpu_expert
from ktlayouts.bf16 import bf16_bits_to_f32, f32_to_bf16_bits

from ktconvert.sources import fp8

SPECIAL = np.array([0x00000000, 0x80000000, 0x00008000, 0x00018000, 0x3F808000, 0x3F818000, 0xBF808000,
                    0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,       # ties, overflow to inf, infinities
                    0x7F800001, 0x7FBFFFFF, 0x7FC00000, 0xFF800001, 0xFFFFFFFF, 0x7F80FFFF],  # NaNs (signalling too)
                   dtype=np.uint32)


def _torch_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_rounding_matches_torch_and_nan_stays_nan():
    rng = np.random.default_rng(0)
    x = np.concatenate([SPECIAL.view(np.float32), rng.standard_normal(4098).astype(np.float32) * 1e3,
                        rng.integers(0, 2**32, 4096, dtype=np.uint32).view(np.float32)]).reshape(-1, 7)
    got, want = f32_to_bf16_bits(x), _torch_bits(x)
    assert got.shape == x.shape and got.dtype == np.uint16
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    back = bf16_bits_to_f32(got)
    assert np.array_equal(np.isnan(back), nan)                                  # no NaN became inf or a number
    assert np.array_equal(np.signbit(back[nan]), np.signbit(x[nan]))


def test_bf16_to_f32_is_exact_and_the_old_names_are_the_one_function():
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    f = bf16_bits_to_f32(bits)
    finite = np.isfinite(f)
    assert np.array_equal(f32_to_bf16_bits(f)[finite], bits[finite])
    assert np.array_equal(bf16_bits_to_f32(bits.view(np.int16)).view(np.uint32), f.view(np.uint32))
    assert cpu_expert.f32_to_bf16_bits is fp8.f32_to_bf16_bits is f32_to_bf16_bits
    assert cpu_expert.bf16_bits_to_f32 is fp8.bf16_bits_to_f32 is bf16_bits_to_f32
