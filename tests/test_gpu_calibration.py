"""Layer-by-layer GPTQ calibration against the transformers model, model-level GPTQ vs RTN, bounded memory."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from ktconvert.gpu.calib import CalibrationError, LayerwiseGptq, calibration_tokens, read_calibration_text
from ktconvert.gpu.encoder import GpuLayerEncoder, GpuLayerOptions, make_gpu_encoder
from ktconvert.gpu.rtn import quantize_rtn
from ktconvert.sources import open_source
from ktconvert.testing import make_checkpoint, make_model

KINDS = ("attention", "shared_expert", "dense_mlp")


def _tokens(src, n=512, seq=128):
    text, _ = read_calibration_text(None)
    return calibration_tokens(src, text, n, seq, seed=0)


def _is_target(src):
    return lambda hub: src.arch.classify(hub).kind in KINDS


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "mixtral", "glm4_moe", "minimax_m2", "deepseek_v32",
                                  "gpt_oss"])
def test_layerwise_hessians_match_the_transformers_model(arch, tmp_path):
    """With float weights kept (quantize_fn -> None), every Hessian and the last hidden states equal those of the
    whole transformers model run at once: the per-layer build, weight loading and streamed experts are right."""
    src = open_source(make_checkpoint(arch, tmp_path))
    tokens = _tokens(src)
    got = {}

    def keep_float(name, w, h):
        got[name] = h.clone()
    cal = LayerwiseGptq(src, tokens, keep_float, _is_target(src))
    for li in range(src.arch.num_layers):
        cal._run_layer(li)

    model = make_model(arch)
    ref, final = {}, {}

    def hook(name):
        def f(_m, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            ref[name] = (2 * x.T @ x / x.shape[0]).float()
        return f
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod_name.startswith("model.layers."):
            mod.register_forward_pre_hook(hook(mod_name))
    model.model.norm.register_forward_pre_hook(lambda _m, args: final.setdefault("x", args[0]))
    with torch.no_grad():
        model(input_ids=tokens)
    want = {n for n in src.tensor_names() if src.arch.classify(n).kind in KINDS and n.endswith(".weight")}
    assert set(got) == want                     # (biases, GLM's q/k/v, stay full precision: no Hessian)
    for name, h in got.items():
        r = ref[name[: -len(".weight")].replace("block_sparse_moe", "mlp")]
        assert torch.allclose(h, r, rtol=1e-4, atol=1e-5 * float(r.abs().max())), name
    assert torch.allclose(cal.hidden, final["x"], rtol=1e-4, atol=1e-5)


def test_narrower_value_heads_run_the_flash_sdpa_padded(tmp_path):
    """MLA's value heads, narrower than its query/key heads, are zero-padded to their size for torch's sdpa (its
    flash kernel, not the math path) and the output cut back: the attention of torch's math path within float
    rounding. A model whose code tests the attention's name (DeepSeek-V3.2's indexer masks keys only under "sdpa")
    keeps the plain one; the Hessians above cover both against the whole transformers model."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ktconvert.gpu.calib import PADDED_SDPA, _sdpa_padded_values, hf_config, text_model_of

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, d, generator=g) for d in (48, 48, 32))      # (S, heads, L, D)
    module = torch.nn.Module()
    module.is_causal, module.training = True, False
    got, _ = _sdpa_padded_values(module, q, k, v, None, scaling=0.2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2).transpose(1, 2)
    assert got.shape == (2, 33, 4, 32)
    assert torch.allclose(got, want, atol=1e-6)
    want_hf, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.2)
    assert torch.allclose(got, want_hf, atol=1e-6)
    for arch, name in (("deepseek_v3", PADDED_SDPA), ("deepseek_v32", "sdpa")):
        src = open_source(make_checkpoint(arch, tmp_path / arch))
        assert hf_config(*text_model_of(src))._attn_implementation == name, arch


@pytest.mark.parametrize("arch,group_size", [("deepseek_v3", 32), ("qwen3_moe", 128)])
def test_gptq_beats_rtn_at_the_model_output(arch, group_size, tmp_path):
    """Whole quantized model (every non-expert Linear INT4) vs the float model on the calibration tokens."""
    src = open_source(make_checkpoint(arch, tmp_path))
    tokens = _tokens(src, n=512)
    enc = GpuLayerEncoder(GpuLayerOptions(method="gptq-int4", group_size=group_size), src=src)

    def rtn(name, w, h):
        wp, _ = enc._pad(name, w)
        return quantize_rtn(wp, 4, group_size)

    def run(qf):
        cal = LayerwiseGptq(src, tokens, qf, _is_target(src))
        for li in range(src.arch.num_layers):
            cal._run_layer(li)
        return cal.hidden
    ref = run(lambda name, w, h: None)
    err_gptq = float(((run(enc.quantize_with_hessian) - ref) ** 2).mean())
    err_rtn = float(((run(rtn) - ref) ** 2).mean())
    print(f"{arch}: model output MSE GPTQ {err_gptq:.3e}, RTN {err_rtn:.3e}")
    assert err_gptq < 0.7 * err_rtn, (err_gptq, err_rtn)


