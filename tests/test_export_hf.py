"""`ktconvert export`: a compressed-tensors / gptq conversion as a hub-layout checkpoint, checked against transformers.

The default export writes the routed experts in the GPU format with their own scheme, straight from the CPU
tiles' codes and scales. transformers loads it directly (`from_pretrained`, CPU, no option); every weight it ends
up with must equal the conversion's own dequantization exactly, and its logits stay close to the source model's.
"""
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from ktlayouts.compressed_tensors import ct_pack
from ktlayouts.converted_dir import expert_file, expert_tensor
from ktlayouts.cpu_expert import unpack_codes, unpack_scales
from ktlayouts.gptq import GptqGeometry, dequantize_kn, gptq_pack, gptq_unpack, unpack_cols
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from ktconvert.converted_reader import ConvertedDir
from ktconvert.export.hf import EXPERT_IGNORE_REGEX, EXPERT_SKIP_DYNAMIC
from ktconvert.export.hf_experts import EXPERT_DYNAMIC, EXPERT_TARGET_REGEX

KTCONVERT = [sys.executable, "-c", "from ktconvert.cli import main; main()"]
PROMPT = torch.tensor([[3, 17, 42, 99, 5, 200, 11, 7, 64, 128, 250, 1]])
PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ZERO = {4: 8, 8: 128}
# mean per-token KL(source || transformers' load of the export), nats. Measured: deepseek_v3 0.00089 (int4 experts,
# group 128) and 0.00087 (int8 per-row experts, 2 NUMA shards), qwen3_moe 0.00098 (int4 per-row); the int4
# per-channel RTN GPU layers dominate it. Layout errors are caught by the exact weight comparisons, not by this.
MAX_KL = 0.002


def run(*args):
    return subprocess.run([*KTCONVERT, *map(str, args)], capture_output=True, text=True, timeout=300, check=False)


def convert(src, out, fmt, method="int8-amx", group=128, numa=1, gpu_method="rtn-int4"):
    res = run("quantize", src, "-o", out, "--method", method, "--group-size", group, "--numa-nodes", numa,
              "--gpu-method", gpu_method, "--gpu-format", fmt,
              "--gpu-group-size", -1, "--quiet")      # -1: the fixture's K=200 is no multiple of 32/64/128
    assert res.returncode == 0, res.stderr[-3000:]


def export(conv, hf, *args):
    res = run("export", conv, "-o", hf, "--quiet", *args)
    assert res.returncode == 0, res.stderr[-3000:]


def read_export(root) -> dict[str, torch.Tensor]:
    index = json.loads((root / "model.safetensors.index.json").read_text())
    sd = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(root / fname), framework="pt") as f:
            sd.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    assert set(sd) == set(index["weight_map"])
    return sd


