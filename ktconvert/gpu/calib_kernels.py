"""The calibration forward's matmuls on libktkernels' int4 tiles (KTCONVERT_CALIB_MATMUL=kernels, opt-in;
ktconvert.gpu.calib.calibration_matmul).

Why: on such a CPU (AVX2, AVX-512 without BF16) torch runs the forward's matmuls in float32, and on
bench_convert.py's DeepSeek-V3-shaped checkpoint that forward was ~45% of the calibrated default's CPU time on
Zen 3 (attention projections ~50 s, routed experts ~32 s of ~230 CPU-s). The library's int4 tile product runs ~2.4x
torch's float32 one on 2 Zen 3 cores (~300 vs 120-145 G multiply-adds x 2 per second at 1024-2048 rows).

What runs where: every Linear of the layer the conversion does not quantize with this forward's statistics (all of
them in an expert-only calibration) and every routed expert's gate / up / down run as y = x Wq^T, Wq the weight's
int4 codes with group-128 (64, 32) scales made here by one trial of the scale search (kt_search_scales: the largest
magnitude onto the most negative code, then the least-squares scale for those codes, never worse than the plain
rule), x quantized to int8 per row by the kernel. Attention scores, norms, the router and the activation stay in
torch. So the statistics the expert quantizer reads (each expert's routed inputs X, its down inputs A) are those of
a model whose Linears carry int4 weights (and int8 activation rows), not of the float one. Measured (bench/README.md,
Zen 3, 2 cores): on bench_convert.py's DeepSeek-V3-shaped random-weight checkpoint 0.89x the float32 default's wall
time at KL 0.033122 vs 0.033158; on the trained default model (experts calibrated on their own pass) KL 0.004171 with
the experts on tiles, 0.004286 with every Linear, against 0.004110: worse, so not the default.

Deterministic: a product's bits depend only on its operands (the kernels' per-row order is fixed, whatever the
thread count or what runs beside them), so a resumed or re-run conversion packs the same bytes.

Shapes: W (N, K) float32, x (..., K) float32 -> (..., N) float32.
"""
from __future__ import annotations

import torch
from torch import nn

# Linears below this many weights stay in torch: quantizing them costs about what the product saves
MIN_WEIGHTS = 1 << 20
GROUPS = (128, 64, 32)            # the first that divides K (fewer scales: a cheaper search, the same product speed)
EXPERT_IDS = (0, 1, 2)            # a routed expert's gate, up, down: re-registered for every expert
FIRST_LAYER_ID = 3                # the layer's other Linears from here


def tile_group(k: int) -> int | None:
    """The scale group of a K-input weight on the tiles, or None where no supported group divides K."""
    return next((g for g in GROUPS if k % g == 0), None)


class TileMatmuls:
    """One kernel context (its own thread pool) for the calibration forward of one conversion."""

    def __init__(self, n_threads: int | None = None):
        from ktrun.ops.linear import LinearKernels

        self.lin = LinearKernels(n_threads=n_threads)
        self._next = FIRST_LAYER_ID          # one forward at a time uses the context (the calibration thread)
        self.stats = {"quantized": 0}                # weights put on tiles (tests read it)
        self._buf: torch.Tensor | None = None      # _rows

    def close(self) -> None:
        self.lin.close()

    def takes(self, w: torch.Tensor) -> bool:
        return w.numel() >= MIN_WEIGHTS and tile_group(w.shape[1]) is not None

    def register(self, linear_id: int, w: torch.Tensor) -> None:
        """Quantize W (N, K) float32 to int4 tiles (kept referenced by the context) under linear_id."""
        from ktrun.ops.scale_search import search_scales

        n, k = w.shape
        g = tile_group(k)
        w = w.detach().to(torch.float32).contiguous()
        # one trial: the peak onto -8, its least-squares refit, the plain rule as the floor (ktconvert.scale_search)
        scales, codes = search_scales(w.reshape(-1, g), None, 4, "float16", [-8.0], 0, int8_codes=True)
        codes_kn = (codes.view(n, k) + 8).view(torch.uint8).T          # (K, N) view, zero point 8
        scales_gn = scales.view(n, k // g).to(torch.float16).T          # (K / G, N) view
        qweight, packed_scales = self.lin.repack(codes_kn, scales_gn, 4, g)
        self.lin.add(linear_id, qweight, packed_scales, n=n, k=k, bits=4, group_size=g)
        self.stats["quantized"] += 1

    def new_id(self) -> int:
        self._next += 1
        return self._next - 1

    def reset_layer_ids(self) -> None:
        """A new layer's Linears reuse the ids from FIRST_LAYER_ID (the last layer's entries are replaced)."""
        self._next = FIRST_LAYER_ID

    def run(self, ids: list[int], x: torch.Tensor) -> list[torch.Tensor]:
        """y_i = x Wq_i^T for Linears sharing x: (T, K) -> [(T, N_i)] float32."""
        x2 = x.to(torch.float32).contiguous()
        outs = [torch.empty(x2.shape[0], self.lin.geometry(i).n) for i in ids]
        if x2.shape[0]:
            self.lin.submit_prepared(tuple(ids), x2, outs)
            self.lin.sync()
        return outs

    def on_linear(self, mod: nn.Linear) -> bool:
        """Run `mod` (an nn.Linear of the layer being calibrated) on tiles from now on: its forward is replaced on
        the instance (its weight stays, for code that reads it directly). False where it stays in torch."""
        if not self.takes(mod.weight):
            return False
        linear_id = self.new_id()
        self.register(linear_id, mod.weight)
        bias = mod.bias

        def forward(x: torch.Tensor) -> torch.Tensor:
            # x: (..., K) -> (..., N)
            y = self.run([linear_id], x.reshape(-1, x.shape[-1]))[0].reshape(*x.shape[:-1], -1)
            y = y if bias is None else y + bias.to(y.dtype)
            return y.to(x.dtype)
        mod.forward = forward
        return True

    def expert(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gate_fn,
               biases=None, sample: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One routed expert on its routed tokens: x (n, H), gate / up (I, H), down (H, I) float32 -> (a (n, I) its
        down inputs, y (n, H), a_s (S, I) the down inputs of `sample` (S, H) rows, or None without them), the
        sample's rows in the same gate / up product. biases: (gate (I,), up (I,), down (H,)) or None."""
        g_id, u_id, d_id = EXPERT_IDS
        self.register(g_id, gate)
        self.register(u_id, up)
        self.register(d_id, down)
        n = x.shape[0]
        if sample is not None:        # x and the sample's rows in one reused buffer (a fresh one: fresh pages)
            rows = self._rows(n + sample.shape[0], x.shape[1])
            rows[:n] = x
            rows[n:] = sample
            x = rows
        g, u = self.run([g_id, u_id], x)
        if biases is not None:
            g, u = g + biases[0], u + biases[1]
        a_all = gate_fn(g, u)
        a = a_all[:n]
        y = self.run([d_id], a)[0]
        return a, y if biases is None else y + biases[2], None if sample is None else a_all[n:]

    def _rows(self, t: int, k: int) -> torch.Tensor:
        """A (t, k) float32 view of this context's reused row buffer (grown when too small)."""
        if self._buf is None or self._buf.numel() < t * k:
            self._buf = None
            self._buf = torch.empty(t * k)
        return self._buf[: t * k].view(t, k)

    def takes_expert(self, gate: torch.Tensor, down: torch.Tensor) -> bool:
        return tile_group(gate.shape[1]) is not None and tile_group(down.shape[1]) is not None