def test_gptq_encoder_is_deterministic_and_layer_order_safe(tmp_path):
    src = open_source(make_checkpoint("qwen3_moe", tmp_path))
    opts = GpuLayerOptions(method="gptq-int4", group_size=32, calib_tokens=256, seq_len=64, seed=3)
    names = [n for n in sorted(src.tensor_names(), key=lambda n: (src.arch.classify(n).layer or 0, n))
             if src.arch.classify(n).kind in KINDS]
    runs = []
    for _ in range(2):
        enc = GpuLayerEncoder(opts, src=src)
        runs.append({n: enc.encode(n, src.read(n).numpy(), src.arch.classify(n)) for n in names})
    for n in names:
        for part in runs[0][n]:
            assert runs[0][n][part].tobytes() == runs[1][n][part].tobytes()
    # a resumed conversion starts at a later layer: earlier layers are recomputed, results identical
    enc = GpuLayerEncoder(opts, src=src)
    late = [n for n in names if src.arch.classify(n).layer == 1]
    for n in late:
        out = enc.encode(n, src.read(n).numpy(), src.arch.classify(n))
        assert all(out[p].tobytes() == runs[0][n][p].tobytes() for p in out)


def test_calibration_needs_a_tokenizer(tmp_path):
    src = open_source(make_checkpoint("mixtral", tmp_path))
    (tmp_path / "tokenizer.json").unlink()
    enc = make_gpu_encoder("gptq-int4", src=src)
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(CalibrationError, match=r"tokenizer\.json does not exist.*rtn-int4"):
        enc.encode(name, src.read(name).numpy(), src.arch.classify(name))
    assert make_gpu_encoder("auto", src=src).method == "rtn-int4"      # the default falls back instead


_MEMORY_CHILD = textwrap.dedent("""
    import json, sys
    from ktconvert.gpu.encoder import make_gpu_encoder
    from ktconvert.sources import open_source
    src = open_source(sys.argv[1])
    enc = make_gpu_encoder("gptq-int4", src=src, group_size=128, calib_tokens=256, seq_len=128)
    key = lambda n: (src.arch.classify(n).layer is None, src.arch.classify(n).layer or 0, n)
    n_quantized = 0
    for name in sorted(src.tensor_names(), key=key):
        role = src.arch.classify(name)
        if role.kind not in ("expert", "skip"):
            n_quantized += any(k.endswith(".qweight") for k in enc.encode(name, src.read(name).numpy(), role))
    # VmHWM: this process's own peak RSS (ru_maxrss would carry the parent's peak across exec)
    hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_kib": int(hwm.split()[1]), "n": n_quantized}))
""")

_BIG = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 384, "n_routed_experts": 8,
        "q_lora_rank": 128, "kv_lora_rank": 128}