def stored_codes(conv: ConvertedDir, layer: int, e: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
    """The expert's codes (N, K) and per-column scales (N, K) float32 in source shape, from the tiles of every shard
    (gate/up shards stack rows, down shards stack columns)."""
    geo, codes, scales = conv.geometry, [], []
    for s in range(geo.numa_nodes):
        geom = geo.matrix_geometry(proj, s)
        f = conv.open(expert_file(layer, s, geo.numa_nodes))
        c = unpack_codes(f.get_tensor(expert_tensor(proj, "qweight"))[e].numpy(), geom)
        sc = unpack_scales(f.get_tensor(expert_tensor(proj, "scales"))[e].numpy(), geom)
        codes.append(c[: geom.n, : geom.k])
        scales.append(np.repeat(sc, geom.group, axis=1)[: geom.n, : geom.k])
    n, k = (geo.hidden, geo.intermediate) if proj == "down" else (geo.intermediate, geo.hidden)
    axis = 1 if proj == "down" else 0
    return np.concatenate(codes, axis)[:n, :k], np.concatenate(scales, axis)[:n, :k]


def expert_refs(conv: ConvertedDir):
    """(layer, expert, proj, hub base name, codes (N, K), scales (N, K) per column, read_expert's W (N, K))."""
    for layer in conv.geometry.moe_layers:
        for e in range(conv.geometry.n_experts):
            w = conv.read_expert(layer, e)
            for p, hub in PROJ_NAMES.items():
                codes, scales = stored_codes(conv, layer, e, p)
                yield layer, e, p, f"model.layers.{layer}.mlp.experts.{e}.{hub}", codes, scales, w[p]


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits[0].double()


def load(model_dir):
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    return model, info


@pytest.mark.parametrize(("arch", "method", "group", "numa", "bits", "step"), [
    ("deepseek_v3", "int4-amx", 128, 1, 4, 32),  # G=128 > H=96: gate/up rows hold one partial group -> 3 x 32
    ("deepseek_v3", "int8-amx", -1, 2, 8, 32),   # per-row, down split in 2 shards with own scales (at I = 64)
    ("qwen3_moe", "int4-amx", 128, 1, 4, -1),    # H=128, I=80: one group per row -> compressed-tensors "channel"
])
def test_export_quantized_experts_load_directly_in_transformers(ckpt_dir, tmp_path, arch, method, group, numa, bits,
                                                                 step):
    src = ckpt_dir(arch)
    conv_dir, hf = tmp_path / "conv", tmp_path / "hf"
    convert(src, conv_dir, "compressed-tensors", method, group, numa)
    export(conv_dir, hf)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]        # no temp dir left behind
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (hf / f).read_bytes() == (src / f).read_bytes()

    qc = json.loads((hf / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and EXPERT_IGNORE_REGEX not in qc["ignore"]
    dense_group, expert_group = qc["config_groups"].values()
    assert dense_group["targets"] == ["Linear"] and expert_group["targets"] == [EXPERT_TARGET_REGEX]
    scheme = {"num_bits": bits, "strategy": "channel", "group_size": None} if step == -1 else \
        {"num_bits": bits, "strategy": "group", "group_size": step}
    assert expert_group["weights"] | scheme | {"symmetric": True} == expert_group["weights"]

    sd, conv = read_export(hf), ConvertedDir(conv_dir)
    n_experts = 0
    for _layer, _e, _p, base, codes, col_scales, w in expert_refs(conv):
        n_experts += 1
        n, k = codes.shape
        group_k = k if step == -1 else step
        scales = col_scales[:, ::group_k]                                       # (N, K / group_k)
        assert np.array_equal(np.repeat(scales, group_k, axis=1), col_scales), base  # lossless: 1 scale per group
        want = ct_pack(codes.T, scales.T, GptqGeometry(n, k, bits, step))
        assert set(sd) >= {f"{base}.{p}" for p in want} and f"{base}.weight" not in sd
        assert sd[f"{base}.weight_packed"].numpy().tobytes() == want["weight_packed"].tobytes(), base
        assert np.array_equal(sd[f"{base}.weight_shape"].numpy(), want["weight_shape"])
        got_scale = sd[f"{base}.weight_scale"]
        assert got_scale.dtype == torch.float32 and np.array_equal(got_scale.numpy(), scales), base
        assert np.array_equal(got_scale.numpy().astype(np.float16), want["weight_scale"])
        q = unpack_cols(sd[f"{base}.weight_packed"].numpy(), bits).astype(np.float32) - ZERO[bits]
        np.testing.assert_array_equal(q * np.repeat(got_scale.numpy(), group_k, axis=1), w, err_msg=base)
    assert n_experts == len(conv.geometry.moe_layers) * conv.geometry.n_experts * 3

    model, info = load(hf)                      # directly: no decompression step, no loading option
    assert not any(info.values()), info         # nothing missing, unexpected, mismatched or left random
    for name, t in model.state_dict().items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):    # fused: (E, 2I, H), (E, H, I)
            layer = int(name.split(".")[2])
            mats = [conv.read_expert(layer, e) for e in range(conv.geometry.n_experts)]
            want = [np.concatenate([m["gate"], m["up"]]) if name.endswith("gate_up_proj") else m["down"]
                    for m in mats]
        elif name.endswith((".weight_packed", ".weight_scale", ".weight_shape")):
            continue                            # the compressed-tensors parameters left beside the weight
        else:
            want = conv.read_dense(name)
        np.testing.assert_array_equal(t.numpy(), np.asarray(want), err_msg=name)  # every weight, exactly
    conv.close()

    a = logits(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32))
    b = logits(model)
    kl = (a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1)     # KL(source || export) per token
    print(f"{arch} {method} G={group} x{numa}: KL(source || export) per token: mean {kl.mean():.5f} max {kl.max():.5f}")
    assert torch.isfinite(kl).all() and kl.mean() < MAX_KL
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def test_export_bf16_experts_are_dequantized_and_ignored(ckpt_dir, tmp_path):
    conv_dir, hf = tmp_path / "conv", tmp_path / "hf"
    convert(ckpt_dir("deepseek_v3"), conv_dir, "compressed-tensors")
    export(conv_dir, hf, "--experts", "bf16")
    qc = json.loads((hf / "config.json").read_text())["quantization_config"]
    assert list(qc["config_groups"]) == ["group_0"] and EXPERT_IGNORE_REGEX in qc["ignore"]
    sd, conv = read_export(hf), ConvertedDir(conv_dir)
    for layer in conv.geometry.moe_layers:
        for e in range(conv.geometry.n_experts):
            for p, w in conv.read_expert(layer, e).items():
                t = sd[f"model.layers.{layer}.mlp.experts.{e}.{PROJ_NAMES[p]}.weight"]
                assert t.dtype == torch.bfloat16
                assert torch.equal(t, torch.from_numpy(w).to(torch.bfloat16))
    conv.close()


