"""GPU-layer quantization: GPTQ vs RTN time per decoder layer and peak RSS, output error of GPTQ vs RTN, and one
DeepSeek-V3-sized Linear, and the KL to the float model of the shipped trained model with INT4 GPU layers.
Prints `name: value unit` lines.

Fixture: deepseek_v3 (MLA attention, shared expert, dense first layer) with hidden 512, 4 layers. Each method runs
over every non-expert Linear in its own subprocess (peak RSS = VmHWM of that process). Error: the last hidden
states of the whole model with every non-expert Linear INT4 (group 128), GPTQ vs RTN, against the float model on
the calibration tokens and on held-out tokens (windows of the calibration text not used for calibration). Peer measured in the
same run: RTN is the baseline for GPTQ's time, and the float32 size of the layers is the baseline for memory.

    .venv/bin/python bench/bench_gptq.py                          # ~2 min on 2 cores
    .venv/bin/python bench/bench_gptq.py --with-deepseek-linear   # + one N=1536, K=7168 Linear (~1 min more)
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

DIMS = {"hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256, "n_routed_experts": 8,
        "q_lora_rank": 256, "kv_lora_rank": 128, "num_attention_heads": 4, "num_key_value_heads": 4}
LAYERS = 4
CHILD = r"""
import json, re, sys, time
import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401  (imports before the baseline)
from ktconvert.gpu.encoder import make_gpu_encoder
from ktconvert.sources import open_source
def status_kb(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1))
base = status_kb("VmRSS")
src = open_source(sys.argv[1])
enc = make_gpu_encoder(sys.argv[2], src=src, group_size=128, calib_tokens=1024, seq_len=256)
key = lambda n: (src.arch.classify(n).layer is None, src.arch.classify(n).layer or 0, n)
t = time.perf_counter()
for name in sorted(src.tensor_names(), key=key):
    role = src.arch.classify(name)
    if role.kind not in ("expert", "skip"):
        enc.encode(name, src.read(name).numpy(), role)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "peak_kb": status_kb("VmHWM"), "base_kb": base}))
