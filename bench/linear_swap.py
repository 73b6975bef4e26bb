"""The ablation benches' shared case (bf16_restore_ablation.py, int8_op_ablation.py): `ktrun perplexity`'s score of
a conversion with some of its GPU Linears on the kernels swapped for something else."""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from ktrun.engine import Engine
from ktrun.ops.kernel_linear import KernelLinear
from ktrun.perplexity import score, text_chunks


def score_swapped(conv: Path, text: str, reference, ctx: int, chunks: int, take: str | None,
                  swap: Callable[[str, KernelLinear], object]) -> dict:
    """Load conv with its quantized GPU Linears on the kernels, replace each whose hub weight name matches the regex
    take by swap(name, linear) (take None: none), and score the text's chunks against reference -> the score's
    summary plus the number of Linears swapped. MLA's absorbed kv_b is derived again from a swapped kv_b, and a
    fused shared expert whose Linears are swapped leaves the routed job."""
    eng = Engine(conv, ctx=ctx, max_batch=1, gpu_weights="kernels")
    try:
        m = eng.model
        names = [n for n, w in m.w.items() if isinstance(w, KernelLinear) and take is not None and re.search(take, n)]
        for n in names:
            m.w[n] = swap(n, m.w[n])
            m.w.pop(n.removesuffix("weight") + "absorbed", None)
        m.shared_fused -= {i for i in list(m.shared_fused)
                           if any(n.startswith(m.names.layer(i) + m.names.shared_prefix) for n in names)}
        rows = text_chunks(eng.tokenizer, text, ctx, chunks)
        return score(m, rows, reference=reference).summary() | {"linears": len(names)}
    finally:
        eng.close()
