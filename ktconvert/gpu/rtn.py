"""Round-to-nearest symmetric quantization of a Linear weight for the GPU layouts (ktlayouts.gptq convention).

Per group of G input channels: scale = max|w| / ((2^b - 1) / 2) (so +-max|w| sits half a step outside the
code range, the GPTQ symmetric convention), stored as float16; code = clamp(rint(w / scale) + Z, 0, 2^b - 1) (round half to even),
Z = 2^(b-1), computed with the float16-rounded scale so that dequantization uses exactly what is stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from ktlayouts.expert_formats import F16_SCALES
from ktlayouts.gptq import GptqGeometry, zero_point

FP16_MAX = 65504.0


@dataclass
class QuantizedLinear:
    """One quantized (N, K) Linear in the common GPU form, before layout packing."""
    codes_kn: np.ndarray     # (K, N) uint8, unsigned codes with zero point 2^(bits-1)
    scales_gn: np.ndarray    # (n_groups, N) float16
    g_idx: np.ndarray        # (K,) int32, group of each input channel
    geom: GptqGeometry

    def dequantize(self) -> torch.Tensor:
        """-> (N, K) float32 weight."""
        q = torch.from_numpy(self.codes_kn.astype(np.float32)) - zero_point(self.geom.bits)
        s = torch.from_numpy(self.scales_gn.astype(np.float32))[torch.from_numpy(self.g_idx.astype(np.int64))]
        return (q * s).T.contiguous()


def scales_for(w_group: torch.Tensor, bits: int) -> torch.Tensor:
    """w_group: (N, L) float32 columns of one group -> (N,) float32 scales, already rounded to float16."""
    peak = torch.maximum(w_group.amax(dim=1), -w_group.amin(dim=1))    # max |w| without a full-size abs copy
    scale = (peak / ((2 ** bits - 1) / 2)).clamp(max=FP16_MAX)
    return scale.to(torch.float16).to(torch.float32)


def quantize_columns(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """w: (N, L) or (N,), scale: (N,) -> codes of the same shape as float32 in [0, 2^b - 1]."""
    s = scale if w.dim() == 1 else scale[:, None]
    # true division by the stored scale (not a multiply by its reciprocal): matches the reference rounding. In place
    # on one result tensor: no full-size zeros/where temporaries (fresh pages are zeroed by the kernel)
    q = w / torch.where(s != 0, s, torch.ones_like(s))
    q.masked_fill_((s == 0).expand_as(q), 0.0)
    return q.round_().add_(zero_point(bits)).clamp_(0, 2 ** bits - 1)


def dequantize_columns(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    s = scale if codes.dim() == 1 else scale[:, None]
    return (codes - zero_point(bits)) * s


# Output channels quantized at once by quantize_rtn: its float temporaries stay a few MB, which the allocator reuses;
# whole-matrix temporaries (a DeepSeek-V3 o_proj is 117 M weights, 470 MB per float copy) were fresh pages each, and
# the kernel zeroing them was most of an rtn conversion's system time.
RTN_CHUNK_ELEMENTS = 1 << 20


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedLinear:
    """weight (N, K) float -> QuantizedLinear (plain round to nearest), RTN_CHUNK_ELEMENTS weights at a time (rows
    are independent: the same codes and scales as one pass)."""
    w = weight.detach()
    n, k = w.shape
    geom = GptqGeometry(n, k, bits, group_size)
    codes_kn = np.empty((k, n), dtype=np.uint8)
    scales_gn = np.empty((geom.n_groups, n), dtype=np.float16)
    step = max(1, RTN_CHUNK_ELEMENTS // k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        flat = w[r0:r1].to(torch.float32).reshape(-1, geom.group)                            # (R * G, L)
        scale = scales_for(flat, bits)                                                       # (R * G,)
        codes = quantize_columns(flat, scale, bits).reshape(r1 - r0, k)                      # (R, K)
        codes_kn[:, r0:r1] = codes.to(torch.uint8).numpy().T
        scales_gn[:, r0:r1] = scale.reshape(r1 - r0, geom.n_groups).to(torch.float16).numpy().T
    return QuantizedLinear(codes_kn, scales_gn, geom.default_g_idx(), geom)


def quantize_search(weight: torch.Tensor, bits: int, group_size: int, importance: torch.Tensor | None = None,
                    scale_dtype: str = F16_SCALES.name) -> QuantizedLinear:
    """weight (N, K) -> QuantizedLinear: round to nearest with each group's scale chosen by
    ktconvert.scale_search.search_scales (squared error weighted by `importance` (K,), the input channels'
    activation energy diag(H), or uniform; never worse than the largest magnitude onto the most negative code)."""
    from ktconvert.scale_search import search_scales

    w = weight.detach().to(torch.float32)
    n, k = w.shape
    geom = GptqGeometry(n, k, bits, group_size)
    groups = w.reshape(n * geom.n_groups, geom.group)                      # (N * G, L), row-major over (n, g)
    imp = None if importance is None else importance.to(torch.float32).reshape(1, geom.n_groups, geom.group) \
        .expand(n, -1, -1).reshape(n * geom.n_groups, geom.group)
    scale, q = search_scales(groups, imp, bits, scale_dtype)
    codes = (q + zero_point(bits)).reshape(n, geom.n_groups, geom.group)
    codes_kn = codes.permute(1, 2, 0).reshape(k, n)
    scales_gn = scale.reshape(n, geom.n_groups).T.contiguous()
    return QuantizedLinear(codes_kn.to(torch.uint8).numpy(), scales_gn.to(torch.float16).numpy(),
                           geom.default_g_idx(), geom)
