"""Random int4 routed experts in the packed CPU layout, held in memory: what KernelExperts needs from a loaded
conversion (geometry + per-layer packed arrays), for the decode benchmarks (bench_decode.py, bench_decode_hybrid.py)."""
from __future__ import annotations

import numpy as np
from ktlayouts.converted_dir import ExpertGeometry


class SyntheticConversion:
    """geometry + experts {layer: [ {proj: (qweight, scales, MatrixGeometry)} ]} of random int4 g128 experts."""

    def __init__(self, layers: int, experts: int, hidden: int, intermediate: int, seed: int = 0):
        self.geometry = ExpertGeometry("int4-amx", 128, experts, hidden, intermediate, 1, tuple(range(layers)))
        rng = np.random.default_rng(seed)
        self.experts, self.nbytes = {}, 0
        for layer in range(layers):
            shard = {}
            for p in ("gate", "up", "down"):
                g = self.geometry.matrix_geometry(p, 0)
                qw = rng.integers(0, 256, size=(experts, *g.qweight_shape), dtype=np.uint8)
                # scale ~ 1/sqrt(K) / 8 keeps activations O(1) through the layers
                sc = (rng.standard_normal((experts, *g.scales_shape)) / (8 * np.sqrt(g.k))).astype(np.float32)
                shard[p] = (qw, sc, g)
                self.nbytes += qw.nbytes + sc.nbytes
            self.experts[layer] = [shard]
