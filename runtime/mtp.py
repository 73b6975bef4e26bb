"""Speculative drafts from the checkpoint's own multi-token-prediction (MTP) layer (`--speculative mtp`).

DeepSeek-V3's MTP module (GLM-4.5 and later ship the same): at main position i, from the main model's final hidden
state h_i (after its final norm, as vLLM and SGLang feed it) and the token t_{i+1} after it,

    u_i      = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))     (2H,) -> (H,)
    x_i      = the MTP decoder layer over u (its own KV cache: u_0 .. u_i; attention, router, shared + routed experts)
    logits_i = head(shared_head.norm(x_i))                               predicts t_{i+2}

embed: the layer's own embed_tokens (else the main one); head: shared_head.head (else the main lm_head).

Drafting k tokens after a request's newest token t_n (main positions [0, n) computed): the block first catches up on
the positions the main model ran since the last draft, from the hidden rows each forward left on the request's cache
(SeqCache.hidden, read by position up to the main cache's length, so rows of rejected drafts are never used); its
last row proposes d_1 = argmax. Each further d_j comes from (d_{j-1}, x of the step before) one position on (the
chain of DeepSeek's sequential MTP, one layer reused). Then the block's cache is rolled back to the main model's
positions: the chained entries were guesses, the verify forward gives the true hidden rows. Drafts are greedy (a
point mass), so Sampler.sample_or_accept's acceptance rule keeps the sampled distribution, and greedy output is
the plain output token for token.

Positions: the block's cache starts at the first main position it has a hidden row for (after a prefix-cache hit,
the cached prompt tokens never ran); RoPE depends only on position differences, so the offset changes nothing.

The layer runs on runtime/models (MoEModel over the one layer L in KV slot 0), its routed experts on an executor of
their own over the MTP expert files (ktrun.experts.executors.make_executor, on the main kernel pool's threads). The
Engine drafts for all its running requests together (propose_many): one varlen forward per draft position.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .experts.executors import make_executor
from .loader import ConvertedModel
from .models import step_one_call
from .models.glm_moe_dsa import CARRY as INDEXER_SELECTIONS
from .models.kv_cache import Batch, SeqCache
from .models.model import MoEModel
from .ops import float_linear, glue
from .ops.kernel_linear import KernelLinear
from .ops.packed_linear import linear
from .speculative import MAX_DRAFT_TOKENS


def mtp_executor(converted: ConvertedModel, main_executor, use_kernels: bool | None):
    """The routed-expert executor of the MTP layer(s): the same kind as the main one (kernels or the torch
    reference), over the MTP expert files, on the main executor's kernel pool when it has one."""
    pool = converted.kernels if converted.kernels is not None else getattr(main_executor, "moe", None)
    view = dataclasses.replace(converted, experts=converted.mtp.experts, kernels=pool)
    return make_executor(view, use_kernels=use_kernels)


