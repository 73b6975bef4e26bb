"""Perplexity and KL divergence of a converted model with llama-perplexity's protocol (tools/perplexity in llama.cpp),
so numbers from `ktrun perplexity` and `llama-perplexity` on the same text are comparable:

- the text is tokenized once, as one stream, with BOS in front when the tokenizer adds one;
- it is cut into n = min(--chunks, len // ctx) chunks of ctx consecutive tokens (at least 2 * ctx tokens needed);
  the first token of every chunk is replaced by BOS (when the tokenizer adds one) and each chunk runs alone from an
  empty cache;
- positions first = ctx // 2 .. ctx - 2 of each chunk are scored (ctx - 1 - first per chunk: 127 at ctx 256), each
  predicting the token after it; ppl = exp(mean negative log-likelihood);
- against reference distributions (ktlayouts.logprobs, written by `--kl-divergence-base` from e.g. the BF16
  conversion) each scored position gives KL(ref || model) = sum_v p_ref (log p_ref - log p_model) (float64 sums of
  float32 log-probs), and top-1 agreement (same argmax); kl_p99 is the 99th percentile with linear interpolation,
  as llama-perplexity prints it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from ktlayouts.logprobs import Logprobs, LogprobsError, LogprobsShape, LogprobsWriter, first_scored

from .models.kv_cache import Batch


class PerplexityError(ValueError):
    """Text, context or reference file that the protocol cannot use; the message names the flag or file."""


def text_chunks(tokenizer, text: str, ctx: int, n_chunks: int | None) -> np.ndarray:
    """-> (n, ctx) int64 chunk tokens with BOS in front of each chunk (llama-perplexity's protocol)."""
    if ctx < 4:
        raise PerplexityError(f"--ctx {ctx}: need at least 4 tokens per chunk")
    ids = tokenizer.encode(text)
    if len(ids) < 2 * ctx:
        raise PerplexityError(f"--text tokenizes to {len(ids)} tokens; --ctx {ctx} needs at least {2 * ctx}")
    n = len(ids) // ctx if n_chunks is None or n_chunks < 0 else min(n_chunks, len(ids) // ctx)
    if n < 1:
        raise PerplexityError(f"--chunks {n_chunks}: nothing to score")
    chunks = np.asarray(ids[: n * ctx], dtype=np.int64).reshape(n, ctx).copy()
    bos = tokenizer.bos_token_id
    if bos is not None and ids and ids[0] == bos:     # the tokenizer adds BOS: every chunk starts with it
        chunks[:, 0] = bos
    return chunks


@dataclass
class PerplexityResult:
    n_chunks: int
    ctx: int
    nll: np.ndarray                            # (n * n_scored,) float64 nats
    kl: np.ndarray | None = None               # (n * n_scored,) float64 nats, against the reference
    same_top: np.ndarray | None = None         # (n * n_scored,) bool
    nll_ref: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll.mean()))

    def summary(self) -> dict[str, float]:
        out = {"ppl": self.ppl}
        if self.kl is not None:
            out.update(ppl_base=float(np.exp(self.nll_ref.mean())), kl_mean=float(self.kl.mean()),
                       kl_median=float(np.median(self.kl)), kl_p99=float(np.percentile(self.kl, 99)),
                       kl_max=float(self.kl.max()), top1_agreement=float(self.same_top.mean()))
        return out


@torch.inference_mode()
def chunk_logits(model, rows: np.ndarray) -> torch.Tensor:
    """rows (B, ctx) token ids, each run from an empty cache in one varlen forward -> (B, ctx, V) float32 logits."""
    b, ctx = rows.shape
    caches = [model.new_cache(ctx) for _ in range(b)]
    logits = model.forward(Batch.build([(c, r.tolist()) for c, r in zip(caches, rows)], model.device),
                           all_logits=True)
    return logits.float().reshape(b, ctx, -1).cpu()


def score(model, chunks: np.ndarray, reference: Logprobs | None = None, save: LogprobsWriter | None = None,
          batch: int = 4, progress=None) -> PerplexityResult:
    """Run the chunks through `model` (a ktrun MoEModel) and score them; optionally against `reference` and/or
    saving this model's distributions to `save`."""
    n, ctx = chunks.shape
    first = first_scored(ctx)
    if reference is not None:
        ref_shape = reference.shape
        if (ref_shape.ctx, ref_shape.n_chunks) != (ctx, n):
            raise PerplexityError(f"{reference.path}: reference has {ref_shape.n_chunks} chunks of "
                                  f"{ref_shape.ctx} tokens, this run {n} of {ctx} (use the same --ctx/--chunks)")
        bad = np.argwhere(np.asarray(reference.tokens) != chunks)
        if len(bad):
            c, p = bad[0]
            raise PerplexityError(f"{reference.path}: token {int(reference.tokens[c, p])} at chunk {c} position {p} "
                                  f"differs from this run's {int(chunks[c, p])}: not the same text or tokenizer")
    nll, kl, top, nll_ref = [], [], [], []
    for i0 in range(0, n, batch):
        rows = chunks[i0:i0 + batch]
        logits = chunk_logits(model, rows)                             # (B, ctx, V)
        vocab = logits.shape[-1]
        if reference is not None and reference.shape.vocab != vocab:
            raise PerplexityError(f"{reference.path}: vocabulary {reference.shape.vocab}, this model {vocab}")
        for j in range(rows.shape[0]):
            lp = torch.log_softmax(logits[j, first:ctx - 1].double(), dim=-1)            # (S, V)
            target = torch.from_numpy(rows[j, first + 1:]).long()
            nll.append(-lp.gather(1, target[:, None])[:, 0].numpy())
            if reference is not None:
                lr = torch.from_numpy(np.array(reference.log_probs[i0 + j])).double()    # (S, V), a copy
                kl.append((lr.exp() * (lr - lp)).sum(-1).numpy())
                top.append((lr.argmax(-1) == lp.argmax(-1)).numpy())
                nll_ref.append(-lr.gather(1, target[:, None])[:, 0].numpy())
            if save is not None:
                save.add(rows[j].astype(np.int32), lp.float().numpy())
        if progress is not None:
            progress.update(rows.shape[0])
    res = PerplexityResult(n, ctx, np.concatenate(nll))
    if reference is not None:
        res.kl, res.same_top, res.nll_ref = np.concatenate(kl), np.concatenate(top), np.concatenate(nll_ref)
    return res


def writer_for(path, chunks: np.ndarray, vocab: int, source: str) -> LogprobsWriter:
    n, ctx = chunks.shape
    try:
        return LogprobsWriter(path, LogprobsShape(n, ctx, vocab), source=source)
    except OSError as e:
        raise PerplexityError(f"--kl-divergence-base {path}: cannot write ({e})") from None


__all__ = ["LogprobsError", "PerplexityError", "PerplexityResult", "chunk_logits", "score", "text_chunks",
           "writer_for"]
