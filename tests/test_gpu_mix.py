"""Mixed precision of the GPU layers: `--gpu-method-for GLOB=METHOD` rules and the measured rule (`--gpu-mix-budget`,
ktconvert.gpu.sensitivity), through the real converter on the DeepSeek-V3 fixture, loaded and run by ktrun."""
import json

import numpy as np
import pytest
import torch
from ktlayouts.converted_dir import MANIFEST_NAME
from ktlayouts.gpu_formats import dequantize_named
from ktrun.engine import Engine
from ktrun.models.kv_cache import Batch
from runtime_helpers import PROMPT, kl, transformers_model
from test_gpu_convert import KINDS, run_quantize

from ktconvert.converted_reader import ConvertedDir
from ktconvert.gpu import dense_encoder_for
from ktconvert.gpu.sensitivity import Measured, choose, measure
from ktconvert.sources import open_source

CTX = 128


def prompt_logits(conv) -> torch.Tensor:
    eng = Engine(conv, ctx=CTX)
    try:
        ids = eng.tokenizer.encode(PROMPT + " and then some more words to average over")
        return eng.model.forward(Batch.build([(eng.model.new_cache(CTX), ids)], "cpu"), all_logits=True)
    finally:
        eng.close()


def dense_layouts(out) -> dict[str, str]:
    """Tensor name -> layout of every non-expert file (the MTP layer's mtp_dense file too)."""
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    return {n: t["layout"] for f in manifest["files"].values() if f["kind"] in ("dense", "globals", "mtp_dense")
            for n, t in f.get("tensors", {}).items()}


def decode_matches_prefill(conv) -> None:
    """Decode steps (one token at a time on the KV cache, ktrun's decode path) give the prefill's distributions."""
    eng = Engine(conv, ctx=CTX)
    try:
        m = eng.model
        ids, extra = eng.tokenizer.encode(PROMPT), [7, 9, 11, 13]
        full = m.forward(Batch.build([(m.new_cache(CTX), ids + extra)], "cpu"), all_logits=True)[len(ids) - 1:]
        cache = m.new_cache(CTX)
        steps = [m.forward(Batch.build([(cache, ids)], "cpu")).reshape(1, -1)]
        steps += [m.forward(Batch.build([(cache, [t])], "cpu")).reshape(1, -1) for t in extra]
        assert float(kl(full, torch.cat(steps)).max()) < 1e-6
    finally:
        eng.close()


def stored_weight(out, name: str) -> np.ndarray:
    conv, layouts = ConvertedDir(out), dense_layouts(out)
    base = name[: -len("weight")]
    f = conv.open(conv._dense_index[base + "qweight"])
    parts = {k: f.get_tensor(k).numpy() for k in f.keys() if k.startswith(base)}  # noqa: SIM118
    return dequantize_named(layouts[base + "qweight"], parts, name)