def test_export_gptq_writes_gptq_experts(ckpt_dir, tmp_path):
    """transformers needs gptqmodel for gptq checkpoints, which is not installed here: the structure and our own
    dequantization of the exported tensors are checked instead."""
    conv_dir, hf = tmp_path / "conv", tmp_path / "hf"
    convert(ckpt_dir("deepseek_v3"), conv_dir, "gptq", "int4-amx", 64)
    export(conv_dir, hf, "--shard-size", 1 << 20)                                # several shards
    qc = json.loads((hf / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["dynamic"][EXPERT_DYNAMIC] == {"bits": 4, "group_size": 32}
    assert EXPERT_SKIP_DYNAMIC not in qc["dynamic"]
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    sd, conv = read_export(hf), ConvertedDir(conv_dir)
    base = "model.layers.1.self_attn.q_a_proj"
    assert {f"{base}.{p}" for p in ("qweight", "qzeros", "scales", "g_idx")} <= set(sd) and f"{base}.weight" not in sd
    for _layer, _e, _p, base, codes, col_scales, w in expert_refs(conv):
        geom = GptqGeometry(codes.shape[0], codes.shape[1], 4, 32)
        want = gptq_pack(codes.T, col_scales[:, ::32].T, geom)
        parts = {p: sd[f"{base}.{p}"].numpy() for p in want}
        for p in ("qweight", "qzeros", "g_idx"):
            assert parts[p].tobytes() == want[p].tobytes(), (base, p)
        assert parts["scales"].dtype == np.float32
        got_codes, _scales_f16, g_idx = gptq_unpack(parts, geom)                  # also checks the zero points
        np.testing.assert_array_equal(dequantize_kn(got_codes, parts["scales"], g_idx, 4), w, err_msg=base)
    conv.close()


def test_export_refuses_marlin_bf16_gpu_layers_and_existing_output(ckpt_dir, tmp_path):
    src = ckpt_dir("deepseek_v3")
    conv = tmp_path / "conv"
    res = run("quantize", src, "-o", conv, "--method", "int8-amx", "--gpu-method", "rtn-int4", "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    res = run("export", conv, "-o", tmp_path / "hf", "--quiet")
    assert res.returncode != 0 and "--gpu-format marlin" in res.stderr and "compressed-tensors" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv"]                 # nothing half-written
    (tmp_path / "taken").mkdir()
    res = run("export", conv, "-o", tmp_path / "taken", "--quiet")
    assert res.returncode != 0 and "already exists" in res.stderr
    shutil.rmtree(tmp_path / "taken")

    dense = tmp_path / "dense"               # no GPU-quantized layer: no quantization_config for the experts
    convert(src, dense, "compressed-tensors", gpu_method="bf16")
    res = run("export", dense, "-o", tmp_path / "hf", "--quiet")
    assert res.returncode != 0 and "--experts bf16" in res.stderr
    export(dense, tmp_path / "hf", "--experts", "bf16")


def test_export_refuses_experts_without_an_exact_group_length(ckpt_dir, tmp_path):
    """qwen3_moe's tiny moe_intermediate_size 80 is no multiple of 32, and group-64 down rows change scale at
    column 64: no group length in (128, 64, 32) is exact."""
    conv = tmp_path / "conv"
    convert(ckpt_dir("qwen3_moe"), conv, "compressed-tensors", "int4-amx", 64)
    res = run("export", conv, "-o", tmp_path / "hf", "--quiet")
    assert res.returncode != 0 and "intermediate 80" in res.stderr and "--experts bf16" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv"]


# --- the hybrid families: what transformers loads of Qwen3-Next, Qwen3.5-MoE and gpt-oss ---------------------------
# KL(source || export) measured (int4 g32 experts, rtn-int4 per-channel GPU layers): qwen3_next 0.00041,
# qwen3_5_moe 0.00042, gpt_oss 0.00120 (its experts also rounded to bf16); held to MAX_KL.


def hub_name(conv_config: dict, name: str) -> str:
    """The conversion's name of a transformers parameter: Qwen3.5-MoE is exported as its text-only CausalLM class,
    whose decoder sits at model.* where the release (and the conversion) keep it under model.language_model.*."""
    if conv_config["model_type"] == "qwen3_5_moe" and name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe", "gpt_oss"])
def test_export_for_transformers_of_the_hybrid_families(tmp_path, arch):
    """`--for transformers` of Qwen3-Next and Qwen3.5-MoE (int4 g32 experts under per-expert names, which
    transformers fuses; Qwen3.5-MoE as its text model's own checkpoint, Qwen3_5MoeForCausalLM) and gpt-oss (the hub's
    fused layout: gate_up (E, H, 2I) interleaved and down (E, I, H) with biases, dequantized to bf16):
    AutoModelForCausalLM loads it with nothing missing, every weight it holds is the conversion's own dequantization
    (gpt-oss's experts: rounded to bf16), and its logits stay within the quantization's KL of the source's."""
    from ktconvert.testing import make_checkpoint
    src = make_checkpoint(arch, tmp_path / "src", **({} if arch == "gpt_oss" else {"moe_intermediate_size": 64}))
    conv_dir, hf = tmp_path / "conv", tmp_path / "hf"
    res = run("quantize", src, "-o", conv_dir, "--method", "int4-amx", "--group-size", 32, "--expert-quantizer",
              "rtn", "--gpu-method", "rtn-int4", "--gpu-format", "compressed-tensors", "--gpu-group-size", -1,
              "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    res = run("export", conv_dir, "--for", "transformers", "-o", hf, "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    record = json.loads((hf / "ktconvert-export.json").read_text())
    assert ("experts" in record) == (arch == "gpt_oss") and ("text_only" in record) == (arch == "qwen3_5_moe")
    if arch == "qwen3_5_moe":
        exported = json.loads((hf / "config.json").read_text())
        assert exported["architectures"] == ["Qwen3_5MoeForCausalLM"] and "vision_config" not in exported
        index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
        assert "model.layers.0.linear_attn.A_log" in index and not [n for n in index if "language_model" in n]
    model, info = load(hf)
    assert not any(info.values()), info
    conv = ConvertedDir(conv_dir)
    cfg = json.loads((conv_dir / "config.json").read_text())
    n_experts = 0
    for name, t in model.state_dict().items():
        if name.endswith((".weight_packed", ".weight_scale", ".weight_shape")):
            continue
        m = re.search(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m:                                              # fused: (E, 2I, H) / (E, H, I), gpt-oss (E, H, 2I) / (E, I, H)
            n_experts += 1
            mats = [conv.read_expert(int(m[1]), e) for e in range(conv.geometry.n_experts)]
            if arch == "gpt_oss":
                want = [np.stack([x["gate"], x["up"]], 1).reshape(-1, x["gate"].shape[1]).T if m[2] == "gate_up_proj"
                        else x["down"].T for x in mats]                     # gate / up interleaved, input first
                want = torch.from_numpy(np.stack(want)).to(torch.bfloat16).float()
            else:
                want = [np.concatenate([x["gate"], x["up"]]) if m[2] == "gate_up_proj" else x["down"] for x in mats]
            np.testing.assert_array_equal(t.numpy(), np.asarray(want), err_msg=name)
        else:
            np.testing.assert_array_equal(t.numpy(), np.asarray(conv.read_dense(hub_name(cfg, name))), err_msg=name)
    assert n_experts == 2 * len(conv.geometry.moe_layers)
    conv.close()
    a = logits(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32))
    b = logits(model)
    kl = (a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1)
    print(f"{arch}: KL(source || export) per token: mean {kl.mean():.5f} max {kl.max():.5f}")
    assert torch.isfinite(kl).all() and kl.mean() < MAX_KL
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75
