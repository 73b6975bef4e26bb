"""The calibration forward on libktkernels' int4 tiles (ktconvert.gpu.calib_kernels, KTCONVERT_CALIB_MATMUL=kernels).

References: the layouts' own unpacking of the tiles (ktlayouts.cpu_linear.unpack_linear, numpy) times x in float64
for the product; the float32 transformers forward of the same layer (calib's torch path) for the expert inputs; the
tiles' bits at 1 and 2 threads for determinism; a whole calibrated conversion twice for its bytes.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from ktrun.ops.library import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="libktkernels not built")


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05, torch.randn(37, k, generator=g)


@pytest.mark.parametrize("n,k", [(96, 256), (40, 192), (64, 96)])       # groups 128, 64, 32
def test_tile_product_is_x_times_the_unpacked_tiles(n, k):
    from ktlayouts.cpu_linear import unpack_linear

    from ktconvert.gpu.calib_kernels import TileMatmuls, tile_group

    w, x = _weights(n, k)
    tiles = TileMatmuls(n_threads=2)
    tiles.register(5, w)
    geom, qweight, scales = tiles.lin._linears[5]
    assert geom.group_size == tile_group(k) and geom.bits == 4
    wq = unpack_linear(qweight, scales, geom)[:n, :k].astype(np.float64)       # the layouts' reading of the tiles
    ref = x.double().numpy() @ wq.T
    got = tiles.run([5], x)[0].double().numpy()
    # the kernel quantizes x to int8 per row: ~1/254 of a row's peak per value
    assert np.abs(got - ref).max() < 0.02 * np.abs(ref).max(), np.abs(got - ref).max()
    # and the tiles are int4 codes of w (16 levels per group: ~10% relative error for normal weights)
    w64 = w.double().numpy()
    assert np.linalg.norm(wq - w64) < 0.15 * np.linalg.norm(w64), np.linalg.norm(wq - w64) / np.linalg.norm(w64)
    tiles.close()


def test_tile_products_have_the_same_bits_at_one_and_two_threads():
    from ktconvert.gpu.calib_kernels import TileMatmuls

    w, x = _weights(200, 512, seed=3)
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(4))
    outs = []
    for threads in (1, 2):
        tiles = TileMatmuls(n_threads=threads)
        tiles.register(0, w)
        outs.append(tiles.run([0], x)[0])
        tiles.close()
    assert torch.equal(outs[0], outs[1])


def test_small_linears_and_odd_inputs_stay_in_torch():
    from torch import nn

    from ktconvert.gpu.calib_kernels import MIN_WEIGHTS, TileMatmuls

    tiles = TileMatmuls(n_threads=1)
    small = nn.Linear(128, 64)
    assert not tiles.on_linear(small) and "forward" not in small.__dict__
    odd = nn.Linear(MIN_WEIGHTS // 100 + 1, 100, bias=False)       # K not a multiple of 32
    assert not tiles.on_linear(odd)
    big = nn.Linear(1024, 1024)
    assert tiles.on_linear(big) and "forward" in big.__dict__
    x = torch.randn(3, 5, 1024)
    with torch.no_grad():
        y = big(x)
        ref = torch.nn.functional.linear(x, big.weight, big.bias)
    assert y.shape == (3, 5, 1024)
    assert float((y - ref).norm() / ref.norm()) < 0.15                      # int4 weights, int8 rows
    tiles.close()


@pytest.fixture(scope="module")
def ds3(tmp_path_factory):
    from ktconvert.testing import make_checkpoint

    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("k"))


def _inputs(src_dir, matmul: str, layer: int):
    from ktconvert.gpu.calib import make_calibrator
    from ktconvert.sources import open_source

    with open_source(src_dir) as src:
        cal = make_calibrator(src, None, 1024, 256, 0, lambda *a: None, lambda hub: False, capture_experts=True,
                              matmul=matmul)
        x, ids = cal.expert_inputs(layer)
        acts = cal.expert_activations(layer)
        cal.prior = cal.expert_prior_rows(layer)
        cal.read_expert = lambda e: {p: src.read(src.arch.expert_tensor_name(layer, e, p)) for p in ("gate", "up")}
        cal.weights = {e: cal.read_expert(e) for e in range(src.arch.n_experts)}
        return x, ids, acts, cal


@pytest.fixture
def every_linear(monkeypatch):
    """The tiny checkpoints' Linears are below MIN_WEIGHTS: put them on the tiles too."""
    import ktconvert.gpu.calib_kernels as ck

    monkeypatch.setattr(ck, "MIN_WEIGHTS", 0)


def test_kernel_forward_gives_the_float_forwards_expert_inputs_within_int4_noise(ds3, every_linear):
    layer = 1
    xf, idf, af, _ = _inputs(ds3, "float32", layer)
    xk, idk, ak, cal = _inputs(ds3, "kernels", layer)
    assert cal.tiles is not None and cal.tiles.stats["quantized"] > 0
    assert xk.shape == xf.shape and idk.shape == idf.shape
    rel = float((xk - xf).norm() / xf.norm())
    assert rel < 0.2, rel               # the hidden states after two layers of int4 weights (measured 0.103)
    same = float((idk.sort(1).values == idf.sort(1).values).all(1).float().mean())
    assert same > 0.5, same                                       # most tokens keep their experts
    # the down inputs the expert quantizer reads: every expert with routed tokens, one row per routed token
    for e, a in ak.items():
        assert a.shape == (int((idk == e).any(1).sum()), af[next(iter(af))].shape[1])
    # and the prior's rows (every expert hit, on prior_rows of the layer's tokens), within int4 noise of the float
    # product on the same inputs
    from ktconvert.gpu.calib import prior_rows

    xs = prior_rows(xk)
    assert set(cal.prior) == set(ak) and xs.shape[0] > 1
    for e, a_s in cal.prior.items():
        w = cal.weights[e]
        ref = torch.nn.functional.silu(xs @ w["gate"].T) * (xs @ w["up"].T)
        assert a_s.shape == ref.shape
        assert float((a_s - ref).norm() / ref.norm()) < 0.25


def test_the_layers_linears_go_on_the_tiles_but_the_router(ds3, every_linear):
    from ktconvert.gpu.calib import make_calibrator
    from ktconvert.sources import open_source

    with open_source(ds3) as src:
        cal = make_calibrator(src, None, 256, 256, 0, lambda *a: None, lambda hub: False, capture_experts=True,
                              matmul="kernels")
        layer = cal._build_layer(1)
        put = cal._put_on_tiles(layer, {})
    assert "mlp.gate" not in put and "forward" not in layer.mlp.gate.__dict__
    # every Linear whose K a tile group divides (q_b_proj's K = q_lora_rank 48 does not)
    assert set(put) == {"self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                        "self_attn.o_proj", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                        "mlp.shared_experts.down_proj"}, put


def _digest(out) -> str:
    h = hashlib.sha256()
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            h.update(p.relative_to(out).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_calibrated_conversion_on_the_tiles_is_byte_identical_run_to_run(ds3, tmp_path, monkeypatch, every_linear):
    from ktconvert.pipeline import ConvertOptions, convert

    monkeypatch.setenv("KTCONVERT_CALIB_MATMUL", "kernels")
    digests = []
    for run, workers in ((0, 1), (1, 2)):
        out = tmp_path / f"o{run}"
        convert(ds3, out, ConvertOptions(method="int4-amx", group_size=32, workers=workers), show_progress=False)
        digests.append(_digest(out))
    assert digests[0] == digests[1]
