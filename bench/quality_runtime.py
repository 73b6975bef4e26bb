"""bench_quality's second path: the real product. Convert the default model with `ktconvert` (pipeline.convert) and
score the held-out windows with `ktrun`'s model (load_model; CPU kernels when the library loads, which adds int8
activation quantization), against the same BF16 transformers reference log-probs."""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

# (expert method, expert group size, GPU-layer method); GPU methods run only when the converter registers them.
RUNTIME_CONFIGS = [("int8-amx", 128, "bf16"), ("int8-amx", -1, "bf16"), ("int4-amx", 128, "bf16"),
                   ("int4-amx", -1, "bf16"), ("int4-amx", 128, "gptq-int4")]


@torch.no_grad()
def runtime_scores(conv_dir: Path, windows: torch.Tensor, ref_logp: list, batch: int, gpu_weights: str = "auto"
                   ) -> tuple[float, float, str]:
    """-> (perplexity, mean KL(ref || ktrun), expert backend name) over the windows (n, SEQ_LEN+1).
    gpu_weights: ktrun's --gpu-weights (auto on the CPU: the quantized GPU layers on the kernels' Linear op)."""
    from ktrun.loaded_model import load_model
    from ktrun.models.kv_cache import Batch

    with load_model(conv_dir, gpu_weights=gpu_weights) as lm:
        nll, kl, count = 0.0, 0.0, 0
        for j, i in enumerate(range(0, len(windows), batch)):
            for r, row in enumerate(windows[i:i + batch]):
                ids = row[:-1].tolist()
                logits = lm.model.forward(Batch.build([(lm.model.new_cache(len(ids) + 8), ids)], "cpu"),
                                          all_logits=True)  # (T, V)
                logp = torch.log_softmax(logits.float(), dim=-1)
                nll -= float(logp.gather(-1, row[1:, None]).sum())
                ref = ref_logp[j][r]
                kl += float((ref.exp() * (ref - logp)).sum())
                count += len(ids)
        return math.exp(nll / count), kl / count, type(lm.model.experts).__name__


def runtime_rows(model_dir: Path, windows: torch.Tensor, ref_logp: list, batch: int) -> list[tuple]:
    """Rows (experts, gpu, ppl, kl, backend) through ktconvert + ktrun."""
    from ktconvert.pipeline import ConvertOptions, convert

    rows = []
    with tempfile.TemporaryDirectory(prefix="kt_quality_") as tmp:
        for method, group, gpu in RUNTIME_CONFIGS:
            out = Path(tmp) / f"{method}_g{group}_{gpu}"
            convert(model_dir, out, ConvertOptions(method=method, group_size=group, gpu_method=gpu),
                    show_progress=False)
            experts = f"{method.split('-')[0]}-{'per-row' if group == -1 else f'g{group}'}"
            # quantized GPU layers: the CPU default (the kernels' Linear op) and the dequantized-at-load path
            for gw in ("auto",) if gpu == "bf16" else ("auto", "dequant"):
                ppl, kl, backend = runtime_scores(out, windows, ref_logp, batch, gw)
                dense = "" if gpu == "bf16" else ", GPU layers dequantized" if gw == "dequant" else \
                    ", GPU layers on the Linear op"
                rows.append((experts, gpu, ppl, kl, backend + dense))
    return rows
