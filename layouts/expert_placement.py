"""Hot-expert placement: which routed experts of each MoE layer live on the GPU, as written into a conversion
(`ktconvert quantize --profile P --gpu-experts N` -> gpu_experts.json, listed in manifest.json with kind
"placement") or computed by ktrun at load.

    {"format": "ktconvert-gpu-experts", "version": 1, "strategy": "per-layer", "gpu_format": "marlin",
     "budget": {"gpu_experts": 8} | {"ratio": 0.1} | {"gpu_mem": bytes, "kv_mem": bytes, "dense_bytes": bytes},
     "profile": {"sha256": ..., "tokens": T}, "experts": {"3": [0, 7, 12], ...}}

Memory plan (`--gpu-mem`): what is left of the GPU after the dense (non-expert) weights, the stated KV-cache budget
and a reserve for activations / workspaces holds hot experts of `hot_expert_nbytes` each (ktlayouts.expert_gpu).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PLACEMENT_NAME = "gpu_experts.json"
PLACEMENT_KIND = "placement"             # its manifest.json "kind"
PLACEMENT_FORMAT = "ktconvert-gpu-experts"
PLACEMENT_VERSION = 1
STRATEGIES = ("uniform", "frequency", "per-layer")
DEFAULT_STRATEGY = "frequency"          # --placement without a value
GPU_RESERVE_FRACTION = 0.05              # of --gpu-mem kept free for activations, workspaces, allocator slack


class PlacementFileError(ValueError):
    """A gpu_experts.json that does not follow this format or does not fit the conversion."""


@dataclass(frozen=True)
class ExpertPlacement:
    experts: dict[int, tuple[int, ...]]          # MoE layer -> experts on the GPU (ascending)
    strategy: str = "given"
    gpu_format: str = "auto"
    budget: dict = field(default_factory=dict)
    profile: dict = field(default_factory=dict)

    @property
    def cells(self) -> int:
        return sum(len(v) for v in self.experts.values())

    def share(self, n_experts: int) -> float:
        """Share of all routed experts on the GPU."""
        return self.cells / max(1, n_experts * len(self.experts))

    def check(self, n_experts: int, moe_layers, what: str = PLACEMENT_NAME) -> None:
        extra = sorted(set(self.experts) - set(moe_layers))
        if extra:
            raise PlacementFileError(f"{what}: layer {extra[0]} is not a MoE layer of the model ({list(moe_layers)})")
        for L, es in self.experts.items():
            bad = [e for e in es if not 0 <= e < n_experts]
            if bad or len(set(es)) != len(es):
                raise PlacementFileError(f"{what}: layer {L} lists experts {list(es)}: ids must be distinct and in "
                                         f"[0, {n_experts})")

    def to_json(self) -> dict:
        return {"format": PLACEMENT_FORMAT, "version": PLACEMENT_VERSION, "strategy": self.strategy,
                "gpu_format": self.gpu_format, "budget": self.budget, "profile": self.profile,
                "experts": {str(L): sorted(int(e) for e in es) for L, es in sorted(self.experts.items())}}

    @classmethod
    def from_json(cls, d: dict, what: str = PLACEMENT_NAME) -> ExpertPlacement:
        if not isinstance(d, dict) or d.get("format") != PLACEMENT_FORMAT:
            raise PlacementFileError(f"{what}: not a placement (\"format\" must be {PLACEMENT_FORMAT!r})")
        if not isinstance(d.get("version"), int) or d["version"] > PLACEMENT_VERSION:
            raise PlacementFileError(f"{what}: placement version {d.get('version')!r} is newer than this reader "
                                     f"({PLACEMENT_VERSION})")
        try:
            experts = {int(L): tuple(sorted(int(e) for e in es)) for L, es in d["experts"].items()}
            return cls(experts, str(d.get("strategy", "given")), str(d.get("gpu_format", "auto")),
                       dict(d.get("budget") or {}), dict(d.get("profile") or {}))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlacementFileError(f"{what}: malformed placement ({type(e).__name__}: {e})") from None

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def load(cls, path: str | Path) -> ExpertPlacement:
        p = Path(path)
        try:
            return cls.from_json(json.loads(p.read_text()), what=str(p))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PlacementFileError(f"{p}: cannot read a placement ({e})") from None


def fit_hot_experts(gpu_mem: int, dense_bytes: int, kv_bytes: int, per_expert_bytes: int,
                    reserve_fraction: float = GPU_RESERVE_FRACTION, state_bytes: int = 0) -> tuple[int, dict]:
    """(number of hot experts that fit, the plan as a dict of byte counts) for a GPU of gpu_mem bytes; state_bytes:
    the recurrent state of linear-attention layers (a fixed size per request), beside the KV cache."""
    reserve = int(gpu_mem * reserve_fraction)
    left = gpu_mem - dense_bytes - kv_bytes - state_bytes - reserve
    n = max(0, left // per_expert_bytes) if per_expert_bytes > 0 else 0
    plan = {"gpu_mem": int(gpu_mem), "dense_bytes": int(dense_bytes), "kv_mem": int(kv_bytes)}
    if state_bytes:
        plan["state_mem"] = int(state_bytes)
    return int(n), {**plan, "reserve": reserve, "left_for_experts": int(max(0, left)),
                    "per_expert_bytes": int(per_expert_bytes)}


def dense_gpu_bytes(manifest: dict) -> int:
    """Bytes of the non-expert (GPU) tensors of a conversion as stored (dense/ and globals files)."""
    return sum(f["size"] for f in manifest["files"].values() if f["kind"] in ("dense", "globals"))
