"""Already-quantized checkpoints as conversion input: compressed-tensors (fixtures written by the compressed-tensors
library's own compressors), GPTQ, AWQ and FP8 with per-channel / per-tensor scales (written from their published bit
layouts in tests/quantized_writers.py, which shares nothing with ktconvert's packers), GGUF Q4_0.

Readers must reproduce the format's own dequantization exactly; exact paths must give `verify --against` error 0
for every tensor they took over; re-quantized ones stay within verify's limits, and the log reports their error;
ktrun's logits stay close to transformers' forward on the same checkpoint; bad input is named.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from quantized_writers import awq_checkpoint, fp8_scaled_checkpoint, gptq_checkpoint, read_checkpoint

from ktconvert.cmd_verify import compare_to_source
from ktconvert.converted_reader import ConvertedDir
from ktconvert.sources import SourceError, open_source
from ktconvert.testing import make_checkpoint
from ktconvert.testing.quantized import EXPERTS_ONLY, compressed_tensors_checkpoint

KTCONVERT = [sys.executable, "-m", "ktconvert"]
# deepseek_v3 with every Linear's K a multiple of 32 (compressed-tensors' group quantization requires it)
DIMS = {"intermediate_size": 256, "q_lora_rank": 64}


def quantize(src, out, *args, ok=True) -> subprocess.CompletedProcess:
    """The main model only (--no-keep-mtp): the counts below are its routed experts and GPU layers."""
    r = subprocess.run([*KTCONVERT, "quantize", str(src), "-o", str(out), "--quiet", "--no-keep-mtp",
                        *map(str, args)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert (r.returncode == 0) == ok, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("q_bf16"), init_scale=8.0, **DIMS)  # peaked logits


@pytest.fixture(scope="module")
def ct(bf16, tmp_path_factory):
    """Callable (preset, **options) -> a compressed-tensors checkpoint of `bf16`, built once per module."""
    built = {}

    def get(preset, **kw):
        key = (preset, tuple(sorted(kw.items())))
        if key not in built:
            built[key] = compressed_tensors_checkpoint(bf16, tmp_path_factory.mktemp(f"ct_{preset}"), preset, **kw)
        return built[key]
    return get


def layer_linears(src, layer=1):
    return [n for n in src.tensor_names() if n.startswith(f"model.layers.{layer}.") and src.quant_format(n)]


# --- readers: the format's own dequantization, exactly ----------------------------------------------------------

CT_CASES = [("W4A16", {"group_size": 32}), ("W8A16", {"group_size": -1}), ("W4A16_ASYM", {"group_size": 32}), ("FP8_DYNAMIC", {}),
            ("FP8", {}), ("FP8_BLOCK", {"block": (32, 32)}), ("MXFP4A16", {}), ("MXFP8A16", {}), ("NVFP4A16", {})]


@pytest.mark.parametrize(("preset", "kw"), CT_CASES, ids=[c[0] for c in CT_CASES])
def test_compressed_tensors_reader_equals_the_library_decompression(ct, preset, kw):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    d = ct(preset, **kw)
    qc = QuantizationConfig.model_validate(json.loads((d / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    src = open_source(d)
    names = layer_linears(src)
    assert len(names) == 16 * 3 + 3 + 5                    # experts, shared expert, MLA projections
    for name in names:
        base = name.removesuffix(".weight")
        state = {}
        for full, shard in index.items():
            if full.startswith(base + ".") and "." not in full[len(base) + 1:]:
                with safe_open(str(d / shard), framework="pt") as f:
                    state[full[len(base) + 1:]] = f.get_tensor(full)
        if state["weight_scale"].is_floating_point():      # the library computes in the scale's dtype: float32
            state["weight_scale"] = state["weight_scale"].float()
        want = compressor.decompress(state, scheme)["weight"].float().numpy()
        got = src.read(name).numpy()
        assert got.dtype == np.float32 and got.shape == want.shape
        if preset.startswith("NVFP4"):    # the library divides by the global scale in bfloat16: equal to its precision
            np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=0, err_msg=f"{preset} {name}")
        else:
            np.testing.assert_array_equal(got, want, err_msg=f"{preset} {name}")
        fmt = src.quant_format(name)
        assert fmt.family == "compressed-tensors" and src.info(name).shape == tuple(want.shape)
    assert src.quant_format("model.layers.1.mlp.gate.weight") is None           # ignored: the router stays BF16
    assert src.quant_format("lm_head.weight") is None


def test_gptq_and_awq_readers_equal_their_bit_layouts(bf16, tmp_path):
    for tag, (d, values) in {
        "gptq-sym": gptq_checkpoint(bf16, tmp_path / "g1", bits=4, group_size=32),
        "gptq-asym-v2-8bit": gptq_checkpoint(bf16, tmp_path / "g2", bits=8, group_size=-1, sym=False,
                                             version="gptq_v2"),
        "gptq-desc-act": gptq_checkpoint(bf16, tmp_path / "g3", bits=4, group_size=32, desc_act=True),
        "awq": awq_checkpoint(bf16, tmp_path / "a1", group_size=32),
        "fbgemm-fp8": fp8_scaled_checkpoint(bf16, tmp_path / "f1"),
        "fp8-per-tensor": fp8_scaled_checkpoint(bf16, tmp_path / "f2", per_channel=False, quant_method="fp8"),
        "fp8-channel-[N]": fp8_scaled_checkpoint(bf16, tmp_path / "f3", flat_scales=True),
        "fp8-tensor-scalar": fp8_scaled_checkpoint(bf16, tmp_path / "f4", per_channel=False, flat_scales=True,
                                                   quant_method="fp8"),
    }.items():
        src = open_source(d)
        assert set(values) <= set(src.tensor_names()), tag
        for name, want in values.items():
            np.testing.assert_array_equal(src.read(name).numpy(), want, err_msg=f"{tag} {name}")
            assert src.quant_format(name) is not None, (tag, name)


def test_awq_reader_agrees_with_compressed_tensors_awq_converter(bf16, tmp_path):
    """compressed-tensors' own AutoAWQ converter (an independent unpacker of AWQ's order) turns the AWQ tensors
    into pack-quantized ones; the library's decompression of those equals our reading of the AWQ original."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    d, _values = awq_checkpoint(bf16, tmp_path / "awq", group_size=32)
    conv = AutoAWQConverter.from_autoawq_config(json.loads((d / "config.json").read_text())["quantization_config"])
    scheme = conv.update_config(None).config_groups["config_group_0"]
    _index, tensors = read_checkpoint(d)
    src = open_source(d)
    for base in ("model.layers.1.mlp.experts.5.down_proj", "model.layers.0.self_attn.kv_b_proj"):
        part = {k: v for k, v in tensors.items() if k.startswith(base + ".")}
        out = conv.process(dict(part))
        state = {k[len(base) + 1:]: v for k, v in out.items()}
        state["weight_scale"] = state["weight_scale"].float()
        want = PackedQuantizationCompressor.decompress(state, scheme)["weight"].numpy()
        np.testing.assert_array_equal(src.read(base + ".weight").numpy(), want, err_msg=base)


