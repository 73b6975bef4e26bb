"""The one-call decode paths' shared check (tests/test_kernels_{gqa,mla,moe}_decode.py): a model's logits with a
one-call function and with it switched off, over a prompt, decode steps of one request and of two batched (their KV
blocks interleaved in the pool) and a speculative verify's 3 rows."""
from __future__ import annotations

import torch
from ktrun.models.kv_cache import Batch


def decode_logits(model, ids: list[int]) -> list[torch.Tensor]:
    ca, cb = model.new_cache(256), model.new_cache(256)
    out = [model.forward(Batch.build([(ca, ids)], "cpu")), model.forward(Batch.build([(cb, ids[:5])], "cpu"))]
    for t in (7, 9, 11):
        out.append(model.forward(Batch.build([(ca, [t])], "cpu")))
        out.append(model.forward(Batch.build([(ca, [t + 1]), (cb, [t])], "cpu")))
    out.append(model.forward(Batch.build([(cb, [3, 4, 5])], "cpu"), all_logits=True))
    return out


def with_and_without(model, ids: list[int], monkeypatch, module, name: str) -> tuple[list, list, list[bool]]:
    """-> (logits with module.name, logits with it returning None, whether each call of it took the rows)."""
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
