"""DeepSeek-V4: ktrun converts it but does not run it yet; every entry point refuses with the reason.

What its forward needs beyond the shared pieces (ktlayouts.families.deepseek_v4 describes each):
- hyper-connections: hc_mult residual streams mixed by Sinkhorn-normalized matrices around attention and the MoE, a
  decoder-layer structure MoEModel.forward cannot express without an optional per-layer hook;
- shared-KV MQA with sinks in a sliding window plus compressed KV entries (HCA) or indexer-selected compressed
  entries (CSA), whose compressors keep per-request state (pending tokens, the previous window's overlap half);
- the grouped low-rank output projection, sqrt-softplus routing and hash routing (tid2eid by token id);
- the routed experts' clamped SwiGLU silu(min(g, L)) * clamp(u, -L, L): the kernels know silu and gpt-oss's
  (u + 1) * g * sigmoid(alpha * g) only, so a kernel activation kind is needed (kernels/src/moe_engine.h).
"""
from __future__ import annotations

from ktlayouts.families import ConfigError

REASON = ("ktrun cannot run DeepSeek-V4 (model_type deepseek_v4) yet: ktconvert converts it, but the forward "
          "(hyper-connections, compressed sparse attention, hash routing) is not implemented and the CPU expert "
          "kernels lack its clamped SwiGLU silu(min(g, L)) * clamp(u, -L, L)")


def _refuse(*_args, **_kwargs):
    raise ConfigError(REASON)


attention = route = cache_widths = _refuse