# --- conversions: exact paths give error 0 ----------------------------------------------------------------------

def _rows(conv_dir, src_dir):
    conv = ConvertedDir(conv_dir)
    rows = compare_to_source(conv, str(src_dir), per_expert=True)
    conv.close()
    return {what: (err, limit, is_expert) for what, err, limit, is_expert in rows}


def _exact_case(ct, bf16, tmp_path, case):
    if case == "ct-int4-g32":
        return ct("W4A16", group_size=32), ["--gpu-method", "rtn-int4", "--gpu-group-size", "32", "--numa-nodes", 2]
    if case == "ct-int4-g32-as-int8":
        return ct("W4A16", group_size=32), ["--method", "int8-amx", "--group-size", 32, "--gpu-method", "rtn-int8",
                                            "--gpu-group-size", 32, "--gpu-format", "compressed-tensors"]
    if case == "ct-int8-channel":
        return ct("W8A16", group_size=-1), ["--gpu-method", "rtn-int8", "--gpu-group-size", -1]
    if case == "ct-experts-only-int4":
        return ct("W4A16", group_size=32, targets=(EXPERTS_ONLY,)), ["--gpu-method", "bf16"]
    if case == "gptq-int4-g32":
        return gptq_checkpoint(bf16, tmp_path / "gptq", group_size=32)[0], [
            "--gpu-method", "gptq-int4", "--gpu-group-size", 32, "--gpu-format", "gptq"]
    if case == "gptq-asym-int4":
        return gptq_checkpoint(bf16, tmp_path / "gptq", group_size=32, sym=False)[0], ["--gpu-method", "bf16"]
    if case == "awq-int4-g32":
        return awq_checkpoint(bf16, tmp_path / "awq", group_size=32)[0], ["--gpu-method", "rtn-int4"]
    if case == "mxfp4":
        return ct("MXFP4A16"), ["--gpu-method", "bf16", "--numa-nodes", 2]
    raise ValueError(case)


