"""GPU-layer encoders: every non-expert Linear as GPTQ or RTN INT4/INT8 in a registered GPU format (Marlin, GPTQ
or compressed-tensors: ktlayouts.gpu_formats); everything else as the bf16 encoder writes it.

Quantized: attention projections (DeepSeek MLA: q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; or
q_proj), shared experts, dense MLPs, and lm_head with --quantize-head. Embeddings, norms, router gates,
e_score_correction_bias and biases stay in full precision. Routed experts are not handled here (CPU files).

Output tensors of a Linear `X.weight` (N, K): `X.<part>` for the parts, dtypes and shapes the format registers
(GpuLinearFormat.part_shapes), e.g. marlin: X.qweight, X.scales, X.weight_shape, zero-padded to its tiles.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import torch
from ktlayouts.constants import DEFAULT_GPU_GROUP_SIZE, FILE_ALIGN
from ktlayouts.cpu_expert import LayoutError
from ktlayouts.gptq import GPU_GROUP_SIZES, GptqGeometry
from ktlayouts.gpu_formats import GpuLinearFormat, families_where, gpu_format_for

from ktconvert.gpu.dense import Bf16Encoder, DenseOutput
from ktconvert.gpu.gptq import GptqConfig, gptq_quantize
from ktconvert.gpu.mix import MixError, check_method, check_rules_match, matches, method_for
from ktconvert.gpu.options import GPU_FORMATS, GPU_METHODS
from ktconvert.gpu.rtn import QuantizedLinear, quantize_rtn, quantize_search
from ktconvert.writer import TensorSpec

log = logging.getLogger(__name__)

QUANTIZED_KINDS = ("attention", "shared_expert", "dense_mlp")


class GpuLayerError(ValueError):
    """A GPU-layer option or tensor that cannot be encoded; the message names the flag or tensor."""


@dataclass(frozen=True)
class GpuLayerOptions:
    method: str = "auto"            # auto: gptq-int4 when calibration text is available, else rtn-int4
    group_size: int = DEFAULT_GPU_GROUP_SIZE
    fmt: str = "marlin"
    calib: str | None = None        # --calib FILE; None: the packaged ktconvert/data/calib.txt
    quantize_head: bool = False
    calib_tokens: int = 2048
    seq_len: int = 256
    seed: int = 0
    percdamp: float = 0.01
    act_order: bool = False
    method_for: tuple[tuple[str, str], ...] = ()   # --gpu-method-for (glob, method) rules, first match wins (mix)
    mix_budget: float = 0.0         # --gpu-mix-budget: added bits per GPU-layer weight for the measured rule
    mix_method: str = "gptq-int8"   # --gpu-mix-method: what the measured rule upgrades to (sensitivity)

    def __post_init__(self):
        if self.method != "auto" and self.method not in GPU_METHODS:
            raise GpuLayerError(f"--gpu-method {self.method!r}: choose one of auto, {', '.join(GPU_METHODS)}")
        for glob, method in self.method_for:
            try:
                check_method(glob, method, GPU_METHODS)
            except MixError as e:
                raise GpuLayerError(str(e)) from None
        if self.mix_budget < 0:
            raise GpuLayerError(f"--gpu-mix-budget {self.mix_budget}: must be >= 0 (0: off)")
        if self.mix_budget and (GPU_METHODS.get(self.mix_method) is None):
            raise GpuLayerError(f"--gpu-mix-method {self.mix_method!r}: choose one of "
                                f"{', '.join(m for m, a in GPU_METHODS.items() if a)}")
        if self.group_size not in GPU_GROUP_SIZES:
            raise GpuLayerError(f"--gpu-group-size {self.group_size}: choose one of {GPU_GROUP_SIZES}")
        if self.fmt not in GPU_FORMATS:
            raise GpuLayerError(f"--gpu-format {self.fmt!r}: choose one of {', '.join(GPU_FORMATS)}")
        with_g_idx = families_where("stores_g_idx")
        if self.act_order and self.group_size != -1 and self.fmt not in with_g_idx:
            raise GpuLayerError(f"--gpu-act-order with grouped scales needs --gpu-format {' or '.join(with_g_idx)} "
                                "(g_idx); use --gpu-group-size -1 for "
                                f"{'/'.join(f for f in GPU_FORMATS if f not in with_g_idx)}")
        if self.calib_tokens < 1 or self.seq_len < 1:
            raise GpuLayerError("calibration token counts must be positive")


def resolve_method(opts: GpuLayerOptions, src=None) -> tuple[str, str]:
    """(method to run, why); 'auto' picks gptq-int4 if calibration text (and, given the source, its tokenizer) is
    available, else rtn-int4."""
    from ktconvert.gpu.calib import CalibrationError, check_layerwise, read_calibration_text, tokenizer_for

    if opts.method != "auto":
        if any(GPU_METHODS[m] and GPU_METHODS[m][0] == "gptq" for m in (opts.method, *(m for _g, m in opts.method_for))):
            _, path = read_calibration_text(opts.calib)        # missing / empty: CalibrationError naming the file
            return opts.method, f"--gpu-method {opts.method}, calibration text {path}"
        return opts.method, f"--gpu-method {opts.method}"
    try:
        _, path = read_calibration_text(opts.calib)
    except CalibrationError as e:
        if opts.calib is not None:
            raise
        return "rtn-int4", f"default; no calibration text for GPTQ: {e}"
    try:
        if src is not None:
            tokenizer_for(src)
            check_layerwise(src)
    except CalibrationError as e:
        return "rtn-int4", f"default; {e}"
    return "gptq-int4", f"default, calibration text {path}"


def calibration_available(opts: GpuLayerOptions, src) -> bool:
    from ktconvert.gpu.calib import CalibrationError, check_layerwise, read_calibration_text, tokenizer_for
    try:
        read_calibration_text(opts.calib)
        tokenizer_for(src)
        check_layerwise(src)
    except CalibrationError as e:
        if opts.calib is not None:
            raise
        log.info("no calibration for the GPU layers' importance (%s): uniform weights", e)
        return False
    return True


class GpuLayerEncoder:
    """DenseEncoder (ktconvert.gpu.dense) writing quantized GPU layers; `src` is needed for GPTQ only."""

    def __init__(self, opts: GpuLayerOptions, src=None):
        self.opts = opts
        self.method, why = resolve_method(opts, src)
        self.name = self.method
        log.info("GPU layers: %s (%s), group size %d, %s format", self.method, why, opts.group_size, opts.fmt)
        self.bf16 = Bf16Encoder()
        self.src = src
        self._calibrator = None
        self.algo, self.bits = self.method_algo(self.method)
        self.rules = tuple(opts.method_for)
        algos = {self.algo} | {self.method_algo(m)[0] for _g, m in self.rules}
        if "gptq" in algos and src is None:
            raise GpuLayerError(f"--gpu-method {self.method} (or a --gpu-method-for rule) needs the source "
                                "checkpoint for calibration")
        if self.rules:
            log.info("GPU layers: --gpu-method-for %s", ", ".join(f"{g}={m}" for g, m in self.rules))
        # search-int*: importance from calibration when text and tokenizer are there, else uniform weights
        self.calibrated = "gptq" in algos or ("search" in algos and src is not None
                                              and calibration_available(opts, src))
        self.quantized_names: list[str] = []
        self.capture_experts = False     # set by the pipeline when the routed-expert quantizer shares calibration
        self._paths: dict[str, tuple[bool, str]] = {}     # quantized source Linears: (taken over exactly, why not)
        self._mixed = False
        self.mix_applied = False    # the measured rule ran (apply_mix)
        self.mixed_rules: tuple[tuple[str, str], ...] = ()   # the rules apply_mix chose
        if self.rules and src is not None:
            try:
                check_rules_match(self.rules, self.candidates())
            except MixError as e:
                raise GpuLayerError(str(e)) from None

    @staticmethod
    def method_algo(method: str) -> tuple[str | None, int]:
        """(algorithm, bits) of a method name; (None, 16) for bf16."""
        algo = GPU_METHODS[method]
        return algo if algo else (None, 16)

    def method_of(self, name: str) -> str:
        """The method of Linear `name`: its first --gpu-method-for rule, else --gpu-method."""
        return method_for(self.rules, name, self.method)

    def bits_of(self, name: str) -> int:
        return self.method_algo(self.method_of(name))[1]

    def candidates(self, mtp: bool = True) -> list[str]:
        """The source's Linears this encoder's kinds cover (whatever their method), in checkpoint order; MTP layers'
        too unless mtp is False."""
        out = []
        for name in self.src.tensor_names():
            shape = tuple(self.src.info(name).shape)
            role = self.src.arch.classify(name, keep_mtp=mtp)
            if name.endswith(".weight") and len(shape) == 2 and self._kind_quantized(role):
                out.append(name)
        return out

    def _decoder_linears(self) -> list[str]:
        """The quantized Linears of the decoder layers (no MTP layer, no lm_head)."""
        return [n for n in self.candidates(mtp=False)
                if self.src.arch.classify(n).kind != "head" and self.method_algo(self.method_of(n))[0] is not None]

    def decoder_weights(self) -> int:
        """Logical weights of the decoder layers' quantized Linears (the measured rule's budget is per one)."""
        total = 0
        for n in self._decoder_linears():
            a, b = self.src.info(n).shape
            total += int(a) * int(b)
        return total

    def upgrade_candidates(self, upgrade_bits: int) -> list[str]:
        """The Linears the measured rule may upgrade: decoder-layer Linears at fewer bits, no user rule on them."""
        return [n for n in self._decoder_linears()
                if self.bits_of(n) < upgrade_bits and not any(matches(g, n) for g, _m in self.opts.method_for)]

    def apply_mix(self) -> None:
        """Run the measured rule (--gpu-mix-budget > 0 and a calibrated encoder): its rules after the user's."""
        if not self.opts.mix_budget or self._mixed:
            return
        self._mixed = True
        if not self.measures_mix():
            log.info("GPU layers: %s %g is not applied: it needs calibrated %s (this conversion: %s)",
                     "--gpu-mix-budget", self.opts.mix_budget, "--gpu-method gptq/search", self.method)
            return
        from ktconvert.gpu.sensitivity import sensitive_rules
        self.mix_applied = True
        added = sensitive_rules(self, self.opts.mix_budget, self.opts.mix_method)
        self.rules = self.rules + added
        self.mixed_rules = added

    def measures_mix(self) -> bool:
        """Whether apply_mix runs the measured rule: a --gpu-mix-budget, and a calibrated gptq / search encoder."""
        return bool(self.opts.mix_budget) and self.calibrated and self.algo in ("gptq", "search")

    def stored_nbytes(self, name: str, bits: int) -> int:
        """File bytes of Linear `name` stored at `bits` in --gpu-format: its parts (padding and scales included),
        each padded to FILE_ALIGN as the writer lays them out (ktconvert.writer.build_header)."""
        n, k = self.src.info(name).shape
        fmt = gpu_format_for(self.opts.fmt, bits)
        parts = fmt.part_shapes(fmt.storage_geometry(int(n), int(k), self.opts.group_size))
        return sum(-(-TensorSpec(part, dt, tuple(s)).nbytes // FILE_ALIGN) * FILE_ALIGN for part, dt, s in parts)

    def _kind_quantized(self, role) -> bool:
        return role.kind in QUANTIZED_KINDS or (role.kind == "head" and self.opts.quantize_head)

    # --- which tensors, which shapes -------------------------------------------------------------------------
    def quantizes(self, name: str, shape: tuple[int, ...], role) -> bool:
        if not name.endswith(".weight") or len(shape) != 2 or not self._kind_quantized(role):
            return False
        return self.method_algo(self.method_of(name))[0] is not None

    @property
    def format(self) -> GpuLinearFormat:
        """The registered GPU format of --gpu-method's Linears (--gpu-format at its bits); format_of: one Linear's."""
        return gpu_format_for(self.opts.fmt, self.bits)

    def format_of(self, name: str) -> GpuLinearFormat:
        return gpu_format_for(self.opts.fmt, self.bits_of(name))

    def geometry(self, name: str, shape: tuple[int, ...]) -> GptqGeometry:
        n, k = shape
        try:
            return self.format_of(name).storage_geometry(n, k, self.opts.group_size)
        except LayoutError as e:
            padding = " or ".join(f"--gpu-format {f}" for f in families_where("pads"))
            raise GpuLayerError(f"tensor {name} of shape (N={shape[0]}, K={shape[1]}) cannot be stored as "
                                f"--gpu-format {self.opts.fmt} with --gpu-group-size {self.opts.group_size}: {e} "
                                f"({padding} zero-pads such shapes)") from None

    def plan(self, name, src_dtype, shape, role) -> list[DenseOutput]:
        if not self.quantizes(name, tuple(shape), role):
            return self.bf16.plan(name, src_dtype, shape, role)
        g, fmt = self.geometry(name, tuple(shape)), self.format_of(name)
        base = name[: -len(".weight")]
        return [DenseOutput(f"{base}.{part}", dt, tuple(s), fmt.name) for part, dt, s in fmt.part_shapes(g)]

    # --- encoding --------------------------------------------------------------------------------------------
    def _pad(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, GptqGeometry]:
        g = self.geometry(name, tuple(w.shape))
        if (g.n, g.k) != tuple(w.shape):
            w = torch.nn.functional.pad(w, (0, g.k - w.shape[1], 0, g.n - w.shape[0]))
        return w, g

    def exact(self, name: str, shape: tuple[int, int]) -> QuantizedLinear | None:
        """An already-quantized source Linear whose integer grid this format holds exactly: its codes and scales,
        unchanged (ktconvert.exact_paths.gpu_codes); None otherwise (then it is quantized from its dequantized
        float32 values, and the log gives the error)."""
        from ktconvert.exact_paths import gpu_codes, int_grid, quant_format

        fmt = quant_format(self.src, name) if self.src is not None else None
        if fmt is None:
            return None
        grid = int_grid(self.src, name) if fmt.kind in ("int", "mxfp4") else None
        if grid is None:
            self._paths[name] = (False, "not an integer grid")
            return None
        geom = self.geometry(name, shape)
        got, why = gpu_codes(grid, self.format_of(name), geom, self.opts.group_size, keep_g_idx=self.opts.act_order)
        self._paths[name] = (got is not None, why)
        return None if got is None else QuantizedLinear(*got, geom)

    def path_of(self, name: str) -> tuple[bool, str] | None:
        """(taken over exactly, why not) of a quantized source Linear this encoder wrote; None if not one."""
        return self._paths.get(name)

    def quantize_with_hessian(self, name: str, w: torch.Tensor, h: torch.Tensor) -> QuantizedLinear:
        """GPTQ of one weight (N, K) with its Hessian (K, K), zero-padded to the layout's geometry (or the source's
        own codes where they fit exactly: no GPTQ then)."""
        exact = self.exact(name, tuple(w.shape))
        if exact is not None:
            return exact
        wp, g = self._pad(name, w.to(torch.float32))
        if g.k != h.shape[0]:
            hp = torch.zeros(g.k, g.k, dtype=torch.float32)
            hp[: h.shape[0], : h.shape[0]] = h
            h = hp
        cfg = GptqConfig(bits=self.bits_of(name), group_size=self.opts.group_size, percdamp=self.opts.percdamp,
                         act_order=self.opts.act_order)
        q, _ = gptq_quantize(wp, h, cfg, name=name)
        return q

    def calibrator(self, create: bool = True):
        """The layer-by-layer calibration driver (shared with the routed-expert quantizer), created on first use;
        None when this encoder does not calibrate (no calibration text for search-int*)."""
        if self._calibrator is None and create and self.calibrated:
            from ktconvert.gpu.calib import make_calibrator

            def is_target(hub: str) -> bool:
                info = self.src.info(hub)
                return self.quantizes(hub, tuple(info.shape), self.src.arch.classify(hub))
            self._calibrator = make_calibrator(self.src, self.opts.calib, self.opts.calib_tokens, self.opts.seq_len,
                                               self.opts.seed, self.quantize_calibrated, is_target,
                                               self.opts.quantize_head, capture_experts=self.capture_experts)
        return self._calibrator

    def quantize_calibrated(self, name: str, w: torch.Tensor, h: torch.Tensor) -> QuantizedLinear:
        algo, bits = self.method_algo(self.method_of(name))
        if algo == "gptq":
            return self.quantize_with_hessian(name, w, h)
        exact = self.exact(name, tuple(w.shape))
        if exact is not None:
            return exact
        wp, g = self._pad(name, w.to(torch.float32))
        if algo == "rtn":                   # a --gpu-method-for rtn rule in a calibrated conversion
            return quantize_rtn(wp, bits, self.opts.group_size)
        imp = torch.zeros(g.k)
        imp[: h.shape[0]] = torch.diag(h)
        return quantize_search(wp, bits, self.opts.group_size, importance=imp)

    def _calibrated(self, name: str, role) -> QuantizedLinear:
        return self.calibrator().result(name, role.layer if role.kind != "head" else None)

    def encode(self, name, tensor, role) -> dict[str, np.ndarray]:
        t = torch.as_tensor(np.ascontiguousarray(tensor, dtype=np.float32))
        if not self.quantizes(name, tuple(t.shape), role):
            return self.bf16.encode(name, tensor, role)
        # an MTP layer's Linears have no calibration inputs (the driver runs the main layers): uncalibrated
        calibrated = self.calibrated and not getattr(role, "mtp", False)
        q = None if calibrated else self.exact(name, tuple(t.shape))
        algo, bits = self.method_algo(self.method_of(name))
        if calibrated:
            q = self._calibrated(name, role)
        elif q is None and algo == "search":
            q = quantize_search(self._pad(name, t)[0], bits, self.opts.group_size)
        elif q is None:
            q = quantize_rtn(self._pad(name, t)[0], bits, self.opts.group_size)
        self.quantized_names.append(name)
        return pack_quantized(name, q, self.opts.fmt, tuple(t.shape))

    def quantization_config(self) -> dict | None:
        """config.json `quantization_config` for the gptq / compressed-tensors formats (None otherwise)."""
        if not self.rules:
            return quantization_config(self.opts.fmt, self.bits, self.opts.group_size, self.opts.act_order,
                                       self.opts.quantize_head, self.opts.percdamp) if self.algo else None
        # mixed: the base scheme at --gpu-method's bits (or the first quantized Linear's), and per module the
        # Linears whose bits differ (an exact-name regex each) or that stay unquantized
        bits = {n: self.bits_of(n) if self.method_algo(self.method_of(n))[0] else None for n in self.candidates()}
        base = self.bits if self.algo else next((b for b in bits.values() if b), None)
        if base is None:
            return None
        qc = quantization_config(self.opts.fmt, base, self.opts.group_size, self.opts.act_order,
                                 self.opts.quantize_head, self.opts.percdamp)
        if qc is None:
            return None
        fmt = gpu_format_for(self.opts.fmt, base)
        module = {n: n.removesuffix(".weight") for n in bits}
        for n, b in bits.items():
            if b is not None and b != base:
                qc = fmt.with_scheme(qc, re.escape(module[n]) + "$", b, self.opts.group_size)
        off = [module[n] for n, b in bits.items() if b is None]
        return fmt.with_unquantized(qc, off) if off else qc


def pack_quantized(name: str, q: QuantizedLinear, fmt: str, logical_shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """One quantized Linear `name` ('X.weight', logical (N, K)) in --gpu-format `fmt` -> {'X.<part>': array}."""
    base = name[: -len(".weight")]
    parts = gpu_format_for(fmt, q.geom.bits).pack(q.codes_kn, q.scales_gn, q.geom, g_idx=q.g_idx,
                                                   shape=logical_shape, name=name)
    return {f"{base}.{k}": v for k, v in parts.items()}


def quantization_config(fmt: str, bits: int, group_size: int, act_order: bool, quantize_head: bool,
                        percdamp: float) -> dict | None:
    """The quantization_config vLLM and transformers recognise for a checkpoint in `fmt` (marlin: ours, None)."""
    return gpu_format_for(fmt, bits).quantization_config(group_size, act_order, quantize_head, percdamp)


def make_gpu_encoder(method: str = "auto", src=None, **options) -> GpuLayerEncoder | Bf16Encoder:
    """Entry point for the pipeline: bf16 -> the plain Bf16Encoder, else a GpuLayerEncoder."""
    if method == "bf16":
        return Bf16Encoder()
    return GpuLayerEncoder(GpuLayerOptions(method=method, **options), src=src)

