"""Every fixture architecture (and DeepSeek's FP8 release format) converts; `verify --against` passes; the files
are standard safetensors with every tensor 64-byte aligned; skipped tensors (MTP, FP8 scales) are gone."""
import json
import re
import struct

import numpy as np
import pytest
from click.testing import CliRunner
from ktlayouts.converted_dir import is_pad_tensor, load_manifest
from safetensors import safe_open

from ktconvert.cli import main
from ktconvert.converted_reader import ConvertedDir
from ktconvert.sources import open_source
from ktconvert.testing import ARCHS, FIXTURES


def run_cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


def quantize(src, out, *extra):
    code, out_text = run_cli("quantize", src, "-o", out, "--quiet", *extra)
    assert code == 0, out_text
    return out


def check_files_aligned_and_readable(out):
    manifest, _ = load_manifest(out)
    n_tensors = 0
    for rel, f in manifest["files"].items():
        if not rel.endswith(".safetensors"):
            continue
        raw = (out / rel).read_bytes()
        hlen = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8: 8 + hlen])
        assert (8 + hlen) % 64 == 0
        with safe_open(str(out / rel), framework="pt") as h:   # any safetensors reader opens it
            names = {k for k in h.keys() if not is_pad_tensor(k)}  # noqa: SIM118 (safe_open is not iterable)
            assert names == set(f["tensors"])
            for name in names:
                t = h.get_tensor(name)
                assert list(t.shape) == f["tensors"][name]["shape"]
                start = 8 + hlen + header[name]["data_offsets"][0]
                assert start % 64 == 0 and start == f["tensors"][name]["offset"], (rel, name)
                n_tensors += 1
    return n_tensors


@pytest.mark.parametrize("arch", [*ARCHS, "deepseek_v3_fp8"])   # every registered family, and DeepSeek FP8
def test_convert_and_verify_against_source(arch, ckpt_dir, fp8_ckpt, tmp_path):
    src = fp8_ckpt if arch == "deepseek_v3_fp8" else ckpt_dir(arch)
    out = quantize(src, tmp_path / "out")
    assert check_files_aligned_and_readable(out) > 0
    code, text = run_cli("verify", out, "--against", src)
    assert code == 0, text
    assert "0 above the limit" in text and "verify: OK" in text

    manifest, geo = load_manifest(out)
    cfg = json.loads((src / "config.json").read_text())
    assert manifest["model_type"] == cfg["model_type"] and manifest["format_version"] == 1
    # the default conversion (issue 23, chosen by bench_quant_vs_llamacpp.py): int4 group 64 with f16 scales = v2
    assert geo.layout == "cpu-expert-int4" and geo.group_size == 64 and geo.scale_dtype == "f16"
    tok = "tokenizer.json" if (src / "tokenizer.json").exists() else "tiktoken.model"     # Kimi: tiktoken
    assert (out / tok).read_bytes() == (src / tok).read_bytes() and (out / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    dense = ConvertedDir(out).dense_names()
    layers_key = FIXTURES[arch].layers_key if arch in FIXTURES else "num_hidden_layers"   # LongCat: num_layers
    n_layers = cfg.get("text_config", cfg)[layers_key]          # Kimi-K2.5: the text model's config
    assert not any(n.endswith("weight_scale_inv") for n in dense)
    assert all(int(m.group(1)) < n_layers for n in dense
               if (m := re.match(r"(?:language_model\.)?model\.layers\.(\d+)\.", n)))
    with open_source(src) as s:
        kept = {n for n in s.tensor_names() if s.arch.classify(n).kind not in ("skip", "expert")}
    assert set(dense) == kept
    # every expert file of every MoE layer is listed with the layout in its safetensors metadata
    for layer in geo.moe_layers:
        with safe_open(str(out / f"experts/layer-{layer:04d}.shard-0-of-1.safetensors"), framework="pt") as h:
            assert h.metadata()["kt.layout"] == "cpu-expert-int4" and h.metadata()["kt.layout_version"] == "2"


def test_dense_tensors_are_exact_bf16_and_router_bias_f32(fp8_ckpt, tmp_path):
    out = quantize(fp8_ckpt, tmp_path / "out", "--gpu-method", "bf16")     # GPU layers unquantized here
    conv = ConvertedDir(out)
    with open_source(fp8_ckpt) as s:
        for name in conv.dense_names():
            t = conv.manifest["files"][conv._dense_index[name]]["tensors"][name]
            ref = s.read(name).numpy()
            if name.endswith("e_score_correction_bias"):
                assert t["dtype"] == "F32"
                np.testing.assert_array_equal(conv.read_dense(name), ref)
            else:
                assert t["dtype"] == "BF16"
                # independent rounding: torch's float32 -> bfloat16 conversion
                import torch
                np.testing.assert_array_equal(conv.read_dense(name),
                                              torch.from_numpy(ref).to(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("method,group", [("int8-amx", 64), ("int4-amx", 32), ("int4-amx", -1), ("bf16", 128)])
def test_methods_and_group_sizes(method, group, ckpt_dir, tmp_path):
    src = ckpt_dir("qwen3_moe")
    out = quantize(src, tmp_path / "out", "--method", method, "--group-size", group)
    code, text = run_cli("verify", out, "--against", src)
    assert code == 0, text
    _, geo = load_manifest(out)
    assert (geo.method, geo.group_size) == (method, group)
    # quantization error is what the method promises, measured independently of verify's limits
    conv = ConvertedDir(out)
    with open_source(src) as s:
        w = s.read(s.arch.expert_tensor_name(0, 3, "down")).numpy()
    got = conv.read_expert(0, 3)["down"]
    err = np.linalg.norm(got - w) / np.linalg.norm(w)
    assert err < {"int8-amx": 0.01, "int4-amx": 0.15, "bf16": 0.004}[method]


def test_manifest_records_the_pulled_source(ckpt_copy, tmp_path):
    src = ckpt_copy("mixtral")
    record = {"format": "ktconvert-source/1", "repo_id": "mistralai/Mixtral-8x7B-v0.1", "revision": "main",
              "commit": "a" * 40, "complete": True, "files": {}}
    (src / ".ktconvert-source.json").write_text(json.dumps(record))
    out = quantize(src, tmp_path / "out")
    manifest, _ = load_manifest(out)
    assert manifest["source"]["repo_id"] == "mistralai/Mixtral-8x7B-v0.1"
    assert manifest["source"]["revision"] == "main" and manifest["source"]["commit"] == "a" * 40
    assert ".ktconvert-source.json" not in manifest["files"]


def test_experts_are_packed_on_both_workers_at_once(ckpt_dir, tmp_path, monkeypatch):
    """Both cores work: with --workers 2, two threads are inside the (real) expert packing at the same moment. Each
    worker thread waits at a 2-party barrier on its first packing call; a serial converter would never get a second
    thread there and the barrier would break."""
    import threading

    from ktconvert import pipeline
    from ktconvert.pipeline import ConvertOptions, convert

    real, lock, meet, seen = pipeline.pack_expert_matrix, threading.Lock(), threading.Barrier(2, timeout=60), set()

    def pack_and_meet(*args, **kwargs):
        me = threading.get_ident()
        with lock:
            first = me not in seen
            seen.add(me)
        if first:
            meet.wait()      # returns only once another thread is packing too
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "pack_expert_matrix", pack_and_meet)
    convert(ckpt_dir("qwen3_moe"), tmp_path / "out", ConvertOptions(workers=2), show_progress=False)
    assert len(seen) == 2 and threading.main_thread().ident not in seen
