"""Quantized conversions against the bf16 reference conversion: KL of next-token distributions stays bounded.
DeepSeek-V3 FP8 release checkpoint: convert without a GPU and generate text from it."""
from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest
import torch
from ktrun.engine import Engine
from ktrun.models.kv_cache import Batch
from ktrun.ops.library import kernels_available
from runtime_helpers import KTRUN, PROMPT, converted, kl

from ktconvert.testing import ARCHS  # every registered family (tests/test_families.py)

TEXT = PROMPT + " and then some more words to average over"
CTX = 256
# KL(bf16 || quantized) in nats over every prompt position. Observed with the reference executor: int8 mean <= 4e-5,
# max <= 2e-3; int4 (group 128) mean <= 4e-3, max <= 3e-2. With the kernels (int8 activations too) DeepSeek-V3
# int8 flips one routing choice at one position (KL 2.7e-2 there, mean 5e-4): random MoE weights route on noise.
KL_BOUNDS = {"int8-amx": (2e-3, 5e-2), "int4-amx": (1e-2, 1e-1)}


# DeepSeek-V3.2's lightning indexer keeps a discrete top-k of keys per query (index_topk 8 < the 57 prompt tokens
# here): a quantization-sized change of the hidden states swaps near-tied keys at the top-k boundary of some
# queries, and a swapped key changes that position's attention outright (random fixture weights tie often).
# Observed with the reference executor, selection on: int8 KL mean 3.8e-3 max 0.11, int4 mean 1.1e-2 max 0.13 (a
# handful of positions); selection off (every key kept): int4 mean 6e-3, every position <= 6e-2 but one at 0.12 (a
# routing flip, as above). So V3.2 is held to the common mean bound and, but for at most one position, the common
# max bound with the selection off (the quantization error itself), and to these bounds with it on.
SPARSE_KL_BOUNDS = {"int8-amx": (1e-2, 2e-1), "int4-amx": (3e-2, 3e-1)}
# the families whose attention keeps an indexer's top-k of keys (GLM-5's as V3.2's; DeepSeek-V4's CSA layers keep a
# top-k of compressed keys; observed, int4: every key kept mean 3.8e-3 max 2.0e-2, selection on mean 1.0e-2 max 0.11)
SPARSE_ARCHS = ("deepseek_v32", "glm_moe_dsa", "deepseek_v4")


def prompt_logits(conv, use_kernels=None, all_keys: bool = False) -> torch.Tensor:
    eng = Engine(conv, ctx=CTX, use_kernels=use_kernels)
    if all_keys:               # the indexer keeping every key (a context holds at most CTX keys; V4 pads to k)
        eng.model.cfg = dataclasses.replace(eng.model.cfg, index_topk=CTX)
    ids = eng.tokenizer.encode(TEXT)
    out = eng.model.forward(Batch.build([(eng.model.new_cache(CTX), ids)], "cpu"), all_logits=True)
    eng.close()
    return out


BACKENDS = ["reference", pytest.param("kernels", marks=pytest.mark.skipif(
    not kernels_available(), reason="libktkernels / runtime/ops/moe.py not available on this machine"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["int8-amx", "int4-amx"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_experts_kl_bounded(tmp_path_factory, arch, method, backend):
    """Reference = bf16 experts through the torch reference; the kernels add int8 activation quantization."""
    sparse = arch in SPARSE_ARCHS
    for all_keys in (True, False) if sparse else (False,):
        ref = prompt_logits(converted(tmp_path_factory, arch, "bf16"), use_kernels=False, all_keys=all_keys)
        got = prompt_logits(converted(tmp_path_factory, arch, method), use_kernels=backend == "kernels",
                            all_keys=all_keys)
        d = kl(ref, got)
        print(f"{arch} {method} {backend} all_keys={all_keys}: KL mean {d.mean():.2e} max {d.max():.2e}"
              f" second {d.sort().values[-2]:.2e}")
        mean_bound, max_bound = (SPARSE_KL_BOUNDS if sparse and not all_keys else KL_BOUNDS)[method]
        worst = d.sort().values[-2] if sparse and all_keys else d.max()      # V3.2 dense: one routing flip allowed
        assert d.mean() < mean_bound and worst < max_bound, \
            f"{arch} {method} {backend} (all keys: {all_keys}): KL mean {d.mean():.2e} max {d.max():.2e}"


def test_fp8_source_to_generated_text(tmp_path_factory):
    """FP8 block-quantized DeepSeek-V3 -> ktconvert (CPU dequant, int4 experts) -> ktrun generate, as subprocess."""
    conv = converted(tmp_path_factory, "deepseek_v3", "int4-amx", fp8=True)
    r = subprocess.run([*KTRUN, "generate", str(conv), "--prompt", PROMPT,
                        "--max-tokens", "12", "--ignore-eos", "--json"], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 12 and out["text"] and out["finish_reason"] == "length"
    # the FP8 weights are the bf16 fixture's weights block-quantized: distributions stay close to the bf16 run
    d = kl(prompt_logits(converted(tmp_path_factory, "deepseek_v3", "bf16"), use_kernels=False),
           prompt_logits(conv, use_kernels=False))
    assert d.mean() < 2e-2 and d.max() < 1e-1, f"FP8+int4 vs bf16: KL mean {d.mean():.2e} max {d.max():.2e}"
