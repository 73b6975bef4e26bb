"""`GET /metrics` of `ktrun serve`, on the official Prometheus client (prometheus_client), in its own registry.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `ktrun_time_to_first_token_seconds`, the same for
e2e_request_latency_seconds, time_per_output_token_seconds, inter_token_latency_seconds, request_queue_time_seconds,
request_prefill_time_seconds, request_decode_time_seconds, request_prompt_tokens, request_generation_tokens,
prompt_tokens_total, generation_tokens_total, request_success_total{finished_reason}, num_requests_running,
num_requests_waiting); ours where vLLM has none: CPU expert time, KV-cache and recurrent-state bytes, finish reasons with aborts and
errors, engine steps, every numeric Engine.stats entry as `ktrun_engine_<key>` (the GPU hit ratio among them
when the engine reports one), and the prefix cache's `ktrun_prefix_cache_*` from Engine.prefix_cache_stats() (hit and
miss prompt tokens, hits/bytes/blocks/state snapshots by tier, budgets, evictions, corrupt disk files).
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

try:  # no `_created` series next to every counter (prometheus_client >= 0.17)
    from prometheus_client import disable_created_metrics
    disable_created_metrics()
except ImportError:  # pragma: no cover
    pass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets in seconds: TTFT on a big MoE model spans ms (short prompt, warm) to tens of seconds (long prefill).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


class _Callbacks:
    """A collector of values read at scrape time (never stale): gauges and counters kept by the engine loop or
    the engine, plus Engine.stats."""

    def __init__(self, stats: Callable[[], dict]):
        self.items: list[tuple[str, str, Callable[[], float], str]] = []
        self.stats = stats

    def collect(self):
        for name, help_text, read, kind in self.items:
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_text)
            fam.add_metric([], float(read()))
            yield fam
        yield from engine_stat_families(self.stats() or {})


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def engine_stat_families(stats: dict):
    """Numeric entries of `Engine.stats` as gauges `ktrun_engine_<key>` (units as the engine names them); an entry
    `<name>_by_layer` holding {layer: number} (e.g. gpu_hit_ratio_by_layer) as one gauge with a `layer` label."""
    for key in sorted(stats):
        v = stats[key]
        name = "ktrun_engine_" + "".join(c if c.isalnum() else "_" for c in str(key)).strip("_").lower()
        if str(key).endswith("_by_layer") and isinstance(v, dict) and all(_number(x) for x in v.values()):
            fam = GaugeMetricFamily(name, f"Engine.stats[{key!r}], per MoE layer.", labels=("layer",))
            for layer, x in sorted(v.items()):
                fam.add_metric([str(layer)], float(x))
            yield fam
        elif _number(v):
            fam = GaugeMetricFamily(name, f"Engine.stats[{key!r}].")
            fam.add_metric([], float(v))
            yield fam


def render_engine_stats(stats: dict) -> list[str]:
    """The exposition lines of engine_stat_families(stats) alone (what /metrics shows of these stats)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Callbacks(lambda: stats))
    return generate_latest(registry).decode().splitlines()


