"""The expert activation profile (`ktconvert profile ... -o profile.json`): how often a workload's tokens are routed to
each (MoE layer, routed expert), measured by running the model on a text.

    {"format": "ktconvert-expert-profile", "version": 1,
     "model": {"model_type": "deepseek_v3", "n_experts": 256, "top_k": 8, "moe_layers": [3, 4, ...], "path": ...},
     "text": {"source": "prompts.txt", "sha256": ..., "chunk_tokens": 256, "heldout_every": 5, "chunks": 80},
     "splits": {"fit":     {"tokens": T, "counts": {"3": [E ints], ...}, "mass": {"3": [E floats], ...}},
                "heldout": {"tokens": T, "counts": {...}, "mass": {...}}}}

counts[L][e]: routed (token, slot) pairs of layer L that chose expert e (sum over e = tokens * top_k); mass[L][e]:
the sum of their routing weights. The text is cut into chunks of `chunk_tokens`; every `heldout_every`-th chunk is
the held-out split, never used to rank experts when a placement is judged on it (small profiles overstate skew).

Summaries (`ktconvert inspect --profile`, `ktrun bench --profile`): per layer the entropy of the fit counts
(normalized by log2 E: 1 = uniform routing) and the share of calls the top n experts cover, on the fit split and on
the held-out split with the fit split's ranking (the honest number).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROFILE_FORMAT = "ktconvert-expert-profile"
PROFILE_VERSION = 1
SPLITS = ("fit", "heldout")
SUMMARY_SHARES = (0.05, 0.10, 0.25, 0.50)   # top-n columns of the summary, as shares of the experts per layer


class ProfileError(ValueError):
    """A profile.json that does not follow this format, or does not fit the model it is used with."""


@dataclass
class SplitCounts:
    tokens: int = 0
    counts: dict[int, np.ndarray] = field(default_factory=dict)   # MoE layer -> (E,) int64
    mass: dict[int, np.ndarray] = field(default_factory=dict)     # MoE layer -> (E,) float64


@dataclass
class ExpertProfile:
    model_type: str
    n_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    splits: dict[str, SplitCounts]
    text: dict = field(default_factory=dict)
    model_path: str = ""

    @classmethod
    def empty(cls, model_type: str, n_experts: int, top_k: int, moe_layers, **kw) -> ExpertProfile:
        layers = tuple(int(x) for x in moe_layers)
        splits = {s: SplitCounts(0, {L: np.zeros(n_experts, np.int64) for L in layers},
                                 {L: np.zeros(n_experts, np.float64) for L in layers}) for s in SPLITS}
        return cls(model_type, n_experts, top_k, layers, splits, **kw)

    def counts(self, split: str = "all") -> dict[int, np.ndarray]:
        """layer -> (E,) counts of one split, or of both ("all")."""
        if split == "all":
            return {L: sum(self.splits[s].counts[L] for s in SPLITS) for L in self.moe_layers}
        return self.splits[split].counts

    def tokens(self, split: str = "all") -> int:
        return sum(self.splits[s].tokens for s in SPLITS) if split == "all" else self.splits[split].tokens

    def check_model(self, model_type: str, n_experts: int, moe_layers, what: str = "profile") -> None:
        """ProfileError unless this profile was measured on a model of this shape."""
        if n_experts != self.n_experts:
            raise ProfileError(f"{what}: measured with {self.n_experts} routed experts per layer, the model has "
                               f"{n_experts}")
        if tuple(moe_layers) != self.moe_layers:
            raise ProfileError(f"{what}: MoE layers {list(self.moe_layers)} differ from the model's {list(moe_layers)}")
        if model_type != self.model_type:
            raise ProfileError(f"{what}: measured on a {self.model_type} model, this one is {model_type}")

    # --- JSON ---------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
                "model": {"model_type": self.model_type, "n_experts": self.n_experts, "top_k": self.top_k,
                          "moe_layers": list(self.moe_layers), "path": self.model_path},
                "text": self.text,
                "splits": {s: {"tokens": int(sp.tokens),
                               "counts": {str(L): [int(v) for v in sp.counts[L]] for L in self.moe_layers},
                               "mass": {str(L): [round(float(v), 6) for v in sp.mass[L]] for L in self.moe_layers}}
                           for s, sp in self.splits.items()}}

    @classmethod
    def from_json(cls, d: dict, what: str = "profile") -> ExpertProfile:
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{what}: not an expert profile (\"format\" must be {PROFILE_FORMAT!r})")
        if not isinstance(d.get("version"), int) or d["version"] > PROFILE_VERSION:
            raise ProfileError(f"{what}: profile version {d.get('version')!r} is newer than this reader "
                               f"({PROFILE_VERSION}); upgrade ktconvert")
        try:
            m = d["model"]
            E, layers = int(m["n_experts"]), tuple(int(x) for x in m["moe_layers"])
            prof = cls(str(m["model_type"]), E, int(m["top_k"]), layers, {}, dict(d.get("text") or {}),
                       str(m.get("path", "")))
            for s in SPLITS:
                sp = d["splits"][s]
                counts, mass = {}, {}
                for L in layers:
                    c = np.asarray(sp["counts"][str(L)], dtype=np.float64)
                    w = np.asarray(sp["mass"][str(L)], dtype=np.float64)
                    if c.shape != (E,) or w.shape != (E,):
                        raise ProfileError(f"{what}: splits.{s} layer {L}: {c.size} counts and {w.size} masses, "
                                           f"expected {E} each")
                    if (c < 0).any() or (c != np.round(c)).any() or not np.isfinite(w).all() or (w < 0).any():
                        raise ProfileError(f"{what}: splits.{s} layer {L}: counts must be whole numbers >= 0 and "
                                           f"masses finite and >= 0")
                    counts[L], mass[L] = c.astype(np.int64), w
                prof.splits[s] = SplitCounts(int(sp["tokens"]), counts, mass)
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{what}: malformed profile ({type(e).__name__}: {e})") from None
        if prof.n_experts < 1 or prof.top_k < 1 or not layers:
            raise ProfileError(f"{what}: n_experts, top_k and moe_layers must be non-empty")
        return prof

    def save(self, path: str | Path) -> None:
        """Written to a temporary name, then renamed (never half-written)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> ExpertProfile:
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except OSError as e:
            raise ProfileError(f"{p}: cannot read ({e.strerror})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProfileError(f"{p}: not valid JSON ({e})") from None
        return cls.from_json(d, what=str(p))


# --- summaries ------------------------------------------------------------------------------------------------

def top_n(share: float, n_experts: int) -> int:
    """Experts per layer for a share of the layer's experts (at least 1)."""
    return max(1, min(n_experts, round(share * n_experts)))


def coverage(counts: np.ndarray, n: int, rank_by: np.ndarray | None = None) -> float:
    """Share of the calls in `counts` that the top n experts cover, ranked by `rank_by` (default: counts itself);
    ties are broken by the lower expert id."""
    total = counts.sum()
    if total <= 0 or n <= 0:
        return 0.0
    order = ranking(counts if rank_by is None else rank_by)
    return float(counts[order[:n]].sum() / total)


def ranking(counts: np.ndarray) -> np.ndarray:
    """Expert ids, most called first (ties: lower id first)."""
    return np.lexsort((np.arange(len(counts)), -np.asarray(counts, dtype=np.float64)))


def normalized_entropy(counts: np.ndarray) -> float:
    """Entropy of the routing distribution over the experts / log2(E): 1.0 = uniform, 0 = a single expert."""
    total = counts.sum()
    if total <= 0 or len(counts) < 2:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum() / math.log2(len(counts)))


