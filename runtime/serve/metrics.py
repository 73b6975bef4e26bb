"""Prometheus text exposition (format 0.0.4) for `ktrun serve`: counters, gauges and histograms, thread-safe.

No client library: the format is a few lines per metric, and the server's needs are small.
"""
from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable

# Latency buckets in seconds: TTFT on a big MoE model spans ms (short prompt, warm) to tens of seconds (long prefill).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


def _fmt(v: float) -> str:
    v = float(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = name, help_text, tuple(labelnames)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help_text, labelnames=()):
        super().__init__(name, help_text, labelnames)
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_fmt(v)}" for k, v in items]


class Gauge(_Metric):
    """A value read from a callback at scrape time (never stale). kind="counter" for running totals kept
    elsewhere (engine steps, seconds)."""

    def __init__(self, name, help_text, read: Callable[[], float], kind: str = "gauge"):
        super().__init__(name, help_text)
        self.read, self.kind = read, kind

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_fmt(float(self.read()))}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_text, buckets=LATENCY_BUCKETS_S):
        super().__init__(name, help_text)
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # last = +Inf
        self._sum = 0.0
        self._n = 0

    def observe(self, v: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, v)] += 1
            self._sum += v
            self._n += 1

    @property
    def count(self) -> int:
        return self._n

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._n
        lines, cum = self.header(), 0
        for le, c in zip(self.buckets + (math.inf,), counts):
            cum += c
            lines.append(f'{self.name}_bucket{{le="{_fmt(le)}"}} {cum}')
        return lines + [f"{self.name}_sum {_fmt(total)}", f"{self.name}_count {n}"]


class ServeMetrics:
    """Everything `GET /metrics` reports. Gauges that depend on the engine thread/engine read them through callbacks."""

    def __init__(self):
        self.requests = Counter("ktrun_requests_total", "HTTP requests answered, by endpoint and status code.",
                                ("endpoint", "status"))
        self.prompt_tokens = Counter("ktrun_prompt_tokens_total", "Prompt tokens of generation requests.")
        self.generated_tokens = Counter("ktrun_generation_tokens_total", "Tokens generated and sent to clients.")
        self.finished = Counter("ktrun_request_finished_total", "Generation requests finished, by reason "
                                "(stop, length, abort = client went away, error).", ("reason",))
        self.ttft = Histogram("ktrun_time_to_first_token_seconds", "Request arrival to first generated token.")
        self.tpot = Histogram("ktrun_time_per_output_token_seconds",
                              "Mean time between output tokens of a request (after the first).")
        self.e2e = Histogram("ktrun_e2e_request_latency_seconds", "Request arrival to last token.")
        self.gen_len = Histogram("ktrun_request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self._gauges: list[Gauge] = []

    def add_gauge(self, name: str, help_text: str, read: Callable[[], float], kind: str = "gauge") -> None:
        self._gauges.append(Gauge(name, help_text, read, kind))

    def render(self, engine_stats: dict | None = None, prefix_cache_stats: dict | None = None) -> str:
        lines: list[str] = []
        for m in (self.requests, self.prompt_tokens, self.generated_tokens, self.finished,
                  self.ttft, self.tpot, self.e2e, self.gen_len, *self._gauges):
            lines += m.render()
        lines += render_engine_stats(engine_stats or {})
        lines += render_prefix_cache_stats(prefix_cache_stats or {})
        return "\n".join(lines) + "\n"


def render_engine_stats(stats: dict) -> list[str]:
    """Numeric entries of `Engine.stats` as gauges `ktrun_engine_<key>` (units as the engine names them)."""
    lines = []
    for key in sorted(stats):
        v = stats[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        name = "ktrun_engine_" + "".join(c if c.isalnum() else "_" for c in str(key)).strip("_").lower()
        lines += [f"# HELP {name} Engine.stats[{key!r}].", f"# TYPE {name} gauge", f"{name} {_fmt(v)}"]
    return lines


# (name, kind, help, [(labels, Engine.prefix_cache_stats() key)])
_TIERS = ("device", "ram", "disk")
PREFIX_CACHE_METRICS = (
    ("ktrun_prefix_cache_enabled", "gauge", "1 when the prefix cache is on (--no-prefix-cache: 0).",
     [("", "enabled")]),
    ("ktrun_prefix_cache_hit_tokens_total", "counter", "Prompt tokens taken from the prefix cache (not prefilled).",
     [("", "hit_tokens")]),
    ("ktrun_prefix_cache_miss_tokens_total", "counter", "Prompt tokens prefilled (not in the prefix cache).",
     [("", "miss_tokens")]),
    ("ktrun_prefix_cache_tier_hit_tokens_total", "counter",
     "Prompt tokens taken from the prefix cache, by the tier their block was found in.",
     [(f'tier="{t}"', f"hit_tokens_{t}") for t in _TIERS]),
    ("ktrun_prefix_cache_bytes", "gauge",
     "Bytes of cached KV blocks by tier (device: keyed blocks in the KV pool, in use or not).",
     [(f'tier="{t}"', f"{t}_bytes") for t in _TIERS]),
    ("ktrun_prefix_cache_blocks", "gauge", "Cached KV blocks, by tier.",
     [(f'tier="{t}"', f"{t}_blocks") for t in _TIERS]),
    ("ktrun_prefix_cache_budget_bytes", "gauge", "Byte budget of the RAM and disk tiers.",
     [(f'tier="{t}"', f"{t}_budget_bytes") for t in ("ram", "disk")]),
    ("ktrun_prefix_cache_evicted_blocks_total", "counter", "Blocks moved down from a tier (device->RAM, RAM->disk).",
     [('tier="device"', "evicted_blocks_device"), ('tier="ram"', "evicted_blocks_ram")]),
    ("ktrun_prefix_cache_corrupt_blocks_total", "counter", "Disk blocks that failed their checks (deleted, recomputed).",
     [("", "disk_corrupt_blocks")]),
)


def render_prefix_cache_stats(stats: dict) -> list[str]:
    """Engine.prefix_cache_stats() (plain numbers) as Prometheus lines; absent keys are left out."""
    lines = []
    for name, kind, help_text, samples in PREFIX_CACHE_METRICS:
        present = [(lab, stats[key]) for lab, key in samples if isinstance(stats.get(key), (int, float))]
        if present:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{lab}}} {_fmt(v)}" if lab else f"{name} {_fmt(v)}" for lab, v in present]
    return lines