@pytest.fixture(scope="module")
def bf16_logits(ckpt_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mix") / "bf16"
    res = run_quantize(ckpt_dir("deepseek_v3"), out, "--method", "bf16", "--gpu-method", "bf16")
    assert res.returncode == 0, res.stderr[-3000:]
    return prompt_logits(out)


def test_method_for_rules_set_each_linears_format_and_ktrun_runs_it(ckpt_dir, tmp_path, bf16_logits):
    src = ckpt_dir("deepseek_v3")
    out = tmp_path / "out"
    res = run_quantize(src, out, "--gpu-method", "gptq-int4", "--gpu-group-size", 32,
                       "--gpu-method-for", "model.layers.0.mlp.*=rtn-int8",      # without .weight
                       "--gpu-method-for", "*.kv_b_proj.weight=bf16",           # with it
                       "--gpu-method-for", "model.layers.0.mlp.up_proj=bf16")   # after a matching rule: not used
    assert res.returncode == 0, res.stderr[-3000:]
    layouts = dense_layouts(out)
    s = open_source(src)
    quantized = [n for n in s.tensor_names() if s.arch.classify(n, keep_mtp=True).kind in KINDS]
    seen = set()
    for name in quantized:
        base = name[: -len(".weight")]
        if name.endswith("kv_b_proj.weight"):
            assert layouts[name] == "dense-bf16" and base + ".qweight" not in layouts, name
            seen.add("bf16")
        elif name.startswith("model.layers.0.mlp."):
            assert layouts[base + ".qweight"] == "gpu-marlin-int8", name
            seen.add("int8")
        else:
            assert layouts[base + ".qweight"] == "gpu-marlin-int4", name
    assert seen == {"bf16", "int8"}
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["gpu_method"] == "gptq-int4" and "gpu_mix" not in manifest    # an explicit method: no mix
    assert manifest["gpu_method_for"][0] == ["model.layers.0.mlp.*", "rtn-int8"]
    # the int8 rule's weights against the source (vLLM's rtn rule at 8 bits: within 1% of the weight's norm)
    name = "model.layers.0.mlp.down_proj.weight"
    ref = s.read(name).numpy()
    assert np.linalg.norm(stored_weight(out, name) - ref) / np.linalg.norm(ref) < 0.01
    # ktrun loads the mix and runs it: next-token distributions near the BF16 conversion's
    d = kl(bf16_logits, prompt_logits(out))
    assert torch.isfinite(d).all() and float(d.mean()) < 1e-2 and float(d.max()) < 1e-1
    decode_matches_prefill(out)


@pytest.mark.parametrize("rule,what", [
    ("model.layers.0.mlp.nothing_proj=gptq-int8", "matches none"),
    ("model.embed_tokens=gptq-int8", "matches none"),        # not a Linear the conversion quantizes
    ("model.layers.0.mlp.down_proj=int3", "unknown method 'int3'"),
    ("model.layers.0.mlp.down_proj", "expected GLOB=METHOD"),
])
def test_bad_rules_are_refused_naming_flag_and_pattern(ckpt_dir, tmp_path, rule, what):
    out = tmp_path / "out"
    res = run_quantize(ckpt_dir("deepseek_v3"), out, "--gpu-method", "rtn-int4", "--gpu-method-for", rule)
    assert res.returncode != 0
    assert "--gpu-method-for" in res.stderr and rule.split("=")[0] in res.stderr and what in res.stderr, res.stderr
    assert not (out / MANIFEST_NAME).exists()


def test_measured_rule_upgrades_within_budget_and_ktrun_runs_it(ckpt_dir, tmp_path, bf16_logits):
    src = ckpt_dir("deepseek_v3")
    out, plain = tmp_path / "mix", tmp_path / "plain"
    budget = 0.5
    res = run_quantize(src, out, "--gpu-mix-budget", budget)          # --gpu-method auto: gptq-int4 + the rule
    assert res.returncode == 0, res.stderr[-3000:]
    assert "most sensitive per added bit" in res.stderr and "upgraded to gptq-int8" in res.stderr
    mix = json.loads((out / MANIFEST_NAME).read_text())["gpu_mix"]
    assert mix["budget"] == budget and mix["method"] == "gptq-int8" and mix["upgraded"]
    layouts = dense_layouts(out)
    s = open_source(src)
    decoder = [n for n in s.tensor_names() if s.arch.classify(n).kind in KINDS]    # no MTP layer
    weights = {n: int(np.prod(s.info(n).shape)) for n in decoder}
    for name in decoder:
        want = "gpu-marlin-int8" if name in mix["upgraded"] else "gpu-marlin-int4"
        assert layouts[name[: -len(".weight")] + ".qweight"] == want, name
    added = 4 * sum(weights[n] for n in mix["upgraded"])
    assert added <= budget * sum(weights.values())
    d = kl(bf16_logits, prompt_logits(out))
    assert torch.isfinite(d).all() and float(d.mean()) < 1e-2
    decode_matches_prefill(out)
    # --gpu-mix-budget 0 with auto is the explicit --gpu-method gptq-int4 conversion, byte for byte
    assert run_quantize(src, plain, "--gpu-mix-budget", 0).returncode == 0
    explicit = tmp_path / "explicit"
    assert run_quantize(src, explicit, "--gpu-method", "gptq-int4").returncode == 0
    for f in sorted(p.relative_to(plain) for p in plain.rglob("*.safetensors")):
        assert (plain / f).read_bytes() == (explicit / f).read_bytes(), f


def test_choose_is_greedy_by_error_per_bit_within_budget():
    # (name, weights, score): costs at +4 bits: a 400, b 40, c 200, d 80; budget 0.5 x 1000 weights = 500 bits
    ms = [Measured(n, w, 0.0, sc) for n, w, sc in (("a", 100, 3.0), ("b", 10, 2.0), ("c", 50, 1.0), ("d", 20, 0.5))]
    assert choose(ms, lambda _n: 4, 8, 0.5, 1000) == ["a", "b"]          # c (200) no longer fits; d (80) does not
    assert choose(ms, lambda _n: 4, 8, 0.51, 1000) == ["a", "b"]         # 440 + 80 > 510
    assert choose(ms, lambda _n: 4, 8, 0.6, 1000) == ["a", "b", "d"]     # c skipped (640 > 600), d fits: 520
    assert choose(ms, lambda _n: 4, 8, 0.64, 1000) == ["a", "b", "c"]    # c fits (640), then d does not
    assert choose(ms, lambda _n: 4, 8, 0.0, 1000) == []


def test_measured_error_matches_transformers_whole_model_forward(ckpt_dir, tmp_path):
    """The pass's error of a layer-0 Linear against transformers' own model: the residual stream after layer 0
    (hidden_states[1]) with that Linear's quantized weight as the conversion stores it, on the same tokens."""
    src_dir = ckpt_dir("deepseek_v3")
    out = tmp_path / "plain"
    assert run_quantize(src_dir, out, "--gpu-method", "gptq-int4").returncode == 0
    from ktconvert.gpu.calib import calibration_tokens, read_calibration_text, split_calibration_text
    with open_source(src_dir) as src:
        enc = dense_encoder_for(src, gpu_method="gptq-int4")
        got = {m.name: m.error for m in measure(enc, 8)}
        tokens = calibration_tokens(src, split_calibration_text(read_calibration_text(None)[0])[0],
                                    enc.opts.calib_tokens, enc.opts.seq_len, enc.opts.seed)
    model = transformers_model(src_dir)
    with torch.no_grad():
        ref = model(tokens, output_hidden_states=True).hidden_states[1]
        for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):
            mod = model.get_submodule(name[: -len(".weight")])
            w0 = mod.weight.detach().clone()
            mod.weight.copy_(torch.from_numpy(stored_weight(out, name)))
            y = model(tokens, output_hidden_states=True).hidden_states[1]
            mod.weight.copy_(w0)
            want = float(((y - ref).pow(2).sum(-1) / ref.pow(2).sum(-1)).mean())
            assert got[name] == pytest.approx(want, rel=2e-3), name


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_quantization_config_names_the_linears_at_other_bits(ckpt_dir, tmp_path, fmt):
    """vLLM / transformers read a mixed checkpoint's schemes from config.json: the int8 Linears by exact name
    (GPTQ's `dynamic` "+:" entries, a compressed-tensors config group), the unquantized ones excluded."""
    import re

    src = ckpt_dir("qwen3_moe")       # shapes gptq / compressed-tensors hold without padding
    out = tmp_path / "out"
    res = run_quantize(src, out, "--gpu-method", "rtn-int4", "--gpu-format", fmt, "--gpu-group-size", 64,
                       "--gpu-method-for", "model.layers.0.self_attn.o_proj=rtn-int8",
                       "--gpu-method-for", "model.layers.1.self_attn.q_proj=bf16")
    assert res.returncode == 0, res.stderr[-3000:]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    int8, off = "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.q_proj"
    if fmt == "gptq":
        assert qc["bits"] == 4
        plus = {k[2:]: v for k, v in qc["dynamic"].items() if k.startswith("+:")}
        minus = [k[2:] for k in qc["dynamic"] if k.startswith("-:")]
        assert [(k, v["bits"]) for k, v in plus.items() if re.match(k, int8)] == [(re.escape(int8) + "$", 8)]
        assert not any(re.match(k, "model.layers.1.self_attn.o_proj") for k in plus)
        assert any(re.match(k, off) for k in minus)
    else:
        groups = list(qc["config_groups"].values())
        assert groups[0]["weights"]["num_bits"] == 4 and groups[0]["targets"] == ["Linear"]
        eight = [g for g in groups if g["weights"]["num_bits"] == 8]
        assert len(eight) == 1 and [t for t in eight[0]["targets"] if re.match(t[3:], int8)]
        assert off in qc["ignore"]
