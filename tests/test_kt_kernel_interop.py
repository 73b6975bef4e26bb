"""`ktconvert export --for sglang-kt`: kt-kernel's own loader and MoE forward on the export, against our kernels.

For every kt method (GPTQ_INT4, RAWINT4 group 32, AMXINT4, AMXINT8) and 1 and 2 NUMA parts, kt-kernel 0.7.2 (from
PyPI, `make test-interop` installs it) loads the export with its own loaders and runs its MoE wrapper
(tests/kt_kernel_driver.py, a process per run) on given activations, expert ids and weights; the result must match
our kernels (ktrun.ops.moe) on the same conversion. Three numbers per case, all relative Frobenius errors:
    weights  the export as kt-kernel reads it (decoded with ktlayouts) against the conversion's dequantization:
             0 for GPTQ_INT4 / RAWINT4 (asserted bit for bit), the reported re-quantization error for AMX methods
    kt-ref   kt-kernel's output against a float64 MoE on the exported weights (kt-kernel's own arithmetic: int8
             activations, bf16 staging of inputs/outputs)
    kt-ours  kt-kernel's output against our kernels' on the conversion: the bound the issue asks for
Skipped (visibly) when kt-kernel is not installed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ktlayouts.compressed_tensors import ct_unpack
from ktlayouts.gptq import GptqGeometry, dequantize_kn, gptq_unpack
from ktlayouts.kt_kernel import AMX_METHOD_BITS, KtAmxGeometry, amx_dequantize, amx_tensor_name, unpack_amx
from safetensors import safe_open

from ktconvert.converted_reader import ConvertedDir
from ktconvert.testing import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("kt_kernel_driver.py")
KTCONVERT = [sys.executable, "-c", "from ktconvert.cli import main; main()"]
INTEROP_DIR = Path(os.environ.get("KT_KERNEL_PATH", ROOT / "build" / "interop"))   # `make test-interop` target
DIMS = {"hidden_size": 256, "moe_intermediate_size": 256}      # kt-kernel's AMX rules: H % 128, (I / N) % 128
T = 7                                                            # tokens per layer
# Bounds, relative Frobenius errors of kt-kernel's MoE output (measured on this machine, AVX-512 VNNI, kt-kernel's
# avx512_bf16 build; the table is in runtime/serve/README.md "Serving beyond one machine"):
#   kt-ref  against float64 on the exported weights; measured GPTQ_INT4 0.0035-0.0040, RAWINT4 0.0115-0.0118,
#           AMXINT4 0.016-0.020, AMXINT8 0.015-0.020 (kt-kernel's int8 activations; GPTQ_INT4 keeps them float)
#   kt-ours against our kernels on the conversion: KT_OURS_BOUND + 2 x the exported weights' error (0 for the exact
#           methods; the AMX re-fit error otherwise, which the export reports). Measured GPTQ_INT4 0.015-0.016,
#           RAWINT4 0.0072-0.0075, AMXINT8 0.011-0.021 (weights 0.0015-0.0064), AMXINT4 0.059-0.087 (weights
#           0.030-0.050: kt-kernel's int4 tiles have 15 levels per row against our 16 per group). Our kernels'
#           own error against float64 is 0.011-0.019 (int8 activations per group), most of the exact methods' gap.
KT_REF_BOUND = {"GPTQ_INT4": 0.01, "RAWINT4": 0.025, "AMXINT4": 0.035, "AMXINT8": 0.035}
KT_OURS_BOUND = {"GPTQ_INT4": 0.03, "RAWINT4": 0.02, "AMXINT4": 0.035, "AMXINT8": 0.035}
PROJ_HUB = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def kt_kernel_env() -> dict | None:
    """Environment in which `import kt_kernel` works (its install dir on PYTHONPATH), or None."""
    env = {**os.environ}
    if INTEROP_DIR.is_dir():
        env["PYTHONPATH"] = os.pathsep.join([str(INTEROP_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    res = subprocess.run([sys.executable, "-c", "import kt_kernel"], env=env, capture_output=True, timeout=120, check=False)
    return env if res.returncode == 0 else None


@pytest.fixture(scope="module")
def kt_env():
    env = kt_kernel_env()
    if env is None:
        pytest.skip(f"kt-kernel is not installed (looked in {INTEROP_DIR} and the environment): run "
                    "`make test-interop`, which installs kt-kernel 0.7.2 there and runs these tests")
    return env


def run(*args):
    return subprocess.run([*KTCONVERT, *map(str, args)], capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def interop_ckpt(tmp_path_factory):
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("kt_ckpt"), **DIMS)


CONVERSIONS = {   # name: quantize arguments
    "gptq-int4-g128": ["--method", "int4-amx", "--group-size", 128, "--gpu-format", "gptq"],
    "ct-int4-g32-bf16": ["--method", "int4-amx", "--group-size", 32, "--bf16-scales",
                         "--gpu-format", "compressed-tensors"],
    "ct-int4-row-x2": ["--method", "int4-amx", "--group-size", -1, "--numa-nodes", 2,
                       "--gpu-format", "compressed-tensors"],
    "ct-int8-row": ["--method", "int8-amx", "--group-size", -1, "--gpu-format", "compressed-tensors"],
}


@pytest.fixture(scope="module")
def conversions(interop_ckpt, tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            out = tmp_path_factory.mktemp("kt_conv") / name
            res = run("quantize", interop_ckpt, "-o", out, *CONVERSIONS[name], "--gpu-method", "rtn-int4",
                      "--gpu-group-size", -1, "--quiet")
            assert res.returncode == 0, res.stderr[-3000:]
            made[name] = out
        return made[name]
    return get


def moe_reference(weights: dict, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 MoE: weights[(proj, e)] (N, K); x (T, H) -> (T, H)."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = weights["gate", e] @ x[t], weights["up", e] @ x[t]
            out[t] += w[t, j] * (weights["down", e] @ (g / (1 + np.exp(-g)) * u))
    return out


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def exported_weights(out: Path, method: str, layer: int, n_experts: int, hidden: int, inter: int,
                     n_parts: int) -> dict:
    """The experts as kt-kernel reads them from the export, decoded with ktlayouts: {(proj, e): W (N, K)}."""
    files = [p for p in out.rglob("*.safetensors")]
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                tensors[k] = (f, k)

    def get(name):
        f, k = tensors[name]
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(k)
    mats = {}
    for e in range(n_experts):
        for p in ("gate", "up", "down"):
            n, k = (hidden, inter) if p == "down" else (inter, hidden)
            if method in AMX_METHOD_BITS:
                bits, part = AMX_METHOD_BITS[method], inter // n_parts
                pieces = []
                for m in range(n_parts):
                    geom = KtAmxGeometry(hidden, part, bits) if p == "down" else KtAmxGeometry(part, hidden, bits)
                    q = unpack_amx(get(amx_tensor_name(layer, p, e, m, "weight")).numpy(), geom)
                    pieces.append(amx_dequantize(q, get(amx_tensor_name(layer, p, e, m, "scale")).numpy(), bits))
                mats[p, e] = np.concatenate(pieces, axis=1 if p == "down" else 0)
                continue
            base = f"model.layers.{layer}.mlp.experts.{e}.{PROJ_HUB[p]}"
            if method == "GPTQ_INT4":
                parts = {s: get(f"{base}.{s}").numpy() for s in ("qweight", "qzeros", "scales", "g_idx")}
                groups = parts["scales"].shape[0]
                geom = GptqGeometry(n, k, 4, k // groups)
                codes, _s16, g_idx = gptq_unpack(parts, geom)
                mats[p, e] = dequantize_kn(codes, parts["scales"].astype(np.float32), g_idx, 4)
            else:
                scale = get(f"{base}.weight_scale")
                assert scale.dtype == torch.bfloat16                        # what kt-kernel's RAWINT4 asserts
                scale = scale.float().numpy()
                geom = GptqGeometry(n, k, 4, k // scale.shape[1])
                codes, _ = ct_unpack({"weight_packed": get(f"{base}.weight_packed").numpy(),
                                      "weight_scale": scale, "weight_shape": get(f"{base}.weight_shape").numpy()},
                                     geom)
                mats[p, e] = (codes.T.astype(np.float32) - 8) * np.repeat(scale, geom.group, axis=1)
    return mats


def ours(conv_dir: Path, layers, inputs) -> dict:
    from ktrun.experts.kernel import KernelExperts
    from ktrun.loader import load_converted
    model = load_converted(conv_dir)
    ex = KernelExperts(model, n_threads=2)
    try:
        out = {}
        for layer in layers:
            y = torch.zeros(T, model.geometry.hidden)
            ex.submit(layer, torch.from_numpy(inputs[f"x_{layer}"]).to(torch.bfloat16),
                      torch.from_numpy(inputs[f"ids_{layer}"]), torch.from_numpy(inputs[f"w_{layer}"]), y)
            ex.sync()
            out[layer] = y.numpy().copy()
        return out
    finally:
        ex.close()


CASES = [  # (conversion, kt method, NUMA parts)
    ("gptq-int4-g128", "GPTQ_INT4", 1), ("gptq-int4-g128", "GPTQ_INT4", 2),
    ("ct-int4-g32-bf16", "RAWINT4", 1), ("ct-int4-g32-bf16", "RAWINT4", 2),
    ("ct-int4-row-x2", "AMXINT4", 1), ("ct-int4-row-x2", "AMXINT4", 2),
    ("ct-int8-row", "AMXINT8", 1), ("ct-int8-row", "AMXINT8", 2),
    ("ct-int4-g32-bf16", "AMXINT8", 2),           # other bits and groups: every row re-quantized
]


@pytest.mark.parametrize(("conv_name", "method", "numa"), CASES)
def test_kt_kernel_runs_the_export_like_our_kernels(kt_env, conversions, tmp_path, conv_name, method, numa):
    conv_dir = conversions(conv_name)
    out = tmp_path / "export"
    res = run("export", conv_dir, "--for", "sglang-kt", "--kt-method", method, "--numa-nodes", numa, "-o", out,
              "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    record = json.loads((out / "ktconvert-export.json").read_text())
    weight_path = out / record["kt_weight_path"]
    assert f"--kt-method {method}" in res.stdout and f"--kt-threadpool-count {numa}" in res.stdout
    assert f"--kt-weight-path {weight_path.resolve()}" in res.stdout

    conv = ConvertedDir(conv_dir)
    geo = conv.geometry
    rng = np.random.default_rng(numa)
    inputs = {}
    for layer in geo.moe_layers:
        x = torch.from_numpy(rng.standard_normal((T, geo.hidden)).astype(np.float32)).to(torch.bfloat16).float()
        inputs[f"x_{layer}"] = x.numpy()
        inputs[f"ids_{layer}"] = np.stack([rng.choice(geo.n_experts, 2, replace=False) for _ in range(T)])
        inputs[f"w_{layer}"] = rng.random((T, 2)).astype(np.float32)
    np.savez(tmp_path / "in.npz", **inputs)
    spec = {"weight_path": str(weight_path), "method": method, "layers": list(geo.moe_layers),
            "n_experts": geo.n_experts, "top_k": 2, "hidden": geo.hidden, "intermediate": geo.intermediate,
            "threadpool_count": numa, "threads": 2, "inputs": str(tmp_path / "in.npz"), "out": str(tmp_path / "o.npz")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    kt = subprocess.run([sys.executable, str(DRIVER), str(tmp_path / "spec.json")], env=kt_env, capture_output=True,
                        text=True, timeout=600, check=False)
    assert kt.returncode == 0, (kt.stdout[-2000:], kt.stderr[-3000:])
    y_kt = np.load(tmp_path / "o.npz")
    y_ours = ours(conv_dir, geo.moe_layers, inputs)

    for layer in geo.moe_layers:
        conv_w = {}
        for e in range(geo.n_experts):
            for p, m in conv.read_expert(layer, e).items():
                conv_w[p, e] = m
        exp_w = exported_weights(out, method, layer, geo.n_experts, geo.hidden, geo.intermediate, numa)
        w_err = rel(np.concatenate([exp_w[k].ravel() for k in sorted(exp_w)]),
                    np.concatenate([conv_w[k].ravel() for k in sorted(conv_w)]))
        if method in ("GPTQ_INT4", "RAWINT4"):
            for k, want in conv_w.items():                     # exact: the codes and scales are taken over
                np.testing.assert_array_equal(exp_w[k], want, err_msg=str(k))
        else:
            assert w_err <= max(record["expert_error"]["worst_matrix_rel_error"].values()) + 1e-6
        x, ids, w = inputs[f"x_{layer}"], inputs[f"ids_{layer}"], inputs[f"w_{layer}"]
        ref = moe_reference(exp_w, x, ids, w)
        y = y_kt[f"y_{layer}"]
        assert np.abs(y).max() > 0, "kt-kernel returned zeros"
        kt_ref, kt_ours = rel(y, ref), rel(y, y_ours[layer])
        ours_ref = rel(y_ours[layer], moe_reference(conv_w, x, ids, w))
        print(f"kt-interop {conv_name} {method} numa={numa} layer {layer}: weights {w_err:.5f} kt-ref {kt_ref:.5f} "
              f"ours-ref {ours_ref:.5f} kt-ours {kt_ours:.5f} (kt-kernel {y_kt['cpu_variant']})")
        assert kt_ref <= KT_REF_BOUND[method], (layer, kt_ref)
        assert kt_ours <= KT_OURS_BOUND[method] + 2 * w_err, (layer, kt_ours, w_err)
    conv.close()


def test_kt_kernel_own_quantizer_writes_our_amx_bytes(kt_env, tmp_path):
    """kt-kernel's online quantization of BF16 weights (AMXMoEWrapper.load_weights_from_tensors, save=True) dumps
    its B buffers; ktlayouts.kt_kernel's quantize_amx + pack_amx of the same weights must give the same bytes,
    including a hidden size past one 3584-column K block and 2 NUMA parts."""
    script = tmp_path / "dump.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(DRIVER.parent)!r})\n"
        "import kt_kernel_driver, kt_kernel.experts_base as eb\n"
        "eb.torch = kt_kernel_driver._UnpinnedTorch()\n"
        "from kt_kernel import KTMoEWrapper\n"
        "method, out, I, H, tp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])\n"
        "g = torch.load(out + '/src.pt')\n"
        "w = KTMoEWrapper(layer_idx=0, num_experts=2, num_experts_per_tok=2, hidden_size=H, moe_intermediate_size=I,"
        " gpu_experts_mask=None, cpuinfer_threads=2, threadpool_count=tp, weight_path=out, chunked_prefill_size=64,"
        " method=method)\n"
        "w.load_weights_from_tensors(g['gate'], g['up'], g['down'], torch.arange(2))\n")
    from ktlayouts.kt_kernel import pack_amx, quantize_amx
    for method, inter, hidden, tp in (("AMXINT8", 128, 3712, 1), ("AMXINT4", 256, 3712, 2)):
        bits, root = AMX_METHOD_BITS[method], tmp_path / method
        root.mkdir()
        gen = torch.Generator().manual_seed(bits)
        src = {"gate": torch.randn(2, inter, hidden, generator=gen), "up": torch.randn(2, inter, hidden, generator=gen),
               "down": torch.randn(2, hidden, inter, generator=gen)}
        src = {k: (v * 0.05).to(torch.bfloat16) for k, v in src.items()}
        torch.save(src, root / "src.pt")
        res = subprocess.run([sys.executable, str(script), method, str(root), str(inter), str(hidden), str(tp)],
                             env={**kt_env, "KT_FORCE_SYNC_SUBMIT": "1"}, capture_output=True, text=True, timeout=600, check=False)
        assert res.returncode == 0, res.stderr[-3000:]
        part, name = inter // tp, "INT8" if bits == 8 else "INT4"
        for p in ("gate", "up", "down"):
            for m in range(tp):
                for e in range(2):
                    full = src[p][e].float().numpy()
                    w = full[:, m * part:(m + 1) * part] if p == "down" else full[m * part:(m + 1) * part]
                    q, d = quantize_amx(np.ascontiguousarray(w), bits)
                    d_dir = root / "_layer_0" / f"_numa_{m}"
                    (quant,) = d_dir.glob(f"{name}_{p}_{e}_*Byte_quant_.kt")
                    (scale,) = d_dir.glob(f"{name}_{p}_{e}_*Byte_scale_.kt")
                    geom = KtAmxGeometry(w.shape[0], w.shape[1], bits)
                    assert np.fromfile(scale, np.float32).tobytes() == d.tobytes(), (method, p, m, e)
                    assert np.fromfile(quant, np.uint8).tobytes() == pack_amx(q, geom).tobytes(), (method, p, m, e)
        shutil.rmtree(root)
