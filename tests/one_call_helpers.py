"""The one-call decode paths' shared check (tests/test_kernels_{gqa,mla,moe}_decode.py): a model's logits with a
one-call function and with it switched off, over a prompt, decode steps of one request and of two batched (their KV
blocks interleaved in the pool) and a speculative verify's 3 rows."""
from __future__ import annotations

import ctypes
import dataclasses
import os

import torch
from isa_copies import outputs_per_isa
from ktrun.models import step_one_call
from ktrun.models.kv_cache import Batch
from ktrun.ops.library import load_library
from ktrun.ops.moe import MoEKernels
from run_shared import built_once, run_dir
from runtime_helpers import INIT_SCALE

from ktconvert.pipeline import ConvertOptions, convert
from ktconvert.testing import make_checkpoint


def decode_logits(model, ids: list[int]) -> list[torch.Tensor]:
    ca, cb = model.new_cache(256), model.new_cache(256)
    out = [model.forward(Batch.build([(ca, ids)], "cpu")), model.forward(Batch.build([(cb, ids[:5])], "cpu"))]
    for t in (7, 9, 11):
        out.append(model.forward(Batch.build([(ca, [t])], "cpu")))
        out.append(model.forward(Batch.build([(ca, [t + 1]), (cb, [t])], "cpu")))
    out.append(model.forward(Batch.build([(cb, [3, 4, 5])], "cpu"), all_logits=True))
    return out


def absorbed_conversion(tmp_path_factory, arch: str) -> str:
    """arch's fixture with a latent rank of 64 (the fixtures' 32 is below one 64-input tile: their kv_b stays off the
    absorbed op), converted with int4 experts and RTN int4 Linears; built once per run. DeepSeek-V3's q_lora_rank 48
    makes q_b's inputs padded to 64."""
    root = run_dir(tmp_path_factory)
    src = built_once(root / f"src_{arch}_rank64", lambda out: make_checkpoint(arch, out, init_scale=INIT_SCALE,
                                                                              kv_lora_rank=64))
    return str(built_once(root / f"conv_{arch}_rank64", lambda out: convert(
        src, out, ConvertOptions(method="int4-amx", gpu_method="rtn-int4"), show_progress=False)))


def with_and_without(model, ids: list[int], monkeypatch, module, name: str) -> tuple[list, list, list[bool]]:
    """-> (logits with module.name, logits with it returning None, whether each call of it took the rows). The decode
    step's one call over every layer (ktrun.models.step_one_call, which calls the per-layer ones' C functions itself)
    is switched off in both, unless it is module.name."""
    if module is not step_one_call:
        monkeypatch.setattr(step_one_call, "run", lambda *a, **k: None)
    fast, taken = getattr(module, name), []

    def spy(*args, **kw):
        out = fast(*args, **kw)
        taken.append(out is not None)
        return out
    monkeypatch.setattr(module, name, spy)
    one_call = decode_logits(model, ids)
    monkeypatch.setattr(module, name, lambda *a, **k: None)
    separate = decode_logits(model, ids)
    monkeypatch.setattr(module, name, fast)
    return one_call, separate, taken



def assert_rope_form_and_window_reach(model, ids: list[int], monkeypatch, module, name: str, relearn=None) -> None:
    """A GQA model with its rotary made interleaved and a sliding window of 3: module.name's logits equal those with it
    switched off (the separate steps follow both), and differ from plain rotary's without a window. relearn(): drops
    what the one call learned of the model's first setting."""
    plain, _, _ = with_and_without(model, ids, monkeypatch, module, name)
    monkeypatch.setattr(model.rope, "interleaved", True)
    monkeypatch.setattr(model, "cfg", dataclasses.replace(model.cfg, sliding_window=3))
    if relearn is not None:
        relearn()
    one_call, separate, taken = with_and_without(model, ids, monkeypatch, module, name)
    assert any(taken)
    for a, b in zip(one_call, separate):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(one_call, plain))

_DIGEST = """
import hashlib, importlib, sys, torch
sys.path.insert(0, {tests!r})
import pytest
from ktrun.engine import Engine
from one_call_helpers import with_and_without
from runtime_helpers import PROMPT
eng = Engine({conv!r}, ctx=256, max_batch=4)
module = importlib.import_module({module!r})
one_call, separate, taken = with_and_without(eng.model, eng.tokenizer.encode(PROMPT), pytest.MonkeyPatch(), module,
                                             {name!r})
assert any(taken) and all(torch.equal(a, b) for a, b in zip(one_call, separate))
h = hashlib.sha256()
for t in one_call:
    h.update(t.numpy().tobytes())
print(h.hexdigest())
"""


def same_bits_on_every_isa(conv, module: str, name: str) -> None:
    """The scalar twin (baseline copy), AVX2 and AVX-512 copies chosen by KT_KERNEL_BACKEND in fresh processes: on
    conversion conv each gives module.name's logits equal to its own separate path, and all give the same bits."""
    code = _DIGEST.format(tests=os.path.dirname(__file__), conv=str(conv), module=module, name=name)
    digests = outputs_per_isa(code, timeout=300)
    assert len(digests) >= 2 and len(set(digests.values())) == 1, digests


def assert_refused(fn: str, args_type, partial: dict) -> None:
    """The C entry fn(ctx, args): no context, all-zero arguments, and args_type(**partial) are refused (-1), each
    with a kt_last_error naming what is wrong."""
    lib = load_library()
    call = getattr(lib, fn)
    assert call(None, ctypes.byref(args_type())) == -1
    assert b"needs a context" in lib.kt_last_error()
    kernels = MoEKernels(n_threads=2)
    try:
        assert call(kernels.handle, ctypes.byref(args_type())) == -1          # all zero: no geometry
        assert b"bad geometry" in lib.kt_last_error()
        assert call(kernels.handle, ctypes.byref(args_type(**partial))) == -1
        assert b"missing" in lib.kt_last_error()
    finally:
        kernels.close()
