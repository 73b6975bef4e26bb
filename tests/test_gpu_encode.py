"""GPU-layer encoder on real fixture checkpoints: which tensors, planned shapes, every format's CPU dequantization."""

import numpy as np
import pytest
import torch
from golden_data import GOLDEN, linear_entries
from ktlayouts.gpu_formats import dequantize_linear, dequantize_named, quantized_linears

from ktconvert.gpu.calib import CalibrationError
from ktconvert.gpu.dense import Bf16Encoder
from ktconvert.gpu.encoder import (
    GpuLayerEncoder,
    GpuLayerError,
    GpuLayerOptions,
    make_gpu_encoder,
    pack_quantized,
    quantization_config,
)
from ktconvert.gpu.rtn import quantize_rtn
from ktconvert.sources import open_source
from ktconvert.testing import make_checkpoint

FORMATS = ("marlin", "gptq", "compressed-tensors")


@pytest.fixture(scope="module")
def ds3(tmp_path_factory):
    return open_source(make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ds3"), num_layers=2))


def _encode_all(enc, src):
    outs, layouts = {}, {}
    for name in sorted(src.tensor_names()):
        role = src.arch.classify(name)
        if role.kind in ("expert", "skip"):
            continue
        info = src.info(name)
        plan = enc.plan(name, info.dtype, tuple(info.shape), role)
        got = enc.encode(name, src.read(name).numpy(), role)
        assert [p.name for p in plan] == list(got)
        for p in plan:
            assert tuple(got[p.name].shape) == p.shape, p
            layouts[p.name] = p.layout
        outs.update(got)
    return outs, layouts


# the fixture's K=48 (q_lora_rank) and K=200 (dense MLP) tile only with marlin's zero padding or one group per row
@pytest.mark.parametrize("fmt,method,group_size", [("marlin", "rtn-int4", 32), ("marlin", "rtn-int4", 64)]
                         + [(f, "rtn-int8", -1) for f in FORMATS] + [(f, "rtn-int4", -1) for f in FORMATS])
def test_rtn_encoding_dequantizes_within_half_a_step(ds3, fmt, method, group_size):
    enc = make_gpu_encoder(method, src=ds3, group_size=group_size, fmt=fmt)
    outs, layouts = _encode_all(enc, ds3)
    linears = quantized_linears(outs, layouts)
    want = {n for n in ds3.tensor_names() if ds3.arch.classify(n).kind in ("attention", "shared_expert", "dense_mlp")}
    assert set(linears) == want and "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in want
    bits = 4 if method.endswith("int4") else 8
    for name, layout in linears.items():
        assert layout == f"gpu-{fmt}-int{bits}"
        w = ds3.read(name).numpy()
        deq = dequantize_named(layout, outs, name)
        assert deq.shape == w.shape
        g = w.shape[1] if group_size == -1 else group_size
        wp = np.pad(w, ((0, 0), (0, -w.shape[1] % g)))
        step = np.abs(wp.reshape(w.shape[0], -1, g)).max(-1) / ((2 ** bits - 1) / 2)   # (N, groups)
        # half a step, plus the float16 rounding of the scale (2^-11 relative) times the largest code offset
        bound = np.repeat(step, g, axis=1)[:, : w.shape[1]] * (0.5 + 2 ** (bits - 1) * 2 ** -11) + 1e-7
        assert np.all(np.abs(deq - w) <= bound), name
    # everything else keeps full precision, exactly as the bf16 encoder writes it
    bf16 = Bf16Encoder()
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.0.input_layernorm.weight",
                 "lm_head.weight"):
        role = ds3.arch.classify(name)
        info = ds3.info(name)
        assert enc.plan(name, info.dtype, info.shape, role) == bf16.plan(name, info.dtype, info.shape, role)
        assert np.array_equal(outs[name], bf16.encode(name, ds3.read(name).numpy(), role)[name])