"""


def largest_layer_f32_mb(ckpt: Path) -> float:
    """float32 size of the largest decoder layer (all its tensors, routed experts included)."""
    from ktconvert.sources import open_source

    src = open_source(ckpt)
    per_layer: dict[int, int] = {}
    for name in src.tensor_names():
        role = src.arch.classify(name)
        if role.layer is not None and role.kind != "skip":
            info = src.info(name)
            per_layer[role.layer] = per_layer.get(role.layer, 0) + 4 * int(torch.tensor(info.shape).prod())
    return max(per_layer.values()) / 1e6


def run_method(ckpt: Path, method: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), method], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def model_errors(ckpt: Path) -> dict[str, float]:
    """Relative MSE of the last hidden states, INT4 GPU layers (GPTQ / RTN) vs the float model."""
    from ktconvert.gpu.calib import calibration_tokens, read_calibration_text
    from ktconvert.gpu.evaluate import last_hidden_states
    from ktconvert.sources import open_source

    src = open_source(ckpt)
    text, _ = read_calibration_text(None)
    calib = calibration_tokens(src, text, 1024, 256, seed=0)
    every = calibration_tokens(src, text, 10 ** 9, 256, seed=0)           # all windows of the text
    held = torch.stack([w for w in every if not (w == calib).all(dim=1).any()][:2])   # 2 windows not calibrated on
    hidden = last_hidden_states(src, calib, held, 128)
    return {f"{m}_{split}": float(((hidden[m][split] - ref) ** 2).mean() / (ref ** 2).mean())
            for m in ("gptq", "rtn") for split, ref in hidden["float"].items()}


def trained_model_kl() -> dict[str, float]:
    """KL (nats/token) of the shipped trained model with INT4 GPU layers (group 128) to the float model."""
    import ktconvert
    from ktconvert.gpu.calib import calibration_tokens, read_calibration_text, tokenizer_for
    from ktconvert.gpu.evaluate import gptq_vs_rtn_kl
    from ktconvert.sources import open_source

    model_dir = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"
    src = open_source(model_dir)
    calib = calibration_tokens(src, read_calibration_text(None)[0], 1024, 256, seed=0)
    ids = tokenizer_for(src)[0].encode((model_dir / "heldout_eval.txt").read_text(encoding="utf-8"),
                                       add_special_tokens=False).ids
    held = torch.tensor(ids[: 4 * 256]).reshape(4, 256)
    return {f"{m}_{split}": v for (m, split), v in gptq_vs_rtn_kl(src, calib, held, 128).items()}


def deepseek_linear() -> dict[str, float]:
    """One q_a_proj-sized Linear of DeepSeek-V3 (N=1536, K=7168), 2048 correlated calibration tokens."""
    from ktconvert.gpu.gptq import GptqConfig, HessianAccumulator, gptq_quantize
    from ktconvert.gpu.rtn import quantize_rtn

    g = torch.Generator().manual_seed(0)
    k, n = 7168, 1536
    x = torch.randn(2048, 256, generator=g) @ torch.randn(256, k, generator=g) + 0.1 * torch.randn(2048, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.02
    acc = HessianAccumulator(k)
    acc.add(x)
    t = time.perf_counter()
    q, _ = gptq_quantize(w, acc.h, GptqConfig(bits=4, group_size=128))
    t_gptq = time.perf_counter() - t
    t = time.perf_counter()
    r = quantize_rtn(w, 4, 128)
    t_rtn = time.perf_counter() - t
    y = x @ w.T
    e_g = float(((x @ q.dequantize().T - y) ** 2).mean())
    e_r = float(((x @ r.dequantize().T - y) ** 2).mean())
    return {"gptq_s": t_gptq, "rtn_s": t_rtn, "err_ratio": e_g / e_r}


def main() -> None:
    from ktconvert.testing import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint("deepseek_v3", Path(tmp) / "ckpt", num_layers=LAYERS, **DIMS)
        idx = json.loads((ckpt / "model.safetensors.index.json").read_text())
        f32_mb = 2 * idx["metadata"]["total_size"] / 1e6
        res = {m: run_method(ckpt, m) for m in ("rtn-int4", "gptq-int4")}
        for m, r in res.items():
            tag = m.replace("-", "_")
            print(f"{tag}_seconds_per_layer: {r['seconds'] / LAYERS:.3f} s")
            print(f"{tag}_peak_rss: {r['peak_kb'] / 1024:.0f} MiB")
            print(f"{tag}_peak_rss_above_imports: {(r['peak_kb'] - r['base_kb']) / 1024:.0f} MiB")
        print(f"gptq_vs_rtn_time_ratio: {res['gptq-int4']['seconds'] / res['rtn-int4']['seconds']:.1f} x")
        g = res["gptq-int4"]
        layer_mb = largest_layer_f32_mb(ckpt)
        above_mb = (g["peak_kb"] - g["base_kb"]) * 1024 / 1e6
        print(f"checkpoint_as_f32: {f32_mb:.0f} MB")
        print(f"largest_layer_as_f32: {layer_mb:.1f} MB")
        print(f"gptq_peak_rss_above_imports_vs_checkpoint_f32: {above_mb / f32_mb:.2f} x")
        print(f"gptq_peak_rss_above_imports_vs_largest_layer_f32: {above_mb / layer_mb:.2f} x")
        err = model_errors(ckpt)
        for split in ("calib", "heldout"):
            print(f"model_output_rel_mse_gptq_{split}: {err[f'gptq_{split}']:.3e} ratio")
            print(f"model_output_rel_mse_rtn_{split}: {err[f'rtn_{split}']:.3e} ratio")
            print(f"gptq_over_rtn_error_{split}: {err[f'gptq_{split}'] / err[f'rtn_{split}']:.3f} ratio")
    kl = trained_model_kl()
    for split in ("calib", "heldout"):
        print(f"trained_model_kl_gptq_{split}: {kl[f'gptq_{split}']:.2e} nats/token")
        print(f"trained_model_kl_rtn_{split}: {kl[f'rtn_{split}']:.2e} nats/token")
        print(f"trained_model_gptq_over_rtn_kl_{split}: {kl[f'gptq_{split}'] / kl[f'rtn_{split}']:.3f} ratio")
    if "--with-deepseek-linear" not in sys.argv:
        print(f"torch_threads: {torch.get_num_threads()} threads")
        return
    lin = deepseek_linear()
    print(f"deepseek_q_a_proj_gptq_seconds: {lin['gptq_s']:.2f} s")
    print(f"deepseek_q_a_proj_rtn_seconds: {lin['rtn_s']:.3f} s")
    print(f"deepseek_q_a_proj_gptq_over_rtn_output_error: {lin['err_ratio']:.3f} ratio")
    print(f"torch_threads: {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
