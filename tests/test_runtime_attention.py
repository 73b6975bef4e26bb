"""Attention's two MLA forms (absorbed latent, expanded keys/values) and the grouped GQA path against transformers:
each form forced on its own, prefill in chunks reading the cache, decode steps, and batches that mix forms."""
from __future__ import annotations

import pytest
import torch
from ktrun.engine import Engine
from ktrun.models import attention
from ktrun.models.kv_cache import Batch
from runtime_helpers import PROMPT, build_checkpoint, converted, reference_logits, shared_root, transformers_model

LOGIT_ATOL = 1e-4      # float32 on both sides from identical bf16 weights (tests/test_runtime_models.py)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            src = build_checkpoint(shared_root(tmp_path_factory), arch)
            eng = Engine(converted(tmp_path_factory, arch, "bf16"), ctx=256, max_batch=4, use_kernels=False)
            cache[arch] = (eng, transformers_model(src))
        return cache[arch]

    return get


def _chunked_logits(eng: Engine, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """Logits of every position, prefilled in chunks [0, cuts[0]), [cuts[0], cuts[1]), ...; a chunk of one token is
    a decode step."""
    cache, out, start = eng.model.new_cache(256), [], 0
    for end in [*cuts, len(ids)]:
        out.append(eng.model.forward(Batch.build([(cache, ids[start:end])], "cpu"), all_logits=True))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("form", ["absorbed", "expanded", "expanded-blocks", "auto"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_mla_forms_match_transformers(engines, monkeypatch, arch, form):
    eng, ref = engines(arch)
    if form != "auto":
        monkeypatch.setattr(attention, "_naive_is_cheaper", lambda *a: form.startswith("expanded"))
    if form == "expanded-blocks":     # a prompt's query rows in blocks of 4 (_attend_causal_blocks), the last one short
        monkeypatch.setattr(attention, "PROMPT_BLOCK_ROWS", 4)
    ids = eng.tokenizer.encode(PROMPT + " " + PROMPT)
    want = reference_logits(ref, ids)
    # a long first chunk, a short one reading it, then single-token decode steps
    got = _chunked_logits(eng, ids, [9, 12, 13, 14, 15])
    diff = (got - want).abs().max().item()
    assert diff < LOGIT_ATOL, f"{arch} {form}: max |logit diff| {diff:.3g}"


def test_mla_batch_mixing_forms_equals_each_alone(engines, monkeypatch):
    """One batch holding a prefill (expanded form) and a decode step (absorbed form) gives each request the logits it
    gets alone."""
    eng, _ref = engines("deepseek_v3")
    monkeypatch.setattr(attention, "_naive_is_cheaper", lambda n, *a: n > 1)
    a_ids, b_ids = eng.tokenizer.encode(PROMPT), eng.tokenizer.encode("lazy dogs jump over")
    alone_a = _chunked_logits(eng, a_ids + [7], [len(a_ids)])[-1]
    alone_b = _chunked_logits(eng, b_ids, [])[-1]
    ca, cb = eng.model.new_cache(256), eng.model.new_cache(256)
    eng.model.forward(Batch.build([(ca, a_ids)], "cpu"))
    both = eng.model.forward(Batch.build([(ca, [7]), (cb, b_ids)], "cpu"))
    assert (both[0] - alone_a).abs().max() < 1e-5 and (both[1] - alone_b).abs().max() < 1e-5


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_gqa_chunked_prefill_and_decode_match_transformers(engines, arch):
    eng, ref = engines(arch)
    ids = eng.tokenizer.encode(PROMPT + " " + PROMPT)
    want = reference_logits(ref, ids)
    # [9, ...]: the first chunk through torch's fused attention with is_causal; [5, 17, ...]: the second chunk (12
    # rows after 5 cached) through it with the explicit causal mask
    for cuts in ([9, 12, 13, 14, 15], [5, 17, 18]):
        got = _chunked_logits(eng, ids, cuts)
        assert (got - want).abs().max() < LOGIT_ATOL, cuts


class _Seq:
    def __init__(self, n, start):
        self.n, self.start = n, start


def test_gqa_prompt_is_causal_has_the_masked_forms_bits():
    """A whole prompt takes is_causal (key blocks above the diagonal skipped) with the same bits as the explicit
    mask; rows after a cached prefix keep the mask."""
    g = torch.Generator().manual_seed(0)
    n, nh, nkv, hd = 300, 8, 2, 64
    q = torch.randn(n, nh, hd, generator=g)
    runs = [(torch.randn(n, nkv, hd, generator=g), torch.randn(n, nkv, hd, generator=g))]
    got = attention._sdpa_rows(q, runs, _Seq(n, 0), None, 0.125)
    mask = attention.causal_scores_mask(n, 0, n, "cpu")
    k, v = (t.transpose(0, 1)[None] for t in runs[0])
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask[None, None],
                                                            scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("n", "start"), [(300, 0), (300, 37), (128, 5), (129, 0)])
def test_mla_prompt_blocks_equal_one_score_tensor(n, start):
    """_attend_causal_blocks (query rows in blocks over the keys up to each block's end) against the (nh, n, S) form,
    under the causal mask and under a sparser causal one (an indexer's selection)."""
    g = torch.Generator().manual_seed(n + start)
    nh, d, dv, S = 4, 24, 16, start + n
    q, kt, v = torch.randn(nh, n, d, generator=g), torch.randn(nh, d, S, generator=g), torch.randn(nh, S, dv, generator=g)
    causal = attention.causal_scores_mask(n, start, S, "cpu")
    sparse = causal & (torch.rand(n, S, generator=g) < 0.5)
    sparse[torch.arange(n), start + torch.arange(n)] = True        # every row keeps its own key
    for mask in (causal, sparse):
        want = torch.matmul(torch.softmax(torch.matmul(q, kt).masked_fill(~mask[None], float("-inf")), dim=-1), v)
        got = attention._attend_causal_blocks(q, kt, v, mask, start)
        assert (got - want).abs().max() < 1e-5
        if n <= attention.PROMPT_BLOCK_ROWS:          # one block: the one-tensor form itself
            assert torch.equal(got, want)


def test_mla_step_ops_do_not_grow_with_context(engines):
    """A decode step runs the same number of torch ops whatever the context length: nothing loops over positions
    or copies the cache per step (the cache grows by doubling, outside the steps timed here)."""
    eng, _ref = engines("deepseek_v3")
    cache = eng.model.new_cache(256)
    eng.model.forward(Batch.build([(cache, list(range(3, 200)))], "cpu"))
    eng.model.forward(Batch.build([(cache, [4])], "cpu"))                   # grows the cache to its 256 limit

    def ops_of_one_step() -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            eng.model.forward(Batch.build([(cache, [5])], "cpu"))
        return len(prof.events())

    short = ops_of_one_step()
    for _ in range(40):
        eng.model.forward(Batch.build([(cache, [6])], "cpu"))
    assert ops_of_one_step() == short
