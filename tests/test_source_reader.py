"""The lazy source reader and the architecture adapters, on real safetensors checkpoints (good and broken)."""
import json
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ktconvert.sources import SourceError, open_source
from ktconvert.sources.roles import SUPPORTED_MODEL_TYPES, TensorRole, adapter_for


def _index(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def _shard_of(d: Path, name: str) -> Path:
    return d / _index(d)["weight_map"][name]


def _write_index(d: Path, index: dict) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _rewrite_header(path: Path, mutate) -> None:
    """Edit a shard's JSON header in place (the data bytes stay as they are)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    mutate(header)
    new = json.dumps(header).encode()
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


# --- reading good checkpoints --------------------------------------------------------------------------------

def _fused_expert(d: Path, name: str) -> torch.Tensor:
    """gpt-oss: one expert's (N, K) gate/up/down out of the layer's fused (E, K, 2I | H) tensor, read with
    safetensors (gate = even columns, up = odd ones, transposed)."""
    m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
    fused = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}"
    with safe_open(_shard_of(d, fused), framework="pt") as f:
        w = f.get_tensor(fused)[int(m.group(2))].float()
    return {"gate": w[:, 0::2], "up": w[:, 1::2], "down": w}[m.group(3)].T


def test_reads_every_tensor_like_safetensors(ckpt_dir, arch):
    d = ckpt_dir(arch)
    with open_source(d) as src:
        stored = list(_index(d)["weight_map"])
        names = src.tensor_names()
        fused = src.arch.family.names.fused_experts
        if fused is not None and not fused.optional:   # gpt-oss: fused experts read as per-expert weights
            split = [n for n in names if n not in stored]
            assert len(split) == 3 * src.arch.n_experts * len(src.arch.moe_layers())
            for name in split:
                assert torch.equal(src.read(name), _fused_expert(d, name)), name
            names = [n for n in names if n not in split]
            stored = [n for n in stored if not re.search(r"\.experts\.(gate_up|down)_proj$", n)]
        assert names == stored
        assert src.arch.model_type == arch
        for name in names:
            with safe_open(_shard_of(d, name), framework="pt") as f:
                want = f.get_tensor(name)
            got = src.read(name)
            assert got.dtype == torch.float32 and torch.equal(got, want.float()), name
            info = src.info(name)
            assert info.shape == tuple(want.shape) and info.nbytes == want.nbytes
            assert info.dtype == {torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32"}[want.dtype]
        assert src.source_nbytes() == _index(d)["metadata"]["total_size"]


def test_roles_cover_the_checkpoint(ckpt_dir, arch):
    with open_source(ckpt_dir(arch)) as src:
        a = src.arch
        roles = {n: a.classify(n) for n in src.tensor_names()}
        experts = {(r.layer, r.expert, r.proj) for r in roles.values() if r.kind == "expert"}
        want = {(li, e, p) for li in a.moe_layers() for e in range(a.n_experts) for p in ("gate", "up", "down")}
        assert experts == want
        for li, e, p in experts:
            assert roles[a.expert_tensor_name(li, e, p)] == TensorRole("expert", li, e, p)
        kinds = {r.kind for r in roles.values()}
        assert {"router", "attention", "norm", "embedding", "head"} <= kinds
        assert sum(r.kind == "router" for r in roles.values()) == len(a.moe_layers())
        if arch.startswith("deepseek"):
            assert "shared_expert" in kinds
        if arch in ("deepseek_v2", "deepseek_v3", "deepseek_v32"):       # V4: every layer MoE (the first hash-routed)
            assert "dense_mlp" in kinds and a.moe_layers()[0] == 1
        assert a.top_k >= 2 and a.moe_intermediate_size % 64 != 0


def test_fp8_reads_back_close_to_bf16_and_mtp_is_skipped(fp8_ckpt, ckpt_dir):
    fp8, bf16 = open_source(fp8_ckpt), open_source(ckpt_dir("deepseek_v3"))
    n_layers = fp8.arch.num_layers
    assert fp8.tensor_names() != bf16.tensor_names()
    n_fp8 = 0
    for name in fp8.tensor_names():
        role = fp8.arch.classify(name)
        if name.endswith("weight_scale_inv") or name.startswith(f"model.layers.{n_layers}."):
            assert role.kind == "skip", name
        info = fp8.info(name)
        if info.dtype != "F8_E4M3":
            if name in bf16.tensor_names():
                assert torch.equal(fp8.read(name), bf16.read(name)), name
            continue
        n_fp8 += 1
        got, orig = fp8.read(name), bf16.read(name)
        # independent decode: torch's float8_e4m3fn times the 128x128 block scale
        with safe_open(_shard_of(fp8_ckpt, name), framework="pt") as f:
            w = f.get_tensor(name).float()
        with safe_open(_shard_of(fp8_ckpt, name + "_scale_inv"), framework="pt") as f:
            s = f.get_tensor(name + "_scale_inv")
        scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        assert torch.equal(got, w * scale), name
        # FP8 error: 3 mantissa bits (relative 2^-4), plus the subnormal step 2^-9 of the block scale
        assert torch.all((got - orig).abs() <= orig.abs() * 2**-4 + scale * 2**-9), name
        assert (got - orig).norm() / orig.norm() < 0.05
    assert n_fp8 > 100
    assert fp8.arch.classify(f"model.layers.{n_layers}.eh_proj.weight") == TensorRole("skip", n_layers)
    assert fp8.arch.classify(f"model.layers.{n_layers}.mlp.experts.3.up_proj.weight").kind == "skip"


def test_reading_is_lazy_one_tensor_at_a_time(ckpt_dir):
    d = ckpt_dir("deepseek_v3")
    total_f32 = 2 * _index(d)["metadata"]["total_size"]  # BF16 on disk -> f32 in memory
    tracemalloc.start()
    try:
        src = open_source(d)
        biggest = max(np.prod(src.info(n).shape) * 4 for n in src.tensor_names())
        tracemalloc.reset_peak()
        for name in src.tensor_names():
            src.read(name)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * biggest + (256 << 10) and peak < total_f32 / 8, (peak, biggest, total_f32)


def test_single_file_checkpoint(ckpt_copy):
    d = ckpt_copy("mixtral")
    tensors = {}
    for shard in sorted(set(_index(d)["weight_map"].values())):
        tensors.update(load_file(d / shard))
        (d / shard).unlink()
    (d / "model.safetensors.index.json").unlink()
    save_file(tensors, d / "model.safetensors")
    src = open_source(d)
    assert set(src.tensor_names()) == set(tensors)
    assert torch.equal(src.read("lm_head.weight"), tensors["lm_head.weight"].float())


# --- the adapters --------------------------------------------------------------------------------------------

def test_adapter_tables():
    a = adapter_for({"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 8, "num_local_experts": 4,
                     "num_experts_per_tok": 2, "intermediate_size": 16})
    assert a.expert_tensor_name(1, 3, "up") == "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    assert a.classify("model.layers.1.block_sparse_moe.experts.3.w2.weight") == TensorRole("expert", 1, 3, "down")
    assert a.classify("model.layers.0.block_sparse_moe.gate.weight") == TensorRole("router", 0)
    assert a.classify("model.layers.0.self_attn.k_proj.weight").kind == "attention"
    assert a.classify("model.embed_tokens.weight").kind == "embedding"
    kimi = adapter_for({"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
                        "n_routed_experts": 384, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                        "first_k_dense_replace": 1, "n_shared_experts": 1})  # Kimi-K2's config shape
    assert kimi.moe_layers() == list(range(1, 61)) and kimi.n_experts == 384
    assert adapter_for({**kimi.config, "model_type": "kimi_k2"}).model_type == "deepseek_v3"
    assert kimi.classify("model.layers.60.mlp.experts.383.gate_proj.weight") == TensorRole("expert", 60, 383, "gate")
    assert kimi.classify("model.layers.3.self_attn.q_a_layernorm.weight") == TensorRole("norm", 3)
    assert kimi.classify("model.layers.3.self_attn.kv_b_proj.weight_scale_inv").kind == "skip"
    assert kimi.classify("model.layers.61.shared_head.head.weight") == TensorRole("skip", 61)
    assert kimi.classify("model.layers.0.mlp.down_proj.weight") == TensorRole("dense_mlp", 0, None, "down")
    assert kimi.classify("model.layers.5.mlp.gate.e_score_correction_bias") == TensorRole("router_bias", 5)
    assert kimi.classify("model.layers.5.mlp.shared_experts.up_proj.weight") == TensorRole("shared_expert", 5,
                                                                                           None, "up")
    q = adapter_for({"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 8, "num_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [0],
                     "decoder_sparse_step": 1})
    assert q.moe_layers() == [1, 2, 3] and q.classify("model.layers.0.mlp.up_proj.weight").kind == "dense_mlp"
    for bad in ("model.layers.0.mlp.experts.1.gate_proj.weight",   # expert in a dense layer
                "model.layers.1.mlp.experts.4.gate_proj.weight",   # expert index beyond the config
                "model.layers.4.mlp.gate.weight",                  # layer beyond the config (no MTP here)
                "model.layers.1.mlp.mystery.weight", "transformer.h.0.attn.weight"):
        with pytest.raises(SourceError, match=bad.replace(".", r"\.")):
            q.classify(bad)
    with pytest.raises(SourceError, match=r"eh_proj"):
        kimi.classify("model.layers.3.eh_proj.weight")  # MTP-only name inside a main layer


def test_unsupported_model_type_lists_supported(ckpt_copy):
    supported = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss",
                 "kimi_k25", "kimi_linear", "longcat_flash", "mimo_v2_flash", "minimax_m2", "mixtral", "qwen3_5_moe", "qwen3_moe", "qwen3_next")
    with pytest.raises(SourceError, match="llama4.*" + ", ".join(supported)):
        adapter_for({"model_type": "llama4"})
    assert SUPPORTED_MODEL_TYPES == supported
    d = ckpt_copy("qwen3_moe")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama4"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="unsupported model_type 'llama4'.*supported: deepseek_v2"):
        open_source(d)


# --- broken checkpoints: each error names the file, the tensor and the offset where it applies ---------------

def test_truncated_shard(ckpt_copy):
    d = ckpt_copy("qwen3_moe")
    shard = d / sorted(set(_index(d)["weight_map"].values()))[1]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(SourceError) as e:
        open_source(d)
    msg = str(e.value)
    assert shard.name in msg and "truncated" in msg and f"expected {size} bytes" in msg and f"has {size - 100}" in msg
    assert "model.layers." in msg  # the tensor that runs past the end


def test_corrupt_header(ckpt_copy):
    d = ckpt_copy("mixtral")
    shard = _shard_of(d, "lm_head.weight")
    raw = bytearray(shard.read_bytes())
    raw[12:20] = b"\xff\x00garbag"
    shard.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match=rf"{shard.name}: corrupt safetensors header"):
        open_source(d)
    shard.write_bytes((10**12).to_bytes(8, "little") + bytes(raw[8:]))
    with pytest.raises(SourceError, match=rf"{shard.name}: header length 1000000000000 at byte offset 0"):
        open_source(d)


def test_header_offsets_and_sizes_checked(ckpt_copy):
    d = ckpt_copy("mixtral")
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    shard = _shard_of(d, a)
    assert _shard_of(d, b) == shard

    def overlap(h):
        h[b]["data_offsets"] = list(h[a]["data_offsets"])
    _rewrite_header(shard, overlap)
    with pytest.raises(SourceError, match=rf"{shard.name}: tensor .*not contiguous"):
        open_source(d)

    d2 = ckpt_copy("deepseek_v2")
    shard2 = _shard_of(d2, "model.norm.weight")

    def wrong_shape(h):
        h["model.norm.weight"]["shape"] = [64]
    _rewrite_header(shard2, wrong_shape)
    with pytest.raises(SourceError, match=r"tensor model\.norm\.weight: data_offsets .* hold 256 bytes.* needs 128"):
        open_source(d2)


def test_shard_missing_on_disk_or_from_index(ckpt_copy):
    d = ckpt_copy("deepseek_v2")
    index = _index(d)
    victim = sorted(set(index["weight_map"].values()))[2]
    (d / victim).rename(d / "elsewhere.bin")
    with pytest.raises(SourceError, match=rf"shard {victim} named in the index is missing on disk"):
        open_source(d)
    (d / "elsewhere.bin").rename(d / victim)
    # a tensor (and so a shard's contents) the index does not list
    name = next(n for n, s in index["weight_map"].items() if s == victim)
    del index["weight_map"][name]
    _write_index(d, index)
    with pytest.raises(SourceError, match=rf"{victim}: tensor .* missing from model\.safetensors\.index\.json"):
        open_source(d)
    # the index points a tensor at a shard that does not hold it
    index["weight_map"][name] = min(index["weight_map"].values())
    _write_index(d, index)
    with pytest.raises(SourceError, match=rf"tensor {name} is mapped to shard"):
        open_source(d)
    # shard names must stay inside the checkpoint directory
    index["weight_map"][name] = "../outside.safetensors"
    _write_index(d, index)
    with pytest.raises(SourceError, match="not a plain file name"):
        open_source(d)
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(SourceError, match="neither model.safetensors.index.json nor model.safetensors"):
        open_source(d)


def test_expert_tensor_missing_everywhere(ckpt_copy):
    d = ckpt_copy("qwen3_moe")
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    shard = _shard_of(d, name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    index = _index(d)
    del index["weight_map"][name]
    _write_index(d, index)
    with pytest.raises(SourceError, match=rf"tensor {name.replace('.', '[.]')} is missing"):
        open_source(d)


def test_unknown_tensor_and_unsupported_dtype(ckpt_copy):
    d = ckpt_copy("mixtral")
    shard = _shard_of(d, "model.norm.weight")
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.rotary_mystery.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = _index(d)
    index["weight_map"]["model.layers.0.self_attn.rotary_mystery.weight"] = shard.name
    _write_index(d, index)
    with pytest.raises(SourceError, match=r"rotary_mystery\.weight: unknown tensor name for model_type mixtral"):
        open_source(d)
    tensors["model.layers.0.self_attn.rotary_mystery.weight"] = torch.zeros(4, dtype=torch.float64)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(SourceError, match=rf"{shard.name}: tensor .*rotary_mystery.weight: unsupported dtype F64"):
        open_source(d)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_weight_named_with_offset(ckpt_copy, bad):
    d = ckpt_copy("deepseek_v3")
    name = "model.layers.2.mlp.experts.9.down_proj.weight"
    shard = _shard_of(d, name)
    tensors = load_file(shard)
    tensors[name][3, 7] = bad
    save_file(tensors, shard, metadata={"format": "pt"})
    src = open_source(d)  # open stays lazy: the values are checked on read
    assert torch.isfinite(src.read("model.layers.2.mlp.experts.8.down_proj.weight")).all()
    with pytest.raises(SourceError) as e:
        src.read(name)
    msg = str(e.value)
    what = "NaN" if np.isnan(bad) else "Inf"
    assert f"{shard}: tensor {name}: {what} at element (3, 7)" in msg
    offset = int(msg.split("byte offset ")[1].split(")")[0])
    info = src.info(name)
    assert offset == info.offset + (3 * info.shape[1] + 7) * 2
    value = np.frombuffer(shard.read_bytes()[offset:offset + 2], dtype=np.uint16)[0]
    assert (value & 0x7F80) == 0x7F80  # the bf16 at that offset is indeed non-finite


def test_fp8_scale_missing_or_misshapen(ckpt_copy):
    d = ckpt_copy("deepseek_v3_fp8")
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    shard = _shard_of(d, name + "_scale_inv")

    def bad_shape(h):
        h[name + "_scale_inv"]["shape"] = [1, 2]
    _rewrite_header(shard, bad_shape)
    with pytest.raises(SourceError, match=rf"{name}_scale_inv: shape \(1, 2\) F32, expected F32 \(2, 1\)"):
        open_source(d)


def test_fp8_nan_bits_and_bad_scale(ckpt_copy):
    d = ckpt_copy("deepseek_v3_fp8")
    name = "model.layers.1.self_attn.o_proj.weight"
    shard = _shard_of(d, name)
    tensors = load_file(shard)
    tensors[name].view(torch.uint8)[1, 2] = 0x7F  # the e4m3fn NaN pattern
    save_file(tensors, shard, metadata={"format": "pt"})
    src = open_source(d)
    offset = src.info(name).offset + src.info(name).shape[1] + 2
    with pytest.raises(SourceError, match=rf"tensor {name}: NaN at element \(1, 2\) \(byte offset {offset}\)"):
        src.read(name)
    name2 = "model.layers.2.mlp.experts.0.down_proj.weight"
    shard2 = _shard_of(d, name2 + "_scale_inv")
    tensors = load_file(shard2)
    tensors[name2 + "_scale_inv"][0, 1] = float("inf")
    save_file(tensors, shard2, metadata={"format": "pt"})
    with pytest.raises(SourceError, match=rf"tensor {name2}_scale_inv: Inf at element \(0, 1\)"):
        open_source(d).read(name2)


def test_f16_and_f32_shards_read_exactly(ckpt_copy):
    d = ckpt_copy("qwen3_moe")
    shard = _shard_of(d, "model.norm.weight")
    orig = load_file(shard)
    half = {k: v.float().half() if i % 2 else v.float() for i, (k, v) in enumerate(sorted(orig.items()))}
    save_file(half, shard, metadata={"format": "pt"})
    src = open_source(d)
    for name, t in half.items():
        assert src.info(name).dtype == ("F16" if t.dtype == torch.float16 else "F32")
        assert torch.equal(src.read(name), t.float()), name


def test_unsupported_quantization_config(ckpt_copy):
    d = ckpt_copy("deepseek_v3")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="config.json: unsupported quantization_config .*compressed-tensors"):
        open_source(d)


def test_expert_shape_disagreeing_with_config(ckpt_copy):
    d = ckpt_copy("deepseek_v2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 96  # the tensors are (80, 128): the config lies
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match=r"tensor model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight has shape "
                                          r"\(80, 128\), but config.json .*implies \(96, 128\)"):
        open_source(d)


def test_threads_read_concurrently_and_close_is_safe(ckpt_dir):
    from concurrent.futures import ThreadPoolExecutor

    src = open_source(ckpt_dir("deepseek_v2"))
    names = src.tensor_names()
    want = {n: src.read(n) for n in names}
    with ThreadPoolExecutor(4) as pool:
        got = dict(zip(names, pool.map(src.read, names)))
    assert all(torch.equal(want[n], got[n]) for n in names)
    src.close()
    assert torch.equal(src.read(names[0]), want[names[0]])  # reading after close reopens the shard
