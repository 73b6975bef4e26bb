"""Decode-sized torch glue on the calling thread (ktrun.models.layers.serial_torch) changes no bit: the MLA absorbed
form and the router give the same logits with and without it, and the fused float32 RMSNorm equals the formula."""
from __future__ import annotations

import pytest
import torch
from ktrun.engine import Engine
from ktrun.models import attention, layers
from ktrun.models import model as model_mod
from ktrun.models.kv_cache import Batch
from runtime_helpers import PROMPT, converted


def test_serial_torch_scopes_and_restores_the_thread_count():
    n = torch.get_num_threads()
    with layers.serial_torch():
        assert torch.get_num_threads() == 1
    with layers.serial_torch(False):
        assert torch.get_num_threads() == n
    with pytest.raises(RuntimeError), layers.serial_torch():
        raise RuntimeError("inside")
    assert torch.get_num_threads() == n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_transformers_formula(dtype):
    g = torch.Generator().manual_seed(3)
    for shape in [(1, 512), (3, 1536), (64, 7168)]:
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        w = torch.randn(shape[-1], generator=g).to(dtype)
        h = x.float()
        want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        assert torch.equal(layers.rms_norm(x, w, 1e-6), want), (dtype, shape)


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
def test_decode_logits_are_the_same_with_and_without_serial_glue(tmp_path_factory, monkeypatch, arch):
    """Prefill, then decode steps of one request and of two batched: logits bit-identical whether the absorbed
    form's glue, GQA's torch attention (gpt-oss: sinks keep it off kt_gqa_attend_batch) and the router run serially
    (the default at <= SERIAL_MAX_ROWS rows) or on torch's 2 threads."""
    eng = Engine(converted(tmp_path_factory, arch, "bf16"), ctx=256, max_batch=4, use_kernels=False)
    ids = eng.tokenizer.encode(PROMPT)
    n = torch.get_num_threads()
    torch.set_num_threads(2)

    def run() -> list[torch.Tensor]:
        ca, cb = eng.model.new_cache(256), eng.model.new_cache(256)
        out = [eng.model.forward(Batch.build([(ca, ids)], "cpu"))]
        out.append(eng.model.forward(Batch.build([(cb, ids[:5])], "cpu")))
        for t in (7, 9, 11):
            out.append(eng.model.forward(Batch.build([(ca, [t])], "cpu")))
            out.append(eng.model.forward(Batch.build([(ca, [t + 1]), (cb, [t])], "cpu")))
        return out

    try:
        serial = run()
        for mod in (attention, model_mod):
            monkeypatch.setattr(mod, "SERIAL_MAX_ROWS", 0)
        threaded = run()
    finally:
        torch.set_num_threads(n)
    for i, (a, b) in enumerate(zip(serial, threaded)):
        assert torch.equal(a, b), f"forward {i}: max |diff| {(a - b).abs().max().item():.3g}"


def test_a_small_forward_on_the_kernels_is_serial_and_keeps_its_bits(default_converted, monkeypatch):
    """The default model (dense Linears on the kernels' op, so torch computes glue only): a prompt's forward of at
    most SERIAL_MAX_ELEMENTS activations keeps torch on the calling thread, with the logits of the same forward on
    torch's 2 threads."""
    eng = Engine(str(default_converted), ctx=512, max_batch=4)
    assert eng.model.dense_on_kernels
    ids = (eng.tokenizer.encode(PROMPT) * 8)[:150]
    assert len(ids) * eng.model.cfg.hidden_size <= layers.SERIAL_MAX_ELEMENTS
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    real = layers.serial_torch

    def spy(on=True):
        seen.append(on)
        return real(on)

    def run() -> list[torch.Tensor]:
        c = eng.model.new_cache(512)
        return [eng.model.forward(Batch.build([(c, ids)], "cpu")),
                eng.model.forward(Batch.build([(c, ids[:3])], "cpu"))]

    try:
        monkeypatch.setattr(model_mod, "serial_torch", spy)
        serial = run()
        assert seen[0] is True                 # decoder's scope, the forward's first
        seen.clear()
        monkeypatch.setattr(model_mod, "SERIAL_MAX_ELEMENTS", 0)
        threaded = run()
        assert seen[0] is False
    finally:
        torch.set_num_threads(n)
    for a, b in zip(serial, threaded):
        assert torch.equal(a, b)