@pytest.mark.slow
def test_memory_stays_bounded_with_many_layers(tmp_path):
    """Peak RSS of GPTQ over a 8-layer checkpoint ~= over a 2-layer one, far below the 6 extra layers' size."""
    peaks, sizes = {}, {}
    for layers in (2, 8):
        d = make_checkpoint("deepseek_v3", tmp_path / f"l{layers}", num_layers=layers, **_BIG)
        sizes[layers] = json.loads((d / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(d)], capture_output=True, text=True,
                             timeout=300, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["n"] == 8 * layers            # 8 Linear weights per layer: MLA 5 + dense MLP / shared expert 3
        peaks[layers] = res["peak_rss_kib"] * 1024
    extra_f32 = 2 * (sizes[8] - sizes[2])      # the 6 extra layers as float32 (they are bf16 on disk)
    growth = peaks[8] - peaks[2]
    print(f"peak RSS 2 layers {peaks[2] / 2**20:.0f} MiB, 8 layers {peaks[8] / 2**20:.0f} MiB, "
          f"6 extra layers are {extra_f32 / 2**20:.0f} MiB as f32")
    assert growth < 0.15 * extra_f32, (peaks, extra_f32)


def test_act_order_gptq_writes_a_permuted_g_idx(tmp_path):
    from ktlayouts.gpu_formats import dequantize_named

    src = open_source(make_checkpoint("qwen3_moe", tmp_path, num_layers=1))
    enc = GpuLayerEncoder(GpuLayerOptions(method="gptq-int4", group_size=32, fmt="gptq", act_order=True,
                                          calib_tokens=256, seq_len=64), src=src)
    name = "model.layers.0.self_attn.q_proj.weight"
    out = enc.encode(name, src.read(name).numpy(), src.arch.classify(name))
    g_idx = out["model.layers.0.self_attn.q_proj.g_idx"]
    assert not (g_idx == sorted(g_idx)).all()                   # channels quantized in Hessian order
    assert (torch.bincount(torch.from_numpy(g_idx.astype("int64"))) == 32).all()
    w = src.read(name).numpy()
    deq = dequantize_named("gpu-gptq-int4", out, name)
    import numpy as np
    rel = float(np.linalg.norm(deq - w) / np.linalg.norm(w))
    assert rel < 0.2, rel        # measured 0.16; the same codes read with a sorted g_idx give 0.27
    assert enc.quantization_config()["desc_act"] is True


def test_gptq_beats_rtn_on_the_trained_default_model():
    """The shipped trained model (DeepSeek-V3 architecture, trained on Python source): KL of the INT4 model's next-token
    distribution to the float model's, GPTQ vs RTN, on the calibration tokens and on held-out source code."""
    from pathlib import Path

    import ktconvert
    from ktconvert.gpu.calib import tokenizer_for
    from ktconvert.gpu.evaluate import gptq_vs_rtn_kl

    model_dir = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"
    src = open_source(model_dir)
    calib = _tokens(src, n=1024, seq=256)
    ids = tokenizer_for(src)[0].encode((model_dir / "heldout_eval.txt").read_text(encoding="utf-8"),
                                       add_special_tokens=False).ids
    held = torch.tensor(ids[: 4 * 256]).reshape(4, 256)
    kl = gptq_vs_rtn_kl(src, calib, held, 128)
    print({f"{m}/{s}": f"{v:.2e}" for (m, s), v in kl.items()})
    assert kl["gptq", "calib"] < 0.6 * kl["rtn", "calib"]      # measured 2.4e-3 vs 6.1e-3 nats
    assert kl["gptq", "heldout"] < 0.9 * kl["rtn", "heldout"]        # measured 5.9e-3 vs 8.3e-3 nats


def test_calibration_matmul_follows_the_cpu_and_the_environment(monkeypatch):
    """bfloat16 matmuls in the expert-only calibration forward where the CPU has bf16 dot products, float32
    elsewhere; KTCONVERT_CALIB_MATMUL overrides (kernels: the library's int4 tiles, only when asked), and a wrong
    value names the variable."""
    import torch
    from ktrun.ops.library import kernels_available

    from ktconvert.gpu.calib import MATMUL_ENV, CalibrationError, calibration_matmul

    monkeypatch.delenv(MATMUL_ENV, raising=False)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert calibration_matmul() == ("bfloat16" if native else "float32")
    for name in ("float32", "bfloat16") + (("kernels",) if kernels_available() else ()):
        monkeypatch.setenv(MATMUL_ENV, name)
        assert calibration_matmul() == name
    monkeypatch.setenv(MATMUL_ENV, "fp8")
    with pytest.raises(CalibrationError, match="KTCONVERT_CALIB_MATMUL='fp8'"):
        calibration_matmul()


@pytest.mark.parametrize("matmul,tol", [("float32", 1e-5), ("bfloat16", 0.02)])
def test_the_forward_gives_the_priors_rows_from_the_experts_own_product(matmul, tol, tmp_path):
    """The expert quantizer's prior (each expert's down inputs on an evenly spaced sample of the layer's tokens) comes
    from the calibration forward's gate / up product of that expert, sample rows beside its routed ones: every hit
    expert's rows equal silu(xs gate^T) * (xs up^T) of the float weights (bf16 matmuls: within their rounding), and
    the routed rows are unchanged by the sample riding along."""
    from ktconvert.gpu.calib import make_calibrator, prior_rows

    layer = 1
    with open_source(make_checkpoint("deepseek_v3", tmp_path)) as src:
        cal = make_calibrator(src, None, 1024, 256, 0, lambda *a: None, lambda hub: False, capture_experts=True,
                              matmul=matmul)
        x, ids = cal.expert_inputs(layer)
        acts = cal.expert_activations(layer)
        prior = cal.expert_prior_rows(layer)
        xs = prior_rows(x.float())
        assert set(prior) == set(acts) == {int(e) for e in ids.unique()}
        for e, a_s in prior.items():
            gate, up = (src.read(src.arch.expert_tensor_name(layer, e, p)) for p in ("gate", "up"))
            ref = torch.nn.functional.silu(xs @ gate.T) * (xs @ up.T)
            assert a_s.shape == ref.shape
            assert float((a_s.float() - ref).norm() / ref.norm()) < tol
            xe = x.float()[(ids == e).any(1)]
            routed = torch.nn.functional.silu(xe @ gate.T) * (xe @ up.T)
            assert float((acts[e].float() - routed).norm() / routed.norm()) < tol