def summary_lines(prof: ExpertProfile) -> list[str]:
    """The printed summary: tokens, then per MoE layer entropy and top-n coverage (fit / held-out with fit's
    ranking)."""
    E, fit, held = prof.n_experts, prof.counts("fit"), prof.counts("heldout")
    ns = [top_n(s, E) for s in SUMMARY_SHARES]
    src = prof.text.get("source", "?")
    lines = [(f"profile: {prof.tokens()} tokens of {src} (fit {prof.tokens('fit')}, held-out {prof.tokens('heldout')}), "
             f"{len(prof.moe_layers)} MoE layers x {E} experts, top-{prof.top_k}"),
             ("share of routed calls covered by the top n experts of each layer (fit split / held-out split ranked "
             "by the fit split); entropy of the fit counts / log2 E (1 = uniform):"),
             f"  {'layer':>5}  {'entropy':>7}  " + "  ".join(f"{f'top {n} ({round(100 * n / E)}%)':>17}" for n in ns)]
    rows = [(L, normalized_entropy(fit[L]), [(coverage(fit[L], n), coverage(held[L], n, fit[L])) for n in ns])
            for L in prof.moe_layers]
    for L, ent, cov in rows:
        lines.append(f"  {L:>5}  {ent:>7.3f}  " + "  ".join(f"{a:>8.3f} / {b:<6.3f}" for a, b in cov))
    mean = [(np.mean([c[i][0] for _, _, c in rows]), np.mean([c[i][1] for _, _, c in rows])) for i in range(len(ns))]
    lines.append(f"  {'mean':>5}  {np.mean([r[1] for r in rows]):>7.3f}  "
                 + "  ".join(f"{a:>8.3f} / {b:<6.3f}" for a, b in mean))
    lines.append("  uniform routing would give top n / E: " + ", ".join(f"{n / E:.3f}" for n in ns))
    return lines