EXACT = {  # case -> (method and group --method auto must pick, GPU layers taken over exactly)
    "ct-int4-g32": ("int4-amx", 32, True), "ct-int4-g32-as-int8": ("int8-amx", 32, True),
    "ct-int8-channel": ("int8-amx", 32, True), "ct-experts-only-int4": ("int4-amx", 32, False),
    "gptq-int4-g32": ("int4-amx", 32, True), "gptq-asym-int4": ("int8-amx", 32, False),
    "awq-int4-g32": ("int8-amx", 32, False), "mxfp4": ("int8-amx", 32, False)}


@pytest.mark.parametrize("case", list(EXACT))
def test_exact_paths_verify_with_error_zero(ct, bf16, tmp_path, case):
    src, args = _exact_case(ct, bf16, tmp_path, case)
    method, group, gpu_exact = EXACT[case]
    auto = "--method" not in args
    r = quantize(src, tmp_path / "out", *(["--method", "auto"] if auto else []), *args)
    if auto:
        assert f"--method auto: {method} --group-size {group} (exact target of" in r.stderr, r.stderr
    assert re.search(r"experts: 96 taken over exactly from .* no float round trip, error 0\)", r.stderr), r.stderr
    assert "re-quantized to int" not in r.stderr.split("experts:")[-1]
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (m["method"], m["group_size"]) == (method, group)
    rows = _rows(tmp_path / "out", src)
    experts = {w: e for w, (e, _l, is_e) in rows.items() if is_e}
    assert len(experts) == 2 * 16 * 3 and all(e == 0.0 for e in experts.values()), experts
    quantized_gpu = [w for w, (_e, _l, is_e) in rows.items() if not is_e and open_source(src).quant_format(w)]
    assert quantized_gpu or case == "ct-experts-only-int4"
    if gpu_exact:
        assert "GPU layers: 24 taken over exactly" in r.stderr, r.stderr
        assert all(rows[w][0] == 0.0 for w in quantized_gpu), {w: rows[w][0] for w in quantized_gpu}
    if case == "ct-int4-g32":         # the command itself, once
        v = subprocess.run([*KTCONVERT, "verify", str(tmp_path / "out"), "--against", str(src), "--quiet"],
                           capture_output=True, text=True, timeout=300, check=False)
        assert v.returncode == 0 and "verify: OK" in v.stdout, v.stdout + v.stderr
        assert re.search(r"(\d+) tensors compared, \1 equal to the source's own dequantized values", v.stdout), v.stdout


INEXACT = {  # case -> (quantize arguments, the reason the log gives)
    "mxfp4-to-int4": (lambda ct, bf16, p: ct("MXFP4A16"), ["--method", "int4-amx", "--group-size", 32],
                      "outside int4's [-8, 7]"),
    "fp8-channel-to-int8": (lambda ct, bf16, p: ct("FP8_DYNAMIC"), ["--method", "auto"], "not an integer grid"),
    "mxfp8-to-int8": (lambda ct, bf16, p: ct("MXFP8A16"), ["--method", "int8-amx", "--group-size", 32],
                      "not an integer grid"),
    "fbgemm-fp8-to-int4": (lambda ct, bf16, p: fp8_scaled_checkpoint(bf16, p)[0], ["--method", "int4-amx"],
                           "not an integer grid"),
    "gptq-act-order-to-int4": (lambda ct, bf16, p: gptq_checkpoint(bf16, p, group_size=32, desc_act=True)[0],
                               ["--method", "int4-amx", "--group-size", 32],
                               "do not cover whole groups of 32 input channels"),
    "ct-int4-g32-to-g64": (lambda ct, bf16, p: ct("W4A16", group_size=32), ["--method", "int4-amx", "--group-size",
                                                                            64], "K=96 is not a multiple of group 64"),
}