def test_formats_agree_and_marlin_pads_documented(ds3):
    name = "model.layers.0.self_attn.q_b_proj.weight"                # (N=4*48=192, K=48): K padded to 128
    deq = {}
    for fmt in FORMATS:
        enc = make_gpu_encoder("rtn-int4", src=ds3, group_size=-1, fmt=fmt)
        outs, _ = _encode_all(enc, ds3)
        deq[fmt] = dequantize_named(f"gpu-{fmt}-int4", outs, name)
        if fmt == "marlin":
            base = name[: -len(".weight")]
            assert outs[base + ".qweight"].shape == (128 // 16, 192 * 16 * 4 // 32)
            assert outs[base + ".weight_shape"].tolist() == [192, 48]
    assert np.array_equal(deq["marlin"], deq["gptq"]) and np.array_equal(deq["gptq"], deq["compressed-tensors"])


def test_unpaddable_format_names_the_tensor(ds3):
    enc = make_gpu_encoder("rtn-int4", src=ds3, group_size=128, fmt="gptq")
    name = "model.layers.0.self_attn.q_b_proj.weight"
    with pytest.raises(GpuLayerError, match=r"model\.layers\.0\.self_attn\.q_b_proj\.weight.*K=48.*marlin"):
        enc.plan(name, "BF16", tuple(ds3.info(name).shape), ds3.arch.classify(name))


@pytest.mark.parametrize("entry", linear_entries(), ids=lambda e: e["file"])
def test_encoder_path_is_byte_exact_from_the_float_weight(entry):
    """RTN from the golden float weight, then each format's packing: the reference tensors, byte for byte."""
    d = np.load(GOLDEN / entry["file"])
    q = quantize_rtn(torch.from_numpy(d["weight_fp16"].astype(np.float32)), entry["bits"], entry["group_size"])
    shape = (entry["N"], entry["K"])
    m = pack_quantized("x.weight", q, "marlin", shape)
    assert m["x.qweight"].tobytes() == d["marlin_qweight"].tobytes()
    assert m["x.scales"].tobytes() == d["marlin_scales"].tobytes()
    g = pack_quantized("x.weight", q, "gptq", shape)
    assert g["x.qweight"].tobytes() == d["gptq_qweight"].tobytes()
    assert g["x.qzeros"].tobytes() == d["gptq_qzeros_v1"].tobytes()
    c = pack_quantized("x.weight", q, "compressed-tensors", shape)
    assert c["x.weight_packed"].tobytes() == d["ct_weight_packed"].tobytes()
    assert c["x.weight_scale"].tobytes() == d["ct_weight_scale"].tobytes()
    ref = ((d["codes_kn"].astype(np.float32) - 2 ** (entry["bits"] - 1))
           * np.repeat(d["scales_fp16"].astype(np.float32), entry["K"] // d["scales_fp16"].shape[0], axis=0)).T
    for fmt, parts in (("marlin", m), ("gptq", g), ("compressed-tensors", c)):
        deq = dequantize_linear(f"gpu-{fmt}-int{entry['bits']}", {k[2:]: v for k, v in parts.items()})
        assert np.array_equal(deq, ref), fmt


def test_quantization_configs():
    g = quantization_config("gptq", 4, 128, False, False, 0.01)
    assert g["quant_method"] == "gptq" and g["bits"] == 4 and g["group_size"] == 128 and g["sym"] is True
    assert g["desc_act"] is False and g["checkpoint_format"] == "gptq"
    c = quantization_config("compressed-tensors", 8, -1, False, False, 0.01)
    w = c["config_groups"]["group_0"]["weights"]
    assert c["quant_method"] == "compressed-tensors" and c["format"] == "pack-quantized"
    assert w["num_bits"] == 8 and w["strategy"] == "channel" and w["group_size"] is None and w["symmetric"]
    assert c["ignore"] == ["lm_head"]
    assert quantization_config("marlin", 4, 128, False, False, 0.01) is None


def test_head_is_opt_in(ds3):
    name, role = "lm_head.weight", ds3.arch.classify("lm_head.weight")
    shape = tuple(ds3.info(name).shape)
    assert not make_gpu_encoder("rtn-int4", src=ds3, group_size=32).quantizes(name, shape, role)
    enc = make_gpu_encoder("rtn-int4", src=ds3, group_size=32, quantize_head=True)
    assert enc.quantizes(name, shape, role)
    out = enc.encode(name, ds3.read(name).numpy(), role)
    assert set(out) == {"lm_head.qweight", "lm_head.scales", "lm_head.weight_shape"}


def test_bad_options():
    with pytest.raises(GpuLayerError, match="--gpu-method"):
        GpuLayerOptions(method="gptq-int3")
    with pytest.raises(GpuLayerError, match="--gpu-group-size 48"):
        GpuLayerOptions(group_size=48)
    with pytest.raises(GpuLayerError, match="--gpu-format"):
        GpuLayerOptions(fmt="awq")
    with pytest.raises(GpuLayerError, match="--gpu-act-order"):
        GpuLayerOptions(act_order=True, group_size=128, fmt="marlin")


def test_method_auto_and_calibration_file_errors(ds3, tmp_path, caplog):
    assert GpuLayerEncoder(GpuLayerOptions(), src=ds3).method == "gptq-int4"       # packaged calib.txt
    missing = tmp_path / "nope.txt"
    with pytest.raises(CalibrationError, match=rf"--calib: calibration file {missing} does not exist"):
        GpuLayerEncoder(GpuLayerOptions(calib=str(missing)), src=ds3)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    with pytest.raises(CalibrationError, match=rf"--calib: calibration file {empty} is empty"):
        GpuLayerEncoder(GpuLayerOptions(method="gptq-int4", calib=str(empty)), src=ds3)
    assert GpuLayerEncoder(GpuLayerOptions(method="rtn-int4", calib=str(empty)), src=ds3).method == "rtn-int4"


@pytest.mark.parametrize("bits,group_size", [(4, 128), (4, 32), (8, -1)])
def test_compressed_tensors_library_reads_our_config_and_tensors(bits, group_size):
    """The compressed-tensors package (what vLLM uses for these checkpoints) parses our quantization_config and
    decompresses our weight_packed / weight_scale / weight_shape to our dequantized weight."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig.model_validate(quantization_config("compressed-tensors", bits, group_size, False, False,
                                                                0.01))
    scheme = cfg.config_groups["group_0"]
    assert cfg.format == "pack-quantized" and scheme.weights.num_bits == bits and scheme.weights.symmetric
    w = torch.randn(192, 512, generator=torch.Generator().manual_seed(bits))
    parts = pack_quantized("x.weight", quantize_rtn(w, bits, group_size), "compressed-tensors", (192, 512))
    state = {k[2:]: torch.from_numpy(v) for k, v in parts.items()}
    theirs = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    ours = dequantize_linear(f"gpu-compressed-tensors-int{bits}", {k[2:]: v for k, v in parts.items()})
    assert theirs.dtype == torch.float16 and theirs.shape == (192, 512)
    assert np.array_equal(theirs.numpy(), ours.astype(np.float16))


def test_auto_falls_back_to_rtn_without_calibration_text_and_says_so(ds3, tmp_path, monkeypatch, caplog):
    import logging

    from ktconvert.gpu import calib as gpu_calib

    with caplog.at_level(logging.INFO, logger="ktconvert.gpu.encoder"):
        assert GpuLayerEncoder(GpuLayerOptions(), src=ds3).method == "gptq-int4"
        assert "gptq-int4 (default, calibration text" in caplog.text
        monkeypatch.setattr(gpu_calib, "DEFAULT_CALIB", tmp_path / "not-shipped.txt")
        caplog.clear()
        assert GpuLayerEncoder(GpuLayerOptions(), src=ds3).method == "rtn-int4"
        assert "rtn-int4 (default; no calibration text for GPTQ" in caplog.text and "not-shipped.txt" in caplog.text
