"""What an engine holds beside the weights: the KV cache of the full-attention layers (bytes per token, so
--ctx x --max-batch tokens at most) and, for families with linear attention (Qwen3-Next, Qwen3.5-MoE), the
recurrent state of those layers (a fixed size per request, whatever its length: per DeltaNet layer the conv window
and a v_heads x dk x dv float32 state). With the prefix cache on, a recurrent request also keeps the state at the
last block end it crossed (kept when it ends, for the next chat turn), and the cache keeps up to --max-batch
snapshots on the device.

    plan = CachePlan.of(cfg, dtype, ctx=4096, max_batch=16, prefix_states=True)
    plan.check(device)             # CacheBudgetError when it cannot fit the device's free memory

Qwen3-Next-80B-A3B in bf16: KV 24 KiB per token (12 full-attention layers x k, v of 2 x 256); recurrent state
73.7 MiB per request (36 DeltaNet layers x (32 x 128 x 128 float32 + a 3 x 8192 bf16 conv window)) = the KV of
~3100 tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .byte_sizes import human
from .models import arch_module, cache_layers


class CacheBudgetError(ValueError):
    """A --ctx / --max-batch configuration whose caches cannot fit the device's memory."""


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes in every layer that has one (the family's cache widths)."""
    arch = arch_module(cfg.model_type)
    return cache_layers(arch, cfg) * sum(math.prod(w) for w in arch.cache_widths(cfg)) * torch.finfo(dtype).bits // 8


def state_layout(cfg, dtype: torch.dtype):
    """The family's per-request recurrent state (ktrun.models.kv_cache.StateLayout), or None."""
    fn = getattr(arch_module(cfg.model_type), "recurrent_state", None)
    return fn(cfg, dtype) if fn is not None else None


def state_bytes_per_request(cfg, dtype: torch.dtype) -> int:
    """Bytes of one request's recurrent state in every linear-attention layer (0 for other families)."""
    layout = state_layout(cfg, dtype)
    return layout.nbytes() if layout is not None else 0


def cache_lines(cfg, dtype: torch.dtype, ctx: int) -> list[str]:
    """`name: value unit` lines for `ktrun bench`: KV bytes per token and at ctx, recurrent state per request."""
    arch = arch_module(cfg.model_type)
    per_tok, n = kv_bytes_per_token(cfg, dtype), cache_layers(arch, cfg)
    out = [f"kv_cache_per_token: {per_tok} bytes ({n} layer{'s' * (n != 1)} with KV)",
           f"kv_cache_at_ctx_{ctx}: {per_tok * ctx} bytes"]
    layout = state_layout(cfg, dtype)
    if layout is not None:
        out.append(f"recurrent_state_per_request: {layout.nbytes()} bytes ({len(layout.layers)} linear-attention "
                   f"layers)")
        out.append(f"recurrent_state_in_kv_tokens: {layout.nbytes() / max(per_tok, 1):.0f} tokens")
    return out


def states_per_engine(max_batch: int, prefix_states: bool) -> int:
    """Recurrent states an engine may hold at once: one per request, plus with the prefix cache each request's last
    block end and up to max_batch cached snapshots on the device."""
    return max_batch * (3 if prefix_states else 1)


def available_bytes(device) -> int | None:
    """Free memory of the device the caches live on: CUDA's free memory, else the host's MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class CachePlan:
    ctx: int
    max_batch: int
    kv_per_token: int
    state_per_request: int
    states: int                     # recurrent states held at most (states_per_engine)

    @staticmethod
    def of(cfg, dtype: torch.dtype, ctx: int, max_batch: int, prefix_states: bool) -> CachePlan:
        sb = state_bytes_per_request(cfg, dtype)
        return CachePlan(int(ctx), int(max_batch), kv_bytes_per_token(cfg, dtype), sb,
                         states_per_engine(max_batch, prefix_states) if sb else 0)

    @property
    def kv_bytes(self) -> int:
        return self.ctx * self.max_batch * self.kv_per_token

    @property
    def state_bytes(self) -> int:
        return self.states * self.state_per_request

    @property
    def total(self) -> int:
        return self.kv_bytes + self.state_bytes

    def describe(self) -> str:
        out = (f"KV cache {human(self.kv_bytes)} (--ctx {self.ctx} x --max-batch {self.max_batch} tokens x "
               f"{human(self.kv_per_token)})")
        if self.state_per_request:
            out += (f" + recurrent state {human(self.state_bytes)} ({self.states} states x "
                    f"{human(self.state_per_request)}: one per request"
                    f"{', its last block end and the prefix cache' if self.states > self.max_batch else ''})")
        return out

    def check(self, device) -> None:
        free = available_bytes(device)
        if free is not None and self.total > free:
            raise CacheBudgetError(
                f"{self.describe()} = {human(self.total)} cannot fit the {human(free)} free on {torch.device(device)}: "
                f"lower --max-batch or --ctx" + (" (or turn the prefix cache off: --no-prefix-cache)"
                                                  if self.states > self.max_batch else ""))