@pytest.mark.parametrize("case", list(INEXACT))
def test_requantized_paths_log_their_error_and_stay_within_verify_limits(ct, bf16, tmp_path, case):
    make, args, reason = INEXACT[case]
    src = make(ct, bf16, tmp_path / "src")
    r = quantize(src, tmp_path / "out", *args, "--gpu-method", "rtn-int4", "--gpu-group-size", "32")
    line = next(x for x in r.stderr.splitlines() if x.startswith("ktconvert: experts:"))
    assert "96 dequantized and re-quantized" in line and reason in line, r.stderr
    logged = float(re.search(r"max relative error ([0-9.e-]+) \((\S+)\)", line).group(1))
    rows = _rows(tmp_path / "out", src)
    worst = max(e for e, _l, is_e in rows.values() if is_e)
    assert logged == pytest.approx(worst, rel=1e-3)            # the log's error is verify's error
    assert all(e <= lim for e, lim, _ in rows.values()), {w: v for w, v in rows.items() if v[0] > v[1]}
    assert 0 < worst


def test_act_order_gptq_gpu_layers_keep_their_g_idx_in_the_gptq_format(bf16, tmp_path):
    src, _ = gptq_checkpoint(bf16, tmp_path / "src", group_size=32, desc_act=True)
    r = quantize(src, tmp_path / "out", "--method", "int8-amx", "--gpu-method", "rtn-int4", "--gpu-group-size", 32,
                 "--gpu-format", "gptq", "--gpu-act-order")
    assert "GPU layers: 24 taken over exactly from gptq int4 g32 act-order" in r.stderr, r.stderr
    rows = _rows(tmp_path / "out", src)
    s = open_source(src)
    assert all(rows[w][0] == 0.0 for w in rows if not rows[w][2] and s.quant_format(w))


