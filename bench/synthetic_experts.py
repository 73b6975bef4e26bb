"""Random quantized routed experts in the packed CPU layout, held in memory: what KernelExperts needs from a loaded
conversion (geometry, per-layer packed arrays, the model config, the dense tensors holding expert biases), for the
decode benchmarks (bench_decode.py, bench_decode_hybrid.py)."""
from __future__ import annotations

import numpy as np
from ktlayouts.converted_dir import ExpertGeometry
from ktlayouts.families import SILU, ModelConfig


class SyntheticConversion:
    """geometry + experts {layer: [ {proj: (qweight, scales, MatrixGeometry)} ]} of random int4 g128 experts (or
    `method` / `group`: int8-amx g32 for gpt-oss's MXFP4 take-over). config: the ModelConfig whose expert activation
    the kernels run (default silu, no biases); dense: where expert biases live (gpt-oss)."""

    def __init__(self, layers: int, experts: int, hidden: int, intermediate: int, seed: int = 0,
                 method: str = "int4-amx", group: int = 128, config: ModelConfig | None = None,
                 dense: dict | None = None):
        self.geometry = ExpertGeometry(method, group, experts, hidden, intermediate, 1, tuple(range(layers)))
        self.config = config if config is not None else _Silu()
        self.dense, self.root = dense or {}, "synthetic"
        rng = np.random.default_rng(seed)
        self.experts, self.nbytes = {}, 0
        for layer in range(layers):
            shard = {}
            for p in ("gate", "up", "down"):
                g = self.geometry.matrix_geometry(p, 0)
                qw = rng.integers(0, 256, size=(experts, *g.qweight_shape), dtype=np.uint8)
                # scale ~ 1/sqrt(K) / 8 keeps activations O(1) through the layers (int8 codes: / 16 more)
                sc = (rng.standard_normal((experts, *g.scales_shape)) / ((8 if g.bits == 4 else 128) * np.sqrt(g.k))
                      ).astype(np.float32)
                shard[p] = (qw, sc, g)
                self.nbytes += qw.nbytes + sc.nbytes
            self.experts[layer] = [shard]


class _Silu:
    expert_activation = SILU
