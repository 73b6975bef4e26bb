"""GGUF checkpoints as conversion input: files written from the tiny HF fixtures with gguf-py's writer and llama.cpp's
names (tests/gguf_export.py), in BF16, Q8_0, Q4_0, MXFP4 (gpt-oss), and Q4_K / Q6_K blocks built from their bit
layout."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_export import Q, export_gguf
from gguf_kquants import q4_k_blocks, q6_k_blocks
from tokenizers import Tokenizer

from ktconvert.converted_reader import ConvertedDir
from ktconvert.sources import open_source
from ktconvert.sources.gguf import GGUFSource
from ktconvert.sources.roles import SourceError
from ktconvert.testing import make_checkpoint

KTCONVERT = [sys.executable, "-m", "ktconvert"]
# the architectures whose converters transform tensors on the way in (undone at read) come last
NEWER = ("qwen3_next", "qwen3_5_moe", "gpt_oss", "glm4_moe_lite")
ARCHS = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral", "glm4_moe", "minimax_m2", *NEWER)
_LINEAR_ATTENTION = ("head_dim", "layer_types", "num_experts", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "linear_conv_kernel_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "rope_parameters")
# what llama.cpp's converters of the newer architectures also carry over (partial rotary, q/k norm, bias, NextN)
GGUF_ONLY_KEYS = {"glm4_moe": ("head_dim", "partial_rotary_factor", "use_qk_norm", "attention_bias",
                               "num_nextn_predict_layers", "n_shared_experts", "norm_topk_prob"),
                  "minimax_m2": ("head_dim", "rotary_dim", "intermediate_size", "num_local_experts"),
                  "qwen3_next": (*_LINEAR_ATTENTION, "partial_rotary_factor", "intermediate_size"),
                  "qwen3_5_moe": _LINEAR_ATTENTION,
                  "gpt_oss": ("head_dim", "layer_types", "sliding_window", "num_local_experts", "intermediate_size",
                              "attention_bias"),
                  "glm4_moe_lite": ("num_nextn_predict_layers", "n_shared_experts", "norm_topk_prob",
                                    "rope_interleave")}
# -exp(A_log), as llama.cpp stores it, has no exact float32 inverse for every value: log() of it is within 1e-7
A_LOG_ATOL = 1e-7
TEXT = "def main():\n    print('hello, world')  # ünïcødé 123"


def quantize(src: Path, out: Path, *args) -> subprocess.CompletedProcess:
    r = subprocess.run([*KTCONVERT, "quantize", str(src), "-o", str(out), "--quiet", *args],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    return r


def assert_same_logits(a: Path, b: Path) -> None:
    """ktrun's logits of TEXT on two converted directories are equal (and its tokens too)."""
    from ktrun.engine import Engine
    from ktrun.models.kv_cache import Batch
    logits = []
    for d in (a, b):
        eng = Engine(d, ctx=64, max_batch=1)
        ids = eng.tokenizer.encode(TEXT)
        logits.append((ids, eng.model.forward(Batch.build([(eng.model.new_cache(64), ids)], "cpu"), all_logits=True)))
        eng.close()
    assert logits[0][0] == logits[1][0]
    torch.testing.assert_close(logits[0][1], logits[1][1], rtol=0, atol=0)