def test_gguf_q4_0_experts_convert_exactly(ckpt_dir, tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from gguf_export import Q, export_gguf

    path = export_gguf(ckpt_dir("deepseek_v3"), tmp_path / "m-q4_0.gguf", Q.Q4_0)
    r = quantize(path, tmp_path / "out", "--method", "auto")
    assert "--method auto: int4-amx --group-size 32 (exact target of GGUF Q4_0)" in r.stderr, r.stderr
    assert "experts: 96 taken over exactly from GGUF Q4_0" in r.stderr
    rows = _rows(tmp_path / "out", path)
    assert all(e == 0.0 for e, _l, is_e in rows.values() if is_e)


# --- ktrun against transformers on the same quantized checkpoint -------------------------------------------------

def _transformers_logits(src, ids):
    import contextlib
    import io

    from transformers import AutoModelForCausalLM
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    for p in model.parameters():           # the decompressed weights come in the scales' bf16: compute in float32
        if p.is_floating_point():
            p.data = p.data.float()
    with torch.no_grad():
        return model, model(torch.tensor([ids])).logits[0].double()


# mean KL(transformers || ktrun) bound, nats per position (peaked logits: lm_head x8). Measured: 1.0e-5 for the exact
# int4 path (transformers computes with its bf16-rounded decompression, ktrun with the exact float32 values),
# 2.1e-5 for FP8 per channel re-quantized to int8 (ktrun's reference experts; KV and attention in float32 both)
@pytest.mark.parametrize(("preset", "kw", "method", "max_kl"), [
    ("W4A16", {"group_size": 32}, "auto", 1e-4),                  # exact path: int4 g32 codes taken over
    ("FP8_DYNAMIC", {}, "int8-amx", 1e-4),                        # FP8 per channel re-quantized to int8
])
def test_ktrun_logits_follow_transformers_on_the_quantized_checkpoint(ct, tmp_path, preset, kw, method, max_kl):
    from ktrun.engine import Engine
    from ktrun.models.kv_cache import Batch
    from runtime_helpers import PROMPT, kl

    src = ct(preset, **kw)
    quantize(src, tmp_path / "out", "--method", method, "--gpu-method", "bf16")
    eng = Engine(tmp_path / "out", ctx=128, use_kernels=False)
    ids = eng.tokenizer.encode(PROMPT)
    got = eng.model.forward(Batch.build([(eng.model.new_cache(128), ids)], "cpu"), all_logits=True).double()
    eng.close()
    model, want = _transformers_logits(src, ids)
    d = kl(want, got)
    print(f"{preset} -> {method}: KL(transformers || ktrun) mean {d.mean():.2e} max {d.max():.2e}")
    assert d.mean() < max_kl and d.max() < 10 * max_kl
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9
    if method == "auto":       # exact: transformers' decompressed experts are our values rounded once to its bf16
        conv = ConvertedDir(tmp_path / "out")
        sd = model.state_dict()
        for e in (0, 15):
            ours = conv.read_expert(1, e)
            gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"][e]
            want_gu = torch.from_numpy(np.concatenate([ours["gate"], ours["up"]])).bfloat16().float()
            assert torch.equal(gate_up, want_gu)
            assert torch.equal(sd["model.layers.1.mlp.experts.down_proj"][e],
                               torch.from_numpy(ours["down"]).bfloat16().float())
        conv.close()


# --- inspect, and bad input named -----------------------------------------------------------------------------------

def test_inspect_shows_stored_formats_and_the_exact_target(ct, bf16):
    r = subprocess.run([*KTCONVERT, "inspect", str(ct("W4A16", group_size=32))], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert re.search(r"compressed-tensors int4 g32\s+120 tensors", r.stdout), r.stdout
    assert "--method auto: int4-amx --group-size 32 (exact target of compressed-tensors int4 g32)" in r.stdout
    from ktconvert.cmd_inspect import inspect_source
    a, b = inspect_source(ct("W4A16", group_size=32), 128), inspect_source(bf16, 128)
    assert a["params"] == b["params"]                           # logical shapes: the same parameter counts


def _edit_config(d, edit):
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))


def test_bad_quantized_input_is_named(ct, bf16, tmp_path):
    import shutil

    d = shutil.copytree(ct("W4A16", group_size=32), tmp_path / "ct")
    _edit_config(d, lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=64))
    r = quantize(d, tmp_path / "o1", ok=False)
    assert re.search(r"tensor model\.layers\.\d+\.\S+\.weight_scale: shape \[\d+, \d+\] disagrees with .*"
                     r"quantization_config\.config_groups\.group_0\.weights\.group_size", r.stderr), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o1" / "manifest.json").exists()

    g, _ = gptq_checkpoint(bf16, tmp_path / "gptq", desc_act=True, drop_g_idx=True)
    r = quantize(g, tmp_path / "o2", ok=False)
    assert re.search(r"tensor model\.layers\.\d+\.\S+\.g_idx is missing, but .*quantization_config\.desc_act is "
                     r"true", r.stderr), r.stderr

    _edit_config(d, lambda qc: qc.update(quant_method="bitnet"))
    r = quantize(d, tmp_path / "o3", ok=False)
    assert "config.json: unsupported quantization_config (quant_method='bitnet')" in r.stderr
    assert "quantization_config.quant_method must be one of" in r.stderr and "gptq" in r.stderr

    d2 = shutil.copytree(ct("W4A16", group_size=32), tmp_path / "ct2")
    _edit_config(d2, lambda qc: qc.update(ignore=qc["ignore"] + [r"re:.*experts\.3\..*"]))
    with pytest.raises(SourceError, match=r"experts\.3\.\S+\.weight_packed: module .* stored quantized, but no "
                                          r".*config_groups target matches it"):
        open_source(d2)
