"""Routed-expert quantization for the CPU tile layouts (cpu-expert-int4 / -int8), with calibration.

Every expert sees only the tokens the router sends it: the calibration driver (ktconvert.gpu.calib.LayerwiseGptq
with capture_experts) keeps each MoE layer's expert inputs X (T, H) and routing ids (T, k); expert e's routed tokens
are X_e = X[tokens routed to e] (n_e of them), and its down_proj inputs are A_e = silu(X_e gate^T) * (X_e up^T)
from its float weights. Modes (`ktconvert quantize --expert-quantizer`):

  rtn     the layout's reference rule (ktlayouts.cpu_expert.quantize: largest magnitude onto the most negative code),
          no calibration;
  search  per-group scale search (ktconvert.scale_search; two-level scales: the super-scale and 8 sub-scales of a
          super-block together, search_two_level) minimizing the squared error weighted by each input
          channel's importance, mean(x_k^2) over the expert's routed tokens (gate/up: X_e, down: A_e), shrunk toward
          the mean over all tokens of the layer for experts with few tokens:
          imp = (sum_routed x^2 + PRIOR_TOKENS * mean_all x^2) / (n_e + PRIOR_TOKENS) (for down, mean_all over an
          evenly spaced sample of PRIOR_SAMPLE tokens); uniform without calibration;
  gptq    GPTQ (ktconvert.gpu.gptq, with the same scale search) on the Hessian of the routed tokens,
          H = 2 X_e^T X_e / n_e, for every matrix whose expert got at least `min_tokens` routed tokens (default:
          K / 2 of that matrix: below that GPTQ measured no better than `search`), `search` for the others;
  auto    gptq when calibration text is available, else search with uniform weights.

Overlap: with its own calibration pass (GPU layers not calibrated), the forward of the next MoE layer runs on a
thread of its own while this layer's experts are packed, the first one's from the conversion's start
(prefetch_layers): the calibration forward is the float model's, independent of how the experts are quantized, and
it was a third of the calibrated default's wall time with the pack workers idle. Memory: two layers' X (T, H) and down inputs, plus one expert's activations and Hessians per
pack worker. Deterministic: nothing changes torch's process-wide thread count during a conversion (a matmul's bits
may depend on it), so the forward and the workers' torch work give the same bits whatever runs beside them, and a
resumed run packs the same bytes.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from ktlayouts.cpu_expert import MatrixGeometry, pack_codes, pack_expert_matrix, pack_scales, pad_weight
from ktlayouts.expert_formats import BF16_SCALES, F16_SCALES, F32_SCALES, UNDECLARED_SCALE_DTYPE, scale_encoding

from ktconvert.gpu.calib import prior_rows
from ktconvert.scale_search import search_two_level, search_unsigned_codes

log = logging.getLogger(__name__)

EXPERT_QUANTIZERS = ("auto", "gptq", "search", "rtn")
PRIOR_TOKENS = 16.0


@dataclass
class ExpertStats:
    """Calibration statistics of one expert (full, unsharded matrices)."""
    n_tokens: int
    imp_in: torch.Tensor              # (H,) importance of gate/up input channels
    imp_down: torch.Tensor            # (I,) importance of down input channels
    x: torch.Tensor | None = None     # (n, H) routed inputs (kept only when GPTQ may use them)
    a: torch.Tensor | None = None     # (n, I) down inputs


@dataclass
class LayerReport:
    layer: int
    tokens: dict[int, int]                             # expert -> routed calibration tokens
    methods: dict[str, int] = field(default_factory=dict)   # matrices per method (gptq / search)


class ExpertQuantizer:
    def __init__(self, mode: str, calibrator_fn=None, min_tokens: int = 0, scale_dtype: str = UNDECLARED_SCALE_DTYPE,
                 percdamp: float = 0.01, own_calibration: bool = False):
        """calibrator_fn: () -> LayerwiseGptq with capture_experts, or None when there is no calibration;
        own_calibration: nothing else drives that calibrator (the GPU layers are not calibrated with it)."""
        self.own_calibration = own_calibration
        if mode not in EXPERT_QUANTIZERS:
            raise ValueError(f"--expert-quantizer {mode!r}: choose one of {', '.join(EXPERT_QUANTIZERS)}")
        self.calibrator_fn = calibrator_fn if mode != "rtn" else None
        self.mode = ("gptq" if calibrator_fn else "search") if mode == "auto" else mode
        if self.mode == "gptq" and calibrator_fn is None:
            raise ValueError("--expert-quantizer gptq needs calibration text and the checkpoint's tokenizer")
        self.min_tokens, self.scale_dtype, self.percdamp = min_tokens, scale_dtype, percdamp
        self._lock = threading.Lock()
        # (layer, X (T, H), ids (T, k), expert -> (n_e, I) down inputs, mean of X^2 over T (H,), expert -> (S, I)
        # down inputs of prior_rows(X) where the calibration forward computed them)
        self._layer: tuple | None = None
        self._ahead: list[int] = []          # MoE layers still to begin, in order (prefetch_layers)
        self._pending: tuple[int, Future] | None = None
        self._prefetcher: ThreadPoolExecutor | None = None
        self.reports: dict[int, LayerReport] = {}

    @property
    def calibrated(self) -> bool:
        return self.calibrator_fn is not None

    @property
    def prefetching(self) -> bool:
        """Whether the calibration forward runs on a thread of its own (prefetch_layers), ahead of the packing."""
        return self._prefetcher is not None

    def describe(self) -> str:
        if self.mode == "rtn":
            return "rtn (largest magnitude onto the most negative code)"
        if not self.calibrated:
            return "search (uniform weights: no calibration)"
        rule = f">= {self.min_tokens} routed tokens" if self.min_tokens else ">= K/2 routed tokens"
        return ("gptq where an expert got " + rule + ", else importance search") if self.mode == "gptq" \
            else "importance-weighted scale search"

    # --- per layer (main thread) / per expert statistics (pack workers) ----------------------------------------
    def begin_layer(self, layer: int) -> None:
        """Fetch the layer's calibration inputs (runs the calibration driver up to this layer, or takes what the
        prefetch thread computed) before the layer's experts are packed; then start the next layer's forward there
        (prefetch_layers)."""
        self.reports[layer] = LayerReport(layer, {})
        if self.calibrated and self.mode != "rtn":
            pending, self._pending = self._pending, None
            got = pending[1].result() if pending is not None else None      # never two forwards at once
            if pending is None or pending[0] != layer:
                got = self._inputs(layer)
            self.use_inputs(layer, *got)
            later = [x for x in self._ahead if x > layer]
            self._ahead = later
            if later and self._prefetcher is not None:
                self._pending = (later[0], self._prefetcher.submit(self._inputs, later[0]))

    def use_inputs(self, layer: int, x: torch.Tensor, ids: torch.Tensor, acts: dict[int, torch.Tensor],
                   prior: dict[int, torch.Tensor] | None = None) -> None:
        """The calibration inputs expert_stats reads for `layer`: X (T, H), routing ids (T, k), expert -> (n_e, I)
        down inputs (begin_layer's, or synthetic ones: ktconvert.estimate times an expert with them), and where the
        forward computed them expert -> (S, I) down inputs of prior_rows(X)."""
        self.reports.setdefault(layer, LayerReport(layer, {}))
        # the prior's input energy is the same for every expert of the layer: once here, not a (T, H) square each
        self._layer = (layer, x, ids, acts, (x * x).mean(0), prior or {})

    def prefetch_layers(self, layers: list[int]) -> None:
        """The MoE layers whose experts this conversion will quantize, in order: the first one's calibration forward
        starts now on a thread of its own (while the dense files before it are encoded: it was a serial stretch with
        the pack workers idle), and each begin_layer starts the next one's. Only for a calibration pass of its own
        (the GPU layers' GPTQ, when it shares the pass, runs it from the main thread)."""
        if self.calibrated and self.mode != "rtn" and self.own_calibration:
            self._ahead = list(layers)
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="ktconvert-calibration")
            if layers:
                self._pending = (layers[0], self._prefetcher.submit(self._inputs, layers[0]))

    def close(self) -> None:
        """Stop prefetching (a forward under way finishes first: it cannot be interrupted)."""
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
            self._prefetcher, self._pending = None, None

    def _inputs(self, layer: int) -> tuple:
        cal = self.calibrator_fn()
        x, ids = cal.expert_inputs(layer)
        acts = cal.expert_activations(layer) if hasattr(cal, "expert_activations") else {}
        prior = cal.expert_prior_rows(layer) if hasattr(cal, "expert_prior_rows") else {}
        # (bf16 from a bf16-matmul forward)
        return x.float(), ids, {e: a.float() for e, a in acts.items()}, {e: a.float() for e, a in prior.items()}

    def expert_stats(self, layer: int, e: int, w: dict[str, np.ndarray]) -> ExpertStats | None:
        if not self.calibrated:
            return None
        if self._layer is None or self._layer[0] != layer:
            raise RuntimeError(f"layer {layer}: begin_layer was not called")
        x_all, ids, acts, x_energy, prior = self._layer[1:6]
        tok = (ids == e).any(dim=1)
        xe = x_all[tok]
        n = int(tok.sum())
        gate = torch.from_numpy(np.asarray(w["gate"], np.float32))
        up = torch.from_numpy(np.asarray(w["up"], np.float32))
        # the down inputs of the routed tokens: as the calibration forward computed them, else computed here
        ae = acts[e] if e in acts and acts[e].shape[0] == n else F.silu(xe @ gate.T) * (xe @ up.T)    # (n, I)
        # the prior's mean over all tokens, from an evenly spaced sample of PRIOR_SAMPLE of them: it weighs
        # PRIOR_TOKENS against the routed tokens, and all T rows cost two (T, H) x (H, I) products per expert
        # (the calibration forward computes them in its own gate / up product of the expert; here only without it)
        xs = prior_rows(x_all)
        a_s = prior[e] if e in prior and prior[e].shape[0] == xs.shape[0] else F.silu(xs @ gate.T) * (xs @ up.T)
        with self._lock:
            self.reports[layer].tokens[e] = n

        def imp(sub, full_energy):
            return ((sub * sub).sum(0) + PRIOR_TOKENS * full_energy) / (n + PRIOR_TOKENS)
        keep = self.mode == "gptq"
        return ExpertStats(n, imp(xe, x_energy), imp(ae, (a_s * a_s).mean(0)), xe if keep else None,
                           ae if keep else None)

    # --- one matrix ------------------------------------------------------------------------------------------
    def pack(self, proj: str, mat: np.ndarray, geom: MatrixGeometry, stats: ExpertStats | None,
             k_range: tuple[int, int], bf16_scales: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """mat (N, K) float (this shard's rows of gate/up, columns of down) -> (qweight, packed scales).
        k_range: for down, this shard's [i0, i1) of the padded intermediate size (its K); ignored otherwise.
        bf16_scales (--bf16-scales): the searched scales are bfloat16 values whatever the stored dtype. Stored as
        float32 (layout version 1) they are float16 values: the GPU formats' float16 scales (Marlin hot experts, the
        gptq / compressed-tensors exports) then hold them exactly, at no measurable cost (bench/README.md)."""
        if self.mode == "rtn":
            return pack_expert_matrix(mat, geom, bf16_scales)
        sd = BF16_SCALES.name if bf16_scales else F16_SCALES.name if self.scale_dtype == F32_SCALES.name \
            else self.scale_dtype
        # (N_pad, K_pad), read only below (GPTQ works on a copy of its own): mat itself where it needs no padding
        wp = torch.from_numpy(pad_weight(np.asarray(mat, np.float32), geom))
        use_gptq = self.mode == "gptq" and stats is not None and stats.n_tokens >= self._gptq_tokens(geom)
        imp, h = self._importance(proj, stats, geom, k_range, use_gptq)
        codes, scales = self._gptq(wp, h, geom, sd) if use_gptq else self._search(wp, imp, geom, sd)
        if self._layer is not None:
            with self._lock:
                rep = self.reports[self._layer[0]]
                key = "gptq" if use_gptq else "search"
                rep.methods[key] = rep.methods.get(key, 0) + 1
        return pack_codes(codes, geom), pack_scales(scales, geom)

    def _gptq_tokens(self, geom: MatrixGeometry) -> int:
        return self.min_tokens if self.min_tokens > 0 else geom.k // 2

    def _importance(self, proj, stats, geom, k_range, rows_needed: bool = True):
        """-> (importance (K_pad,) or None, Hessian source rows (n, K_pad) or None: only where rows_needed, GPTQ
        runs on them) for this shard's K."""
        if stats is None:
            return None, None
        if proj == "down":
            i0, i1 = k_range
            full, acts = stats.imp_down, stats.a
            take = max(0, min(i1, full.shape[0]) - i0)
            sl = slice(i0, i0 + take)
        else:
            full, acts = stats.imp_in, stats.x
            take, sl = full.shape[0], slice(0, full.shape[0])
        imp = torch.zeros(geom.k_pad)
        imp[:take] = full[sl]
        rows = None
        if acts is not None and rows_needed:
            rows = torch.zeros(acts.shape[0], geom.k_pad)
            rows[:, :take] = acts[:, sl]
        return imp, rows

    def _search(self, wp: torch.Tensor, imp: torch.Tensor | None, geom: MatrixGeometry, scale_dtype: str):
        if not scale_encoding(scale_dtype).elementwise:       # two-level: super-blocks searched together
            return self._search_two_level(wp, imp, geom)
        n, g = geom.n_pad, geom.group
        groups = wp.reshape(n * geom.n_groups, g)
        w = None if imp is None else imp.reshape(geom.n_groups, g)      # group r takes row r % n_groups
        s, codes = search_unsigned_codes(groups, w, geom.bits, scale_dtype, geom.format.zero_point)
        codes = codes.reshape(geom.n_pad, geom.k_pad).numpy()
        return codes, s.reshape(n, geom.n_groups).numpy().astype(np.float32)

    def _search_two_level(self, wp: torch.Tensor, imp: torch.Tensor | None, geom: MatrixGeometry):
        """Two-level scales (layout version 3): super-blocks of 8 groups searched together (search_two_level)."""
        n, g, sb = geom.n_pad, geom.group, geom.encoding.super_groups
        blocks = wp.reshape(n * geom.n_groups // sb, sb, g)
        w = None if imp is None else imp.reshape(1, -1, sb, g).expand(n, -1, -1, -1).reshape(-1, sb, g)
        d, q, codes = search_two_level(blocks, w, geom.bits)
        codes = (codes + geom.format.zero_point).to(torch.uint8).reshape(n, geom.k_pad).numpy()
        return codes, (d[:, None] * q).reshape(n, geom.n_groups).numpy().astype(np.float32)

    def _gptq(self, wp: torch.Tensor, rows: torch.Tensor, geom: MatrixGeometry, scale_dtype: str):
        from ktconvert.gpu.gptq import GptqConfig, gptq_quantize

        h = 2.0 * rows.T @ rows / max(1, rows.shape[0])
        group = -1 if geom.group == geom.k_pad and geom.group_size == -1 else geom.group
        cfg = GptqConfig(bits=geom.bits, group_size=group, percdamp=self.percdamp, block=max(128, geom.group),
                         scale_dtype=scale_dtype)
        q, _ = gptq_quantize(wp, h, cfg, name="routed expert")
        # (N_pad, K_pad), zero point Z: torch's blocked transpose (numpy's of a 2048 x 7168 uint8 matrix: 93 ms vs 15)
        codes = torch.from_numpy(q.codes_kn).T.contiguous().numpy()
        scales = np.ascontiguousarray(q.scales_gn.astype(np.float32).T)              # (N_pad, n_groups)
        return codes, scales

    def layer_done(self, layer: int) -> None:
        rep = self.reports.get(layer)
        if rep is None or not rep.tokens:
            return
        t = np.asarray(list(rep.tokens.values()))
        log.info("experts of layer %d: %s; routed calibration tokens per expert min %d / median %d / max %d, "
                 "%d experts got none; matrices: %s", layer, self.describe(), t.min(), int(np.median(t)), t.max(),
                 int((t == 0).sum()), ", ".join(f"{k} {v}" for k, v in sorted(rep.methods.items())) or "-")
        if self._layer is not None and self._layer[0] == layer:
            self._layer = None

    def manifest_entry(self) -> dict:
        return {"quantizer": self.mode, "calibrated": self.calibrated, "scale_search": self.mode != "rtn",
                "min_gptq_tokens": self.min_tokens or "K/2",
                "layers": {str(k): {"routed_tokens": [r.tokens[e] for e in sorted(r.tokens)],
                                    "matrices": dict(sorted(r.methods.items()))}
                           for k, r in sorted(self.reports.items())}}