class MtpHead:
    """The checkpoint's first MTP layer over a loaded main model; `drafter(context)` makes a request's drafter."""

    def __init__(self, model: MoEModel, converted: ConvertedModel, experts):
        weights = converted.mtp
        L = weights.layers[0]
        p = model.names.layer(L)
        w = {**model.w, **weights.dense}        # the main tensors are shared, not copied
        # GLM-5.2's index sharing: an MTP layer without an indexer of its own is a "shared" one; in the block's
        # forward no full layer ran before it, so it attends to every key (forward() hands it no selection)
        own_indexer = any(n.startswith(p + "self_attn.indexer.") for n in w)
        self.shares_index = bool(model.cfg.indexer_types) and not own_indexer
        cfg = dataclasses.replace(model.cfg, num_layers=1, moe_layers=(L,) if L in weights.experts else (),
                                  layer_types=(), indexer_types=("shared",) if self.shares_index else ())
        missing = [n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
                   if p + n not in w]
        if missing:
            raise ValueError(f"{converted.root}: MTP layer {L} lacks {p + missing[0]} (not a DeepSeek-layout MTP "
                             f"block); --speculative mtp cannot run it")
        self.block = MoEModel(cfg, w, experts, model.device, model.dtype, layers=(L,))
        self.block.kernels = model.kernels      # its router's and head's pool (glue.routers_on, float_linear.head)
        self.block.dense_on_kernels = model.dense_on_kernels
        self.block.final_norm = w[p + "shared_head.norm.weight"]
        self.head = w.get(p + "shared_head.head.weight", model.lm_head)
        self.embed = w.get(p + "embed_tokens.weight", model.w[model.names.embed])
        self.enorm, self.hnorm, self.eh_proj = (w[p + n] for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight"))
        self.norm, self.eps, self.layer = model.norm, cfg.rms_norm_eps, L
        self.block.lm_head = self.head          # the block's step plan runs this head in its call
        self.one_call = self._one_call_fields(w[p + "input_layernorm.weight"], cfg.hidden_size)
        # a drafted token's cost before one is timed, as a share of the main model's plain step: one decoder layer
        # and a head against its layers and head (the adaptive draft length's prior: ktrun.speculative VerifyCost)
        self.step_share = 2.0 / (len(model.layers) + 1)
        model.keep_hidden = True                # the main forward now leaves hidden rows for the drafters

    def _one_call_fields(self, norm0: torch.Tensor, H: int) -> tuple | None:
        """step_one_call.mtp_step's fields when the draft forward's first steps run in the block's one call as this
        class's forward_batch runs them (the same bits): the embedding table and the layer's input norm as a main
        step's call takes them (step_one_call.first_step_fields), enorm / hnorm on glue's kt_rms_norm, eh_proj a
        quantized Linear on the kernels with no input permutation or padding; else None (forward_batch's own
        steps)."""
        first, eh = step_one_call.first_step_fields(self.block, self.embed, norm0), self.eh_proj
        if (first is None or self.shares_index or self.block.kernels is None
                or not glue.norm_weights_ok(self.enorm, self.hnorm) or self.enorm.numel() != H
                or self.hnorm.numel() != H or not isinstance(eh, KernelLinear) or eh.perm is not None
                or eh.k != 2 * H or eh.k_op != eh.k or eh.n != H):
            return None
        return (*first, self.enorm, self.hnorm, eh.lin.kernels.handle, eh.id)

    def drafter(self, context: list[int]) -> MtpDrafter:
        return MtpDrafter(self, context)

    @torch.inference_mode()
    def forward(self, cache: SeqCache, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens t_{i+1} (n,) and hidden rows h_i (n, H) at the cache's next n positions -> (logits (V,) of the
        last row, the layer's output rows x (n, H) before shared_head.norm)."""
        logits, xs = self.forward_batch([(cache, tokens, hidden)])
        return logits[0], xs[0]

    @torch.inference_mode()
    def forward_batch(self, items: list[tuple[SeqCache, list[int], torch.Tensor]]
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """forward() of several requests in one varlen batch -> (logits (B, V) of each one's last row, each one's
        output rows x (n_b, H))."""
        b = self.block
        b.timing["forwards"] += 1
        hidden = torch.cat([h for _, _, h in items]) if len(items) > 1 else items[0][2]
        batch = Batch.build([(cache, ids) for cache, ids, _ in items], b.device)
        # a few rows (a draft, a catch-up after a verify): every step below in the block's one library call
        got = None if self.one_call is None else step_one_call.mtp_step(b, batch, hidden, self.one_call)
        if got is not None:
            x, logits = got
            return logits, [x[s.offset:s.offset + s.n] for s in batch.seqs]
        tokens = [t for _, ids, _ in items for t in ids]
        e = F.embedding(torch.tensor(tokens, device=b.device), self.embed).to(b.dtype)          # (T, H)
        u = torch.cat([self.norm(e, self.enorm, self.eps),
                       self.norm(hidden.to(b.dtype).contiguous(), self.hnorm, self.eps)], dim=-1)  # (T, 2H)
        if self.shares_index:
            batch.carried[INDEXER_SELECTIONS] = [None] * len(items)   # no earlier layer's selection: all keys
        x, h = b.decoder(batch, linear(u, self.eh_proj))                                        # (T, H) each
        logits = float_linear.head(h[batch.last_token_rows().to(b.device)], self.head, b.kernels)  # (B, V)
        return logits, [x[s.offset:s.offset + s.n] for s in batch.seqs]


def propose_many(requests: list[tuple[MtpDrafter, int, SeqCache]]) -> list[list[int]]:
    """Drafts of several requests ((drafter, up to k drafts, the request's main cache) each), one batched forward
    of the MTP block per draft position: the catch-up rows of every request, then the chained steps of those that
    want more. Each drafter's cache is rolled back to its main model's length after."""
    out: list[list[int]] = [[] for _ in requests]
    live, items = [], []                         # (request index, drafter, k, main length), forward_batch items
    for i, (d, k, main) in enumerate(requests):
        if k <= 0:
            continue
        n = main.length
        if d.cache is None:
            d.cache = d.head.block.new_cache(main.ctx + MAX_DRAFT_TOKENS)
        start, rows = d._new_rows(main, n)
        if rows is not None:
            live.append((i, d, k, n))
            items.append((d.cache, d.ids[start + 1:n + 1], rows))
    while items:
        logits, xs = live[0][1].head.forward_batch(items)
        for (i, _d, _k, _n), row in zip(live, logits):
            out[i].append(int(row.argmax()))
        # chained: each request's own draft and last output row, one position on
        nxt = [(r, (r[1].cache, out[r[0]][-1:], x[-1:])) for r, x in zip(live, xs) if len(out[r[0]]) < r[2]]
        live, items = [r for r, _ in nxt], [it for _, it in nxt]
    for i, (d, k, main) in enumerate(requests):
        if out[i]:
            d.cache.keep(main.length - d.base)   # drop the chained guesses
    return out


class MtpDrafter:
    """One request's MTP drafts: its context (prompt + generated, as NgramDrafter keeps it) and the MTP block's KV
    cache over the main positions [base, base + cache.length)."""

    def __init__(self, head: MtpHead, context: list[int]):
        self.head = head
        self.ids = [int(t) for t in context]
        self.cache: SeqCache | None = None
        self.base = 0                            # the main position of the block cache's position 0

    def extend(self, ids: list[int]) -> None:
        self.ids.extend(int(t) for t in ids)

    def propose(self, k: int, main: SeqCache) -> list[int]:
        """Up to k greedy drafts after the newest token (main: the request's cache, positions [0, n) computed and
        their hidden rows left on it); [] when there is nothing to start from."""
        return propose_many([(self, k, main)])[0]

    @staticmethod
    def propose_many(requests: list[tuple[MtpDrafter, int, SeqCache]]) -> list[list[int]]:
        """propose() of several requests in batched forwards (the Engine's step: ktrun.sequence.draft_all)."""
        return propose_many(requests)

    def _new_rows(self, main: SeqCache, n: int) -> tuple[int, torch.Tensor | None]:
        """(first position, hidden rows (n - first, H)) of the main positions the block has not run, newest
        forward first where they overlap; the rows are consumed. A gap (the prompt's cached prefix) restarts the
        block's cache after it."""
        done = self.base + self.cache.length
        hi, pieces = n, []
        for start, h in reversed(main.hidden):
            end = start + h.shape[0]
            if hi <= done or not start < hi <= end:
                break
            lo = max(start, done)
            pieces.append(h[lo - start:hi - start])
            hi = lo
        main.hidden.clear()
        if hi >= n:
            return n, None
        if hi > done:                            # positions [done, hi) never ran here: start over at hi
            self.cache.release()
            self.base = hi
        return hi, torch.cat(pieces[::-1]) if len(pieces) > 1 else pieces[0]
