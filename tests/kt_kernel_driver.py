"""Run kt-kernel's own MoE wrapper on an export, in a process of its own: `python kt_kernel_driver.py SPEC.json`.

SPEC: {"weight_path", "method", "layers": [L, ...], "n_experts", "top_k", "hidden", "intermediate",
       "threadpool_count", "threads", "inputs": "in.npz" (x_L (T, H) float32, ids_L (T, k) int64, w_L (T, k) float32),
       "out": "out.npz" (y_L (T, H) float32)}

It drives kt-kernel the way SGLang does (KTMoEWrapper -> load_weights -> forward), with two changes a CPU-only
machine needs: KT_FORCE_SYNC_SUBMIT=1 (the wrapper's CUDA-stream submit path is otherwise taken and, without a CUDA
stream, the forward silently returns zeros), and pinned-memory allocation stubbed to plain CPU memory (torch without
an accelerator refuses pin_memory=True). Everything else -- the loaders, the C++ MoE objects, the thread pools, the
bf16 staging buffers -- is kt-kernel's. A process per run: kt-kernel keeps its CPUInfer and loaders as singletons.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["KT_FORCE_SYNC_SUBMIT"] = "1"

import numpy as np
import torch


class _UnpinnedTorch:
    """torch, except that zeros/empty/full ignore pin_memory (no pinned allocator without an accelerator)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*a, pin_memory=False, **k):
        return torch.zeros(*a, **k)

    @staticmethod
    def empty(*a, pin_memory=False, **k):
        return torch.empty(*a, **k)

    @staticmethod
    def full(*a, pin_memory=False, **k):
        return torch.full(*a, **k)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import kt_kernel
    from kt_kernel import experts_base
    experts_base.torch = _UnpinnedTorch()           # the only stub: pinned buffers become plain CPU tensors
    from kt_kernel import KTMoEWrapper

    inputs = np.load(spec["inputs"])
    outputs = {}
    for layer in spec["layers"]:
        x = torch.from_numpy(inputs[f"x_{layer}"])
        wrapper = KTMoEWrapper(
            layer_idx=layer, num_experts=spec["n_experts"], num_experts_per_tok=spec["top_k"],
            hidden_size=spec["hidden"], moe_intermediate_size=spec["intermediate"], gpu_experts_mask=None,
            cpuinfer_threads=spec["threads"], threadpool_count=spec["threadpool_count"],
            weight_path=spec["weight_path"], chunked_prefill_size=-(-max(64, x.shape[0]) // 64) * 64, method=spec["method"])
        wrapper.load_weights(torch.arange(spec["n_experts"], dtype=torch.int64))
        y = wrapper.forward(x.to(torch.bfloat16), torch.from_numpy(inputs[f"ids_{layer}"]),
                            torch.from_numpy(inputs[f"w_{layer}"]), cuda_stream=0)
        outputs[f"y_{layer}"] = y.float().numpy().copy()
    outputs["cpu_variant"] = np.array(kt_kernel.__cpu_variant__)
    np.savez(spec["out"], **outputs)


if __name__ == "__main__":
    main(sys.argv[1])
