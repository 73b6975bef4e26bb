"""Quantizers shared by the CPU expert and GPU layouts: per-group scale search (scales), routed-expert
quantization with calibration (experts: rtn / search / gptq)."""
from __future__ import annotations


def make_expert_quantizer(src, opts, encoder):
    """The routed-expert quantizer of a conversion (ConvertOptions), or None for the plain reference rule / bf16.
    Shares the GPU encoder's calibration pass when it has one, else runs its own (float weights kept)."""
    from ktlayouts.expert_formats import expert_format_of_method

    if not expert_format_of_method(opts.method).quantized or opts.expert_quantizer == "rtn":
        return None
    import logging

    from ktconvert.quantizers.experts import ExpertQuantizer

    log = logging.getLogger("ktconvert.quantizers")
    calibrator_fn = None
    if _calibration_available(src, opts):
        if getattr(encoder, "calibrated", False):       # GPTQ / search GPU layers: one calibration pass for both
            encoder.capture_experts = True
            calibrator_fn = encoder.calibrator
        else:
            cal = {}

            def calibrator_fn():
                if "c" not in cal:
                    from ktconvert.gpu.calib import calibration_matmul, make_calibrator
                    matmul = calibration_matmul()
                    log.info("routed experts: calibration forward with %s matmuls", "int4-tile (libktkernels)"
                             if matmul == "kernels" else matmul)
                    cal["c"] = make_calibrator(src, opts.calib, opts.calib_tokens, 256, 0, lambda *a: None,
                                               lambda hub: False, capture_experts=True, matmul=matmul)
                return cal["c"]
    own = calibrator_fn is not None and not getattr(encoder, "calibrated", False)
    q = ExpertQuantizer(opts.expert_quantizer, calibrator_fn, opts.expert_gptq_min_tokens, scale_dtype=opts.scale_dtype,
                        own_calibration=own)
    log.info("routed experts: %s", q.describe())
    return q


def _calibration_available(src, opts) -> bool:
    """Calibration text, the checkpoint's tokenizer and a transformers model class for its layers (the driver runs
    them); without them `auto` falls back to the uniform search (logged), explicit gptq/search fail naming why."""
    import logging

    from ktconvert.gpu.calib import (
        CalibrationError,
        check_layerwise,
        check_transformers_classes,
        read_calibration_text,
        tokenizer_for,
    )
    try:
        read_calibration_text(opts.calib)
        tokenizer_for(src)
        check_layerwise(src)
        try:
            check_transformers_classes(src.config, src.arch.model_type)
        except (KeyError, ValueError, TypeError) as e:
            raise CalibrationError(f"transformers has no model class for {src.arch.model_type!r} ({e})") from None
    except CalibrationError as e:
        if opts.calib is not None or opts.expert_quantizer == "gptq":
            raise
        logging.getLogger("ktconvert.quantizers").info("routed experts: no calibration (%s)", e)
        return False
    return True