# (name, kind, help, label name or None, [(label value, Engine.prefix_cache_stats() key)]); counters get "_total"
TIERS = ("device", "ram", "disk")
PREFIX_CACHE_METRICS = (
    ("ktrun_prefix_cache_enabled", "gauge", "1 when the prefix cache is on (--no-prefix-cache: 0).", None,
     [("", "enabled")]),
    ("ktrun_prefix_cache_hit_tokens", "counter", "Prompt tokens taken from the prefix cache (not prefilled).", None,
     [("", "hit_tokens")]),
    ("ktrun_prefix_cache_miss_tokens", "counter", "Prompt tokens prefilled (not in the prefix cache).", None,
     [("", "miss_tokens")]),
    ("ktrun_prefix_cache_tier_hit_tokens", "counter",
     "Prompt tokens taken from the prefix cache, by the tier their block was found in.", "tier",
     [(t, f"hit_tokens_{t}") for t in TIERS]),
    ("ktrun_prefix_cache_bytes", "gauge",
     "Bytes of cached KV blocks and state snapshots by tier (device: keyed blocks in the KV pool, in use or not).",
     "tier", [(t, f"{t}_bytes") for t in TIERS]),
    ("ktrun_prefix_cache_blocks", "gauge", "Cached KV blocks, by tier.", "tier", [(t, f"{t}_blocks") for t in TIERS]),
    ("ktrun_prefix_cache_states", "gauge",
     "Cached recurrent-state snapshots (linear-attention models), by tier.", "tier",
     [(t, f"{t}_states") for t in TIERS]),
    ("ktrun_prefix_cache_tier_hit_states", "counter",
     "Recurrent-state snapshots a request resumed from, by the tier they were found in.", "tier",
     [(t, f"hit_states_{t}") for t in TIERS]),
    ("ktrun_prefix_cache_budget_bytes", "gauge", "Byte budget of the RAM and disk tiers.", "tier",
     [(t, f"{t}_budget_bytes") for t in ("ram", "disk")]),
    ("ktrun_prefix_cache_evicted_blocks", "counter", "Blocks moved down from a tier (device->RAM, RAM->disk).", "tier",
     [("device", "evicted_blocks_device"), ("ram", "evicted_blocks_ram")]),
    ("ktrun_prefix_cache_evicted_states", "counter", "State snapshots moved down from a tier (device->RAM, RAM->disk).",
     "tier", [("device", "evicted_states_device"), ("ram", "evicted_states_ram")]),
    ("ktrun_prefix_cache_corrupt_blocks", "counter",
     "Disk files (blocks, state snapshots) that failed their checks (deleted, recomputed).",
     None, [("", "disk_corrupt_blocks")]),
)


class _PrefixCache:
    """A collector of Engine.prefix_cache_stats() (plain numbers), read at scrape time; absent keys are left out."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        stats = self.stats() or {}
        for name, kind, help_text, label, samples in PREFIX_CACHE_METRICS:
            present = [(v, stats[key]) for v, key in samples if _number(stats.get(key))]
            if not present:
                continue
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = cls(name, help_text, labels=(label,) if label else None)
            for v, x in present:
                fam.add_metric([v] if label else [], float(x))
            yield fam


class ServeMetrics:
    """Everything `GET /metrics` reports. Values kept elsewhere are read through callbacks (add_gauge)."""

    def __init__(self, engine_stats: Callable[[], dict] = dict, prefix_cache_stats: Callable[[], dict] = dict):
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests = Counter("ktrun_requests", "HTTP requests answered, by endpoint and status code.",
                                ("endpoint", "status"), registry=r)
        self.prompt_tokens = Counter("ktrun_prompt_tokens", "Prompt tokens of generation requests.", registry=r)
        self.generated_tokens = Counter("ktrun_generation_tokens", "Tokens generated and sent to clients.",
                                        registry=r)
        self.finished = Counter("ktrun_request_finished", "Generation requests finished, by reason (stop, length, "
                                "abort = client went away, error).", ("reason",), registry=r)
        self.success = Counter("ktrun_request_success", "Requests finished normally, by finish reason (as vLLM's).",
                               ("finished_reason",), registry=r)
        self.ttft = Histogram("ktrun_time_to_first_token_seconds", "Request arrival to first generated token.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("ktrun_time_per_output_token_seconds",
                              "Mean time between output tokens of a request (after the first).",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("ktrun_inter_token_latency_seconds", "Time between two output tokens of a request.",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("ktrun_e2e_request_latency_seconds", "Request arrival to last token.",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.queue = Histogram("ktrun_request_queue_time_seconds", "Waiting for an engine slot.",
                               buckets=LATENCY_BUCKETS_S, registry=r)
        self.prefill = Histogram("ktrun_request_prefill_time_seconds", "Engine slot to first token (prefill).",
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.decode = Histogram("ktrun_request_decode_time_seconds", "First token to last token.",
                                buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_len = Histogram("ktrun_request_prompt_tokens", "Prompt tokens per request.",
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.gen_len = Histogram("ktrun_request_generation_tokens", "Generated tokens per request.",
                                 buckets=TOKEN_BUCKETS, registry=r)
        self._callbacks = _Callbacks(engine_stats)
        r.register(self._callbacks)
        r.register(_PrefixCache(prefix_cache_stats))

    def add_gauge(self, name: str, help_text: str, read: Callable[[], float], kind: str = "gauge") -> None:
        """A value read at scrape time; kind="counter" for running totals kept elsewhere (name without _total)."""
        self._callbacks.items.append((name, help_text, read, kind))

    def render(self) -> bytes:
        return generate_latest(self.registry)
