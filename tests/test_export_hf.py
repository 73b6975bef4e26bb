"""`ktconvert export`: a compressed-tensors conversion as a hub-layout checkpoint, checked against transformers.

transformers 5.24 cannot load a compressed-tensors checkpoint whose routed experts are left unquantized (its MoE
converter prepends CompressedTensorsDequantize, which keeps only `weight_packed` keys, so the BF16 expert weights
vanish: "Concatenate on tensors destined for model.layers.N.mlp.experts.gate_up_proj. Ckpt contains: 0"). So the
export is decompressed with the compressed-tensors package's own compressor (driven by the exported
quantization_config), and the resulting dense state dict is loaded into transformers' model class.
"""
import json
import shutil
import subprocess
import sys

import numpy as np
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from ktconvert.hf_export import EXPERT_IGNORE_REGEX, EXPERT_SKIP_DYNAMIC
from ktconvert.source import open_source

KTCONVERT = [sys.executable, "-c", "from ktconvert.cli import main; main()"]
PROMPT = torch.tensor([[3, 17, 42, 99, 5, 200, 11, 7, 64, 128, 250, 1]])
# mean per-token KL(source || export), nats: measured 0.00087 (int4 per-channel RTN GPU layers, int8 experts); the
# tiny random fixture's logits are flat, so the bound is tight: experts with permuted rows give 0.0027
MAX_KL = 0.002
MAX_INT4_REL_ERROR = 0.2    # ||W_ct - W|| / ||W|| of each decompressed GPU Linear (a wrong layout gives ~1 or more)


def run(*args):
    return subprocess.run([*KTCONVERT, *map(str, args)], capture_output=True, text=True, timeout=300, check=False)


def convert(src, out, fmt):
    res = run("quantize", src, "-o", out, "--method", "int8-amx", "--gpu-method", "rtn-int4", "--gpu-format", fmt,
              "--gpu-group-size", -1, "--quiet")      # -1: the fixture's K=200 is no multiple of 32/64/128
    assert res.returncode == 0, res.stderr[-3000:]


def read_export(root) -> dict[str, torch.Tensor]:
    index = json.loads((root / "model.safetensors.index.json").read_text())
    sd = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(root / fname), framework="pt") as f:
            sd.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    assert set(sd) == set(index["weight_map"])
    return sd


def decompress(sd: dict[str, torch.Tensor], qc: dict) -> dict[str, torch.Tensor]:
    """Every X.weight_packed/weight_scale/weight_shape -> X.weight through compressed-tensors' compressor."""
    cfg = QuantizationConfig.model_validate(qc)
    scheme = cfg.config_groups["group_0"]
    comp = BaseCompressor.get_value_from_registry(cfg.format)
    bases = {k[: -len(".weight_packed")] for k in sd if k.endswith(".weight_packed")}
    out = {k: v for k, v in sd.items() if k.rpartition(".")[0] not in bases}
    for b in bases:
        parts = {p: sd[f"{b}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
        out[b + ".weight"] = comp.decompress(parts, scheme)["weight"].to(torch.bfloat16)
    return out


def logits(model_dir, **kw) -> torch.Tensor:
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["mismatched_keys"], info     # nothing left randomly initialised
    with torch.no_grad():
        return model(PROMPT).logits[0].double()


def test_export_compressed_tensors_loads_in_transformers_close_to_source(ckpt_dir, tmp_path):
    src = ckpt_dir("deepseek_v3")
    conv, hf = tmp_path / "conv", tmp_path / "hf"
    convert(src, conv, "compressed-tensors")
    res = run("export", conv, "-o", hf, "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]        # no temp dir left behind

    cfg = json.loads((hf / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and EXPERT_IGNORE_REGEX in qc["ignore"]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (hf / f).read_bytes() == (src / f).read_bytes()
    sd = read_export(hf)
    s = open_source(src)
    names = [n for n in s.tensor_names() if s.arch.classify(n).kind != "skip"]
    for name in names:
        base = name[: -len(".weight")]
        if f"{base}.weight_packed" in sd:
            assert sd[f"{base}.weight_packed"].dtype == torch.int32 and name not in sd
            assert s.arch.classify(name).kind in ("attention", "shared_expert", "dense_mlp"), name
            continue
        assert name in sd, name
        ref = s.read(name).float().numpy()
        got = sd[name].float().numpy()
        assert got.shape == ref.shape, name
        if s.arch.classify(name).kind == "expert":
            assert sd[name].dtype == torch.bfloat16
            assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.01, name      # int8 experts
        else:
            np.testing.assert_array_equal(got, ref, err_msg=name)                  # stored as in the source
    assert {k.rpartition(".")[0] for k in sd} == {n.rpartition(".")[0] for n in names}

    dense_sd = decompress(sd, qc)
    errs = {n: float((dense_sd[n].float() - s.read(n).float()).norm() / s.read(n).float().norm())
            for n in names if f"{n[: -len('.weight')]}.weight_packed" in sd}
    print(f"{len(errs)} compressed-tensors Linears, max rel error {max(errs.values()):.4f}")
    assert len(errs) == 24 and max(errs.values()) < MAX_INT4_REL_ERROR, errs

    a = logits(src)
    try:      # transformers itself: works once it keeps unquantized experts of a compressed-tensors checkpoint
        b = logits(hf)
        print("transformers loaded the export directly")
    except RuntimeError as e:
        # the known limitation; its report (logged) says "Concatenate on tensors destined for
        # model.layers.2.mlp.experts.gate_up_proj. Ckpt contains: 0"
        assert "automatic conversion of the weights" in str(e), e
        # compressed-tensors decompresses the export; transformers' DeepseekV3 class loads the result
        b = logits(write_decompressed(tmp_path / "dense", dense_sd, cfg))
    kl = (a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1)     # KL(source || export) per token
    print(f"KL(source || export) per token: mean {kl.mean():.5f} max {kl.max():.5f}")
    assert torch.isfinite(kl).all() and kl.mean() < MAX_KL
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def write_decompressed(dense, dense_sd, cfg):
    dense.mkdir()
    save_file(dense_sd, str(dense / "model.safetensors"), metadata={"format": "pt"})
    (dense / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    return dense


def test_export_gptq_writes_gptq_tensors_and_skips_experts(ckpt_dir, tmp_path):
    src = ckpt_dir("deepseek_v3")
    conv, hf = tmp_path / "conv", tmp_path / "hf"
    convert(src, conv, "gptq")
    res = run("export", conv, "-o", hf, "--quiet", "--shard-size", 1 << 20)     # several shards
    assert res.returncode == 0, res.stderr[-3000:]
    qc = json.loads((hf / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and EXPERT_SKIP_DYNAMIC in qc["dynamic"]
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    sd = read_export(hf)
    base = "model.layers.1.self_attn.q_a_proj"
    assert {f"{base}.{p}" for p in ("qweight", "qzeros", "scales", "g_idx")} <= set(sd) and f"{base}.weight" not in sd
    assert sd["model.layers.2.mlp.experts.15.down_proj.weight"].dtype == torch.bfloat16


def test_export_refuses_marlin_and_existing_output(ckpt_dir, tmp_path):
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