def gguf_expert(path: Path, layer: int, proj: str, e: int) -> np.ndarray:
    """Expert e's weight as gguf-py itself dequantizes the stacked tensor (the reference)."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == f"blk.{layer}.ffn_{proj}_exps.weight")
    return gguf.quants.dequantize(np.asarray(t.data[e]), t.tensor_type)


@pytest.fixture(scope="module")
def ds3(ckpt_dir):
    return ckpt_dir("deepseek_v3")


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_gguf_reads_exactly_like_its_safetensors(arch, ckpt_dir, tmp_path):
    src_dir = ckpt_dir(arch)
    path = export_gguf(src_dir, tmp_path / f"{arch}.gguf", Q.BF16)
    st, gg = open_source(src_dir), open_source(path)
    assert isinstance(gg, GGUFSource)
    want = {n for n in st.tensor_names() if st.arch.classify(n).kind != "skip"}
    assert set(gg.tensor_names()) == want
    for name in want:       # fixture weights are bf16, so BF16 GGUF round trips bit for bit (q/k unpermuted too)
        atol = A_LOG_ATOL if name.endswith("A_log") else 0
        torch.testing.assert_close(gg.read(name), st.read(name), rtol=0, atol=atol, msg=name)
    for attr in ("model_type", "num_layers", "hidden_size", "n_experts", "top_k", "moe_intermediate_size",
                 "n_shared_experts"):
        assert getattr(gg.arch, attr) == getattr(st.arch, attr), attr
    assert gg.arch.moe_layers() == st.arch.moe_layers()
    assert gg.arch.cfg.layer_types == st.arch.cfg.layer_types
    cfg = json.loads((src_dir / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}             # Qwen3.5-MoE: the text model's config, nested alike
    gg.config = {**gg.config, **gg.config.get("text_config", {})}
    for key in ("rms_norm_eps", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace", "num_key_value_heads",
                *GGUF_ONLY_KEYS.get(arch, ())):
        if key in cfg:
            assert gg.config[key] == cfg[key], key
    files = gg.side_files()
    tok_gguf = Tokenizer.from_str(files["tokenizer.json"].decode())
    tok_st = Tokenizer.from_file(str(src_dir / "tokenizer.json"))
    assert tok_gguf.encode(TEXT).ids == tok_st.encode(TEXT).ids
    tc = json.loads(files["tokenizer_config.json"])
    assert tc["chat_template"] == json.loads((src_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_q8_0_experts_convert_exactly(ds3, tmp_path):
    path = export_gguf(ds3, tmp_path / "m-q8_0.gguf", Q.Q8_0)
    r = quantize(path, tmp_path / "out", "--method", "int8-amx", "--group-size", "32")
    assert "no float round trip" in r.stderr
    conv = ConvertedDir(tmp_path / "out")
    layer = conv.geometry.moe_layers[0]
    for e in (0, 3):
        got = conv.read_expert(layer, e)
        for proj in ("gate", "up", "down"):
            np.testing.assert_array_equal(got[proj], gguf_expert(path, layer, proj, e))


@pytest.mark.parametrize("qtype,method,rel", [(Q.Q4_0, "int4-amx", 0.15), (Q.Q8_0, "int4-amx", 0.15),
                                              (Q.BF16, "int8-amx", 0.01)])
def test_quantized_gguf_converts_within_quantization_error(ds3, tmp_path, qtype, method, rel):
    path = export_gguf(ds3, tmp_path / "m.gguf", qtype)
    quantize(path, tmp_path / "out", "--method", method, "--group-size", "32")
    conv = ConvertedDir(tmp_path / "out")
    layer = conv.geometry.moe_layers[-1]
    got = conv.read_expert(layer, 1)
    for proj in ("gate", "up", "down"):
        ref = gguf_expert(path, layer, proj, 1)
        err = np.linalg.norm(got[proj] - ref) / np.linalg.norm(ref)
        assert err < rel, (proj, err)


def test_k_quant_blocks_match_gguf_and_convert(tmp_path):
    """Q4_K gate/up and Q6_K down built from their bit layout; gguf-py's dequantizer must agree with the values the
    blocks were built to hold; conversion must reproduce them within int8 error."""
    src = make_checkpoint("deepseek_v3", tmp_path / "src", num_layers=2, hidden_size=256, moe_intermediate_size=256)
    cfg = json.loads((src / "config.json").read_text())
    rng = np.random.default_rng(7)
    e, h, i = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    raw, values = {}, {}
    for proj, (rows, cols), build, qt in (("gate", (i, h), q4_k_blocks, Q.Q4_K), ("up", (i, h), q4_k_blocks, Q.Q4_K),
                                          ("down", (h, i), q6_k_blocks, Q.Q6_K)):
        blocks, vals = build(rng, e * rows * cols // 256)
        np.testing.assert_array_equal(gguf.quants.dequantize(blocks, qt), vals)      # layout understood
        raw[f"blk.1.ffn_{proj}_exps.weight"] = (blocks.reshape(e, rows, -1), qt)
        values[proj] = vals.reshape(e, rows, cols)
    path = export_gguf(src, tmp_path / "k.gguf", Q.BF16, raw_experts=raw)
    quantize(path, tmp_path / "out", "--method", "int8-amx", "--group-size", "64")
    conv = ConvertedDir(tmp_path / "out")
    for ex in (0, e - 1):
        got = conv.read_expert(1, ex)
        for proj in ("gate", "up", "down"):
            ref = values[proj][ex]
            assert np.linalg.norm(got[proj] - ref) / np.linalg.norm(ref) < 0.01, proj


def test_split_set_converts_and_missing_part_is_named(ds3, tmp_path):
    first = export_gguf(ds3, tmp_path / "m.gguf", Q.BF16, split_max_tensors=12)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 2 and not first.exists()
    (tmp_path / "single").mkdir()
    single = export_gguf(ds3, tmp_path / "single" / "m.gguf", Q.BF16)
    a, b = open_source(parts[0]), open_source(single)
    assert a.tensor_names() and set(a.tensor_names()) == set(b.tensor_names())
    quantize(parts[0], tmp_path / "out", "--method", "int8-amx")
    parts[1].unlink()
    r = subprocess.run([*KTCONVERT, "quantize", str(parts[0]), "-o", str(tmp_path / "out2")], capture_output=True, check=False,
                       text=True)
    assert r.returncode != 0 and parts[1].name in r.stderr and "missing" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out2" / "manifest.json").exists()


def test_gguf_bf16_conversion_gives_the_same_logits_in_ktrun(ds3, tmp_path):
    path = export_gguf(ds3, tmp_path / "m.gguf", Q.BF16)
    quantize(path, tmp_path / "from_gguf", "--method", "bf16")
    quantize(ds3, tmp_path / "from_st", "--method", "bf16")
    assert_same_logits(tmp_path / "from_gguf", tmp_path / "from_st")


def test_inspect_a_gguf_file_like_its_safetensors(ckpt_dir, tmp_path):
    src = ckpt_dir("qwen3_moe")
    path = export_gguf(src, tmp_path / "m-q8_0.gguf", Q.Q8_0)
    texts = []
    for p in (src, path):
        r = subprocess.run([*KTCONVERT, "inspect", str(p), "--gpu-mem", "1KB", "--cpu-mem", "1TB"],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0 and "GPU does NOT fit" in r.stdout and "CPU fits" in r.stdout, r.stdout + r.stderr
        texts.append(r.stdout.split("\n", 1)[1])     # all but the first line (the path)
    # same architecture, parameter counts and bytes per method; but the GPU bytes: the GGUF stores the router
    # gates in F32, and its conversion keeps them so
    texts = [re.sub(r"GPU\s+[\d.]+ [KMGT]?B", "GPU ?", t) for t in texts]
    assert texts[0] == texts[1]


# --- bad input ---------------------------------------------------------------------------------------------------

def _fails(src: Path, tmp_path: Path, *needles: str) -> str:
    r = subprocess.run([*KTCONVERT, "quantize", str(src), "-o", str(tmp_path / "bad-out")], capture_output=True, check=False,
                       text=True)
    assert r.returncode != 0
    for n in needles:
        assert n in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "bad-out" / "manifest.json").exists()
    return r.stderr


def test_truncated_gguf_is_named(ds3, tmp_path):
    path = export_gguf(ds3, tmp_path / "m.gguf", Q.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    _fails(path, tmp_path, "m.gguf", "truncated")


def test_unknown_gguf_architecture(tmp_path):
    wr = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    wr.add_block_count(1)
    wr.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    _fails(tmp_path / "gpt2.gguf", tmp_path, "unsupported GGUF architecture 'gpt2'", "deepseek2", "qwen3moe")


def test_ggml_type_without_dequantizer_is_named(ds3, tmp_path):
    cfg = json.loads((ds3 / "config.json").read_text())
    e, h, i = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    blk, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    odd = np.zeros((e, i, h // blk * size), np.uint8)
    path = export_gguf(ds3, tmp_path / "m.gguf", Q.BF16, raw_experts={"blk.1.ffn_gate_exps.weight": (odd, Q.Q8_1)})
    _fails(path, tmp_path, "blk.1.ffn_gate_exps.weight", "Q8_1", "cannot be dequantized")


def test_reader_errors_are_source_errors(tmp_path):
    with pytest.raises(SourceError, match="missing"):
        open_source(_touch(tmp_path / "x-00001-of-00002.gguf"))


def _touch(p: Path) -> Path:
    p.write_bytes(b"")
    return p


# --- the newer architectures: logits, MXFP4, Q8_0 through the converter's transforms, GLM-4.7-Flash --------------

@pytest.mark.parametrize("arch", NEWER)
def test_newer_gguf_conversions_give_the_safetensors_logits(arch, tmp_path_factory):
    """BF16 GGUF (written as llama.cpp's converter writes each architecture) and the safetensors source convert to the
    same model: ktrun's logits are equal. gpt-oss's GGUF carries no swiglu_limit (llama.cpp assumes the release's
    7.0), so its checkpoint here has that limit."""
    from runtime_helpers import build_checkpoint, build_conversion, converted, shared_root
    root = shared_root(tmp_path_factory)
    if arch == "gpt_oss":
        src = build_checkpoint(root / "gguf_limit7", arch, swiglu_limit=7.0)
        from_st = build_conversion(src, root / "gguf_limit7" / "conv_st")
    else:
        src, from_st = build_checkpoint(root, arch), converted(tmp_path_factory, arch)
    path = export_gguf(src, root / f"{arch}-bf16.gguf", Q.BF16)
    from_gguf = build_conversion(path, root / f"conv_gguf_{arch}")
    assert_same_logits(from_gguf, from_st)


def test_gpt_oss_mxfp4_gguf_experts_are_taken_over_exactly(tmp_path, caplog):
    """gpt-oss's MXFP4 experts repacked into ggml's MXFP4 (GptOssModel.repack_mxfp4): gguf-py's own dequantizer gives
    the safetensors source's values; the reader's integer grid is exactly that; int8 g32 (what --method auto picks)
    takes every expert over without a float round trip; int4 re-quantizes within its error."""
    import logging

    from ktconvert.exact_paths import choose_method
    from ktconvert.pipeline import ConvertOptions, convert
    src_dir = make_checkpoint("gpt_oss", tmp_path / "src", mxfp4=True)
    path = export_gguf(src_dir, tmp_path / "mx.gguf", Q.BF16)
    st, gg = open_source(src_dir), open_source(path)
    a = gg.arch
    for layer in a.moe_layers():
        for e in (0, a.n_experts - 1):
            for proj in ("gate", "up", "down"):
                name = a.expert_tensor_name(layer, e, proj)
                ref = gguf_expert(path, layer, proj, e)
                np.testing.assert_array_equal(ref, st.read(name).numpy())
                assert gg.quant_format(name).kind == "mxfp4"
                np.testing.assert_array_equal(gg.int_grid(name).dequantize(), ref)
    assert choose_method(gg)[:2] == ("int8-amx", 32)
    with caplog.at_level(logging.INFO, logger="ktconvert"):
        convert(path, tmp_path / "int8", ConvertOptions(method="int8-amx", group_size=32), show_progress=False)
    assert "taken over exactly from GGUF MXFP4" in caplog.text and "re-quantized" not in caplog.text
    convert(path, tmp_path / "int4", ConvertOptions(method="int4-amx", group_size=32), show_progress=False)
    for d, rel in (("int8", 0.0), ("int4", 0.2)):
        conv = ConvertedDir(tmp_path / d)
        got = conv.read_expert(1, 3)
        for proj in ("gate", "up", "down"):
            ref = gguf_expert(path, 1, proj, 3)
            assert np.linalg.norm(got[proj] - ref) <= rel * np.linalg.norm(ref), (d, proj)


def test_qwen3_5_q8_0_gguf_reads_through_the_converter_transforms(ckpt_dir, tmp_path):
    """Q8_0 (the value-head reorder and the other transforms applied to quantized tensors): experts keep their exact
    grid (equal to gguf-py's dequantization); transformed tensors read through the float path within Q8_0's error."""
    src_dir = ckpt_dir("qwen3_5_moe")
    path = export_gguf(src_dir, tmp_path / "q8.gguf", Q.Q8_0)
    st, gg = open_source(src_dir), open_source(path)
    a = gg.arch
    name = a.expert_tensor_name(1, 5, "gate")                  # (72, 128): whole Q8_0 blocks (down's K=72 is not)
    assert gg.quant_format(name).kind == "int"
    np.testing.assert_array_equal(gg.int_grid(name).dequantize(), gguf_expert(path, 1, "gate", 5))
    for t in ("in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj"):
        name = f"model.language_model.layers.0.linear_attn.{t}.weight"
        assert gg.int_grid(name) is None and gg.quant_format(name).kind != "int"     # reordered: float path
        ref = st.read(name)
        assert torch.linalg.norm(gg.read(name) - ref) < 0.01 * torch.linalg.norm(ref), t


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_fused_gate_up_experts_read_like_the_split_ones(arch, ckpt_dir, tmp_path):
    """convert_hf_to_gguf's --fuse-gate-up-exps writes each layer's gate and up stacks as one ffn_gate_up_exps
    (E, 2I, H), per expert [gate; up]: BF16 reads bit for bit like the safetensors; Q8_0 keeps each part's integer
    grid (its rows are whole blocks of the slab), equal to gguf-py's dequantization of the slab's rows."""
    src_dir = ckpt_dir(arch)
    st = open_source(src_dir)
    path = export_gguf(src_dir, tmp_path / "bf16.gguf", Q.BF16, fuse_gate_up=True)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.1.ffn_gate_up_exps.weight" in names and "blk.1.ffn_gate_exps.weight" not in names
    gg = open_source(path)
    want = {n for n in st.tensor_names() if st.arch.classify(n).kind != "skip"}
    assert set(gg.tensor_names()) == want
    for name in (n for n in want if st.arch.classify(n).kind == "expert"):
        torch.testing.assert_close(gg.read(name), st.read(name), rtol=0, atol=0, msg=name)
    q8 = open_source(export_gguf(src_dir, tmp_path / "q8.gguf", Q.Q8_0, fuse_gate_up=True))
    t = next(t for t in gguf.GGUFReader(tmp_path / "q8.gguf").tensors if t.name == "blk.1.ffn_gate_up_exps.weight")
    i = q8.arch.moe_intermediate_size
    for e in (0, q8.arch.n_experts - 1):
        slab = gguf.quants.dequantize(np.asarray(t.data[e]), t.tensor_type)                    # (2I, H)
        for proj, rows in (("gate", slice(0, i)), ("up", slice(i, 2 * i))):
            name = q8.arch.expert_tensor_name(1, e, proj)
            assert q8.quant_format(name).kind == "int"
            np.testing.assert_array_equal(q8.int_grid(name).dequantize(), slab[rows])
            np.testing.assert_array_equal(q8.read(name).numpy(), slab[rows])


def test_glm_4_7_flash_gguf_is_told_from_deepseek(ckpt_dir, tmp_path):
    """llama.cpp writes GLM-4.7-Flash as deepseek2 with the GLM pre-tokenizer and its NextN block: either marks it
    (--no-mtp drops the block, the tokenizer stays). Without both (another tool's file) it reads as DeepSeek-V3, whose
    forward is the same math."""
    src_dir = ckpt_dir("glm4_moe_lite")
    full = open_source(export_gguf(src_dir, tmp_path / "full.gguf"))
    assert full.config["model_type"] == "glm4_moe_lite" and full.config["num_nextn_predict_layers"] == 1
    assert full.arch.num_layers == 3 and not any(".layers.3." in n for n in full.tensor_names())
    no_mtp = open_source(export_gguf(src_dir, tmp_path / "no_mtp.gguf", no_mtp=True))
    assert no_mtp.config["model_type"] == "glm4_moe_lite" and no_mtp.arch.num_layers == 3
    other = open_source(export_gguf(src_dir, tmp_path / "other.gguf", no_mtp=True, tokenizer_pre="llama-bpe"))
    assert other.config["model_type"] == "deepseek_v3"
    assert set(other.tensor_names()) == set(full.tensor_names())


def test_a_log_inverse_is_within_a_float32_ulp_and_exact_for_bf16_values():
    """llama.cpp stores Qwen3-Next's A_log as -exp(A_log) (float32). log() of it comes back within 6e-8 (half a
    float32 ulp at 1, plus log's rounding) of a correctly rounded -exp; within A_LOG_ATOL (the bound the reads above
    use) of torch's own exp, whose vectorized paths differ by CPU (on an AVX2-only Zen 3 some -exp values are 1 ulp
    off the correctly rounded one and log() of them 6.1e-8 away; the AVX-512 machines gave <= 6e-8); and, for
    weights held in bf16 as the releases' are, rounds back to them."""
    from ktlayouts.families import GGUF_ARCHS
    undo = GGUF_ARCHS["qwen3next"].undo_for("model.layers.0.linear_attn.A_log")
    bits = torch.arange(0x3780, 0x4200, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()  # 2^-16..8
    a = torch.cat([bits, -bits]).numpy()
    exact = undo.fn((-np.exp(a.astype(np.float64))).astype(np.float32), {})      # -exp rounded once, from float64
    assert np.abs(exact - a).max() <= 6e-8
    back = undo.fn((-torch.exp(torch.from_numpy(a))).numpy(), {})               # what llama.cpp's converter runs
    assert np.abs(back - a).max() <= A_LOG_ATOL
    np.testing.assert_array_equal(torch.from_numpy(back).to(torch.bfloat16).float().numpy(), a)
