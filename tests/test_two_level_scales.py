"""Two-level expert scales end to end (`ktconvert quantize --scale-dtype sub6`, cpu-expert-int4 layout version 3):
what the converter writes and predicts, that `verify` checks it, that ktrun runs it on the kernels and on the
reference path, and what every other reader of expert scales does with it: Marlin hot experts hold it exactly
(float16 products), the GPTQ / compressed-tensors export keeps it exactly (read back by ktconvert's own source
readers), kt-kernel's RAWINT4 refuses it naming the flags, an already-quantized source's scales are taken over only
when they are two-level values.

References: the deepseek_v3 fixture's float weights (relative error), numpy's float16 (Marlin's scales), the
source readers of the exported checkpoint, and ktrun's reference (non-kernel) expert path."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from ktlayouts.converted_dir import MANIFEST_NAME, PROJECTIONS, expert_file
from ktlayouts.cpu_expert import LayoutError, MatrixGeometry, scales_representable, two_level_rule
from ktlayouts.expert_gpu import expert_codes, gpu_group_step, hot_format_ok
from ktlayouts.gpu_formats import gpu_format_for
from safetensors import safe_open

from ktconvert.cli import main
from ktconvert.cmd_inspect import inspect_source
from ktconvert.converted_reader import ConvertedDir
from ktconvert.exact_paths import cpu_scales_ok
from ktconvert.pipeline import ConvertError, ConvertOptions, convert


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def sub6(ckpt_dir, tmp_path_factory):
    """deepseek_v3 fixture (H = 96, I = 160: both padded to the 256 super-block) with the default expert quantizer
    (GPTQ on routed calibration tokens, else the importance search) and compressed-tensors GPU layers."""
    src = ckpt_dir("deepseek_v3")
    out = tmp_path_factory.mktemp("sub6") / "conv"
    convert(src, out, ConvertOptions(method="int4-amx", group_size=None, scale_dtype="sub6", gpu_method="rtn-int4",
                                     gpu_group_size=-1, gpu_format="compressed-tensors"), show_progress=False)
    return src, out


def test_written_as_version_3_predicted_by_inspect_and_verified(sub6):
    src, out = sub6
    m = json.loads((out / MANIFEST_NAME).read_text())
    ex = m["experts"]
    assert (ex["layout_version"], ex["scale_dtype"], ex["group_size"], ex["unit"]) == (3, "sub6", 32, 256)
    files = [(rel, f) for rel, f in m["files"].items() if f["kind"] == "expert"]
    for rel, f in files:
        assert f["tensors"]["down.scales"]["dtype"] == "U8"
        with safe_open(str(out / rel), framework="pt") as h:
            assert h.metadata()["kt.layout_version"] == "3"
    tensor_bytes = sum(t["nbytes"] for _, f in files for n, t in f["tensors"].items() if not n.startswith("__pad__"))
    assert inspect_source(src, 32, "sub6")["cpu"]["int4-amx"] == tensor_bytes
    code, text = cli("inspect", src, "--scale-dtype", "sub6")
    assert code == 0 and "int4-amx" in text, text
    code, text = cli("verify", out, "--against", src)
    assert code == 0 and "verify: OK" in text, text
    conv = ConvertedDir(out)
    layer = conv.geometry.moe_layers[0]
    from ktconvert.sources import open_source
    with open_source(src) as s:
        for p, got in conv.read_expert(layer, 1).items():
            ref = s.read(s.arch.expert_tensor_name(layer, 1, p)).float().numpy()
            assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.15, p


def test_ktrun_runs_it_on_the_kernels_as_on_the_reference_path(sub6):
    from ktrun.engine import Engine
    from ktrun.models.kv_cache import Batch

    _, out = sub6
    ids = list(range(5, 69))
    logits = {}
    for kernels in (True, False):
        eng = Engine(out, ctx=128, use_kernels=kernels)
        try:
            if kernels:
                assert eng.model.experts.stats["kernel_backend"] in ("scalar", "avx2", "avx512", "amx")
            logits[kernels] = eng.model.forward(Batch.build([(eng.model.new_cache(128), ids)], "cpu"), all_logits=True)
        finally:
            eng.close()
    lp, lq = torch.log_softmax(logits[False], -1), torch.log_softmax(logits[True], -1)
    assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 1e-3     # int8 activations in the kernels, nothing else


def test_marlin_hot_experts_hold_the_two_level_scales_exactly(sub6):
    """The quantizers keep d to 6 significant bits, so every scale d * q is a float16 value: Marlin's float16 scales
    (ktrun's hot experts) dequantize to exactly the CPU tiles' weights."""
    _, out = sub6
    conv = ConvertedDir(out)
    geo = conv.geometry
    step = gpu_group_step(geo)
    assert step == 32 and hot_format_ok(geo, "marlin") is None
    layer = geo.moe_layers[-1]
    deq = conv.read_expert(layer, 2)
    fmt = gpu_format_for("marlin", 4)
    for p in PROJECTIONS:
        with safe_open(str(out / expert_file(layer, 0, 1)), framework="np") as f:
            shards = [(f.get_slice(f"{p}.qweight")[2:3][0], f.get_slice(f"{p}.scales")[2:3][0])]
        codes, scales = expert_codes(geo, p, step, shards)
        assert np.array_equal(scales.astype(np.float16).astype(np.float32), scales)
        n, k = codes.shape
        g = fmt.storage_geometry(n, k, step)
        ckn = np.full((g.k, g.n), 8, np.uint8)
        ckn[:k, :n] = codes.T
        sgn = np.zeros(g.scales_shape, np.float32)
        sgn[: scales.shape[1], :n] = scales.T
        assert np.array_equal(fmt.dequantize(fmt.pack(ckn, sgn, g, shape=(n, k))), deq[p]), p


def test_export_keeps_it_exactly_and_rawint4_refuses_it(sub6, tmp_path):
    from ktconvert.sources import open_source

    _, conv_dir = sub6
    out = tmp_path / "hf"
    code, text = cli("export", conv_dir, "-o", out, "--quiet")
    assert code == 0, text
    conv = ConvertedDir(conv_dir)
    layer = conv.geometry.moe_layers[0]
    with open_source(out) as s:                      # compressed-tensors read back by ktconvert's source reader
        for p, want in conv.read_expert(layer, 5).items():
            assert np.array_equal(s.read(s.arch.expert_tensor_name(layer, 5, p)).float().numpy(), want), p
    code, text = cli("export", conv_dir, "--for", "sglang-kt", "--kt-method", "RAWINT4", "-o", tmp_path / "kt")
    assert code != 0 and "--scale-dtype sub6" in text and "GPTQ_INT4" in text, text


def test_flags_it_needs_and_exact_take_over_only_of_two_level_values():
    with pytest.raises(ConvertError, match="--method int4-amx"):
        ConvertOptions(method="int8-amx", scale_dtype="sub6")
    with pytest.raises(ConvertError, match="--bf16-scales"):
        ConvertOptions(method="int4-amx", scale_dtype="sub6", bf16_scales=True)
    with pytest.raises(LayoutError, match="--group-size 32"):
        MatrixGeometry(16, 256, 4, 64, "sub6")
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((16, 8)) * 0.01).astype(np.float16).astype(np.float32)   # e.g. GGUF Q4_0's scales
    assert not scales_representable(s, "sub6") and not cpu_scales_ok(s, 4, 32, "sub6")
    two = two_level_rule(s)
    assert scales_representable(two, "sub6") and cpu_scales_ok(two, 4, 32, "sub6")
    assert cpu_scales_ok(two[:, :5], 4, 32, "sub6")              # a partial super-block (K = 160)
