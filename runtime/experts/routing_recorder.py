"""RoutingRecorder: an expert executor wrapper that counts, per (MoE layer, routed expert), the routed calls and their
routing weight mass into an ExpertProfile split (ktlayouts.expert_profile), then passes the call on unchanged.
`ktconvert profile` runs a model with one around its executor."""
from __future__ import annotations

import numpy as np
from ktlayouts.expert_profile import ExpertProfile


class RoutingRecorder:
    def __init__(self, inner, profile: ExpertProfile):
        self.inner, self.profile = inner, profile
        self.split = "fit"                                   # where the next calls are counted

    def submit(self, layer, x, ids, weights, out, **kw):
        ids_np = ids.cpu().numpy().reshape(-1)
        w_np = weights.detach().float().cpu().numpy().reshape(-1)
        keep = ids_np >= 0
        sp = self.profile.splits[self.split]
        E = self.profile.n_experts
        sp.counts[layer] += np.bincount(ids_np[keep], minlength=E).astype(np.int64)
        sp.mass[layer] += np.bincount(ids_np[keep], weights=w_np[keep], minlength=E)
        self.inner.submit(layer, x, ids, weights, out, **kw)

    def sync(self) -> None:
        self.inner.sync()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close:
            close()

    @property
    def stats(self) -> dict:
        return getattr(self.inner, "stats", {})
