"""`ktrun serve` with the prefix cache, as a real subprocess on loopback, driven by the `openai` client: a repeated
prompt reports `usage.prompt_tokens_details.cached_tokens` (streaming and not) and gives the text of an Engine without
the cache; concurrent requests sharing a prefix each get their solo text; /metrics has the hit/miss counters and
bytes per tier; after a shutdown (SIGTERM) a new server on the same --prefix-cache-dir starts warm from disk; and
--no-prefix-cache prefills everything. On DeepSeek-V3 (MLA) and Qwen3-Next (linear attention: the hits resume from
recurrent-state snapshots, reported per tier, written to disk at shutdown too)."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from runtime_helpers import converted
from serve_helpers import ServerProcess, metric

BIN = Path(__import__("sys").executable).parent
CTX = 256
BLOCK = 16                      # the server's KV block size (ktrun.models.kv_cache.KV_BLOCK_SIZE)


@pytest.fixture(scope="module", params=("deepseek_v3", "qwen3_next"))
def model_dir(request, tmp_path_factory) -> Path:
    return converted(tmp_path_factory, request.param, "bf16")


@pytest.fixture(scope="module")
def solo(model_dir):
    """token ids -> greedy text of an Engine without the prefix cache, one request at a time."""
    from ktrun.engine import Engine, SamplingParams

    engine = Engine(model_dir, ctx=CTX, max_batch=1, prefix_cache=False)

    def run(ids: list[int], max_tokens: int) -> str:
        engine.add_request("solo", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        toks = []
        while engine.has_work():
            toks += [tok for _, tok, _ in engine.step()]
        return engine.tokenizer.decode(toks)

    yield run
    engine.close()


def start(model_dir: Path, *args: str) -> ServerProcess:
    return ServerProcess([str(BIN / "ktrun"), "serve", str(model_dir), "--port", "0", "--ctx", str(CTX), *args],
                         timeout=180)


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client, model: str, ids: list[int], n: int = 8, stream: bool = False):
    """-> (text, cached prompt tokens)."""
    kw = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        return "".join(c.choices[0].text for c in chunks if c.choices), \
            chunks[-1].usage.prompt_tokens_details.cached_tokens
    r = client.completions.create(**kw)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def test_prefix_cache_served_restarted_and_disabled(model_dir, solo, tmp_path):
    rng = random.Random(2)
    ids = [rng.randrange(3, 300) for _ in range(5 * BLOCK + 7)]
    reuse = (len(ids) - 1) // BLOCK * BLOCK
    want = solo(ids, 8)
    folder = tmp_path / "kv"
    model = model_dir.name
    recurrent = "qwen3_next" in model

    server = start(model_dir, "--prefix-cache-dir", str(folder), "--prefix-cache-ram", "64MiB")
    try:
        client = client_of(server)
        assert complete(client, model, ids) == (want, 0)
        assert complete(client, model, ids) == (want, reuse)
        assert complete(client, model, ids, stream=True) == (want, reuse)
        msgs = [{"role": "system", "content": "You answer in one short line. " * 6},
                {"role": "user", "content": "Why is the sky blue?"}]
        chat = [client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
                for _ in range(2)]
        assert chat[0].usage.prompt_tokens_details.cached_tokens == 0
        assert chat[1].usage.prompt_tokens_details.cached_tokens >= BLOCK
        assert chat[0].choices[0].message.content == chat[1].choices[0].message.content

        shared = [rng.randrange(3, 300) for _ in range(3 * BLOCK)]   # 8 at once sharing a 3-block prefix
        group = [shared + [rng.randrange(3, 300) for _ in range(2 + i)] for i in range(8)]
        expected = [solo(g, 6) for g in group]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda g: complete(client_of(server), model, g, 6), group))
        assert [t for t, _ in got] == expected
        assert sum(c for _, c in got) >= 3 * BLOCK * 6, got          # all but the first few computed none of it

        hits, misses = metric(server, "ktrun_prefix_cache_hit_tokens_total"), \
            metric(server, "ktrun_prefix_cache_miss_tokens_total")
        assert hits == 2 * reuse + chat[1].usage.prompt_tokens_details.cached_tokens + sum(c for _, c in got)
        assert misses == metric(server, "ktrun_prompt_tokens_total") - hits
        assert metric(server, "ktrun_prefix_cache_enabled") == 1
        assert metric(server, "ktrun_prefix_cache_bytes", '{tier="device"}') > 0
        assert metric(server, "ktrun_prefix_cache_budget_bytes", '{tier="ram"}') == 64 << 20
        assert metric(server, "ktrun_kv_cache_bytes") == 0             # no request holds a block now
        assert metric(server, "ktrun_recurrent_state_bytes") == 0
        if recurrent:                                                 # every hit resumed from a snapshot
            assert metric(server, "ktrun_prefix_cache_tier_hit_states_total", '{tier="device"}') == 2 + 1 + sum(
                c > 0 for _, c in got)
            assert metric(server, "ktrun_prefix_cache_states", '{tier="device"}') > 0
    finally:
        assert server.stop() == 0, server.stderr
    assert "Traceback" not in server.stderr, server.stderr
    assert len(list(folder.rglob("*.kvblock"))) >= reuse // BLOCK     # written at shutdown
    assert (len(list(folder.rglob("*.kvstate"))) > 0) == recurrent

    restarted = start(model_dir, "--prefix-cache-dir", str(folder))
    try:
        assert complete(client_of(restarted), model, ids) == (want, reuse)
        assert metric(restarted, "ktrun_prefix_cache_tier_hit_tokens_total", '{tier="disk"}') == reuse
        assert metric(restarted, "ktrun_prefix_cache_corrupt_blocks_total") == 0
    finally:
        assert restarted.stop() == 0, restarted.stderr

    off = start(model_dir, "--no-prefix-cache")
    try:
        client = client_of(off)
        assert complete(client, model, ids) == (want, 0)
        assert complete(client, model, ids) == (want, 0)
        assert metric(off, "ktrun_prefix_cache_enabled") == 0
        assert metric(off, "ktrun_prefix_cache_hit_tokens_total") == 0
        assert metric(off, "ktrun_prefix_cache_miss_tokens_total") == 2 * len(ids)
    finally:
        assert off.stop() == 0, off.stderr


def test_prefix_cache_dir_in_use_or_bad_size_is_a_clear_error(tmp_path_factory, tmp_path):
    import subprocess

    model_dir = converted(tmp_path_factory, "deepseek_v3", "bf16")

    folder = tmp_path / "kv"
    first = start(model_dir, "--prefix-cache-dir", str(folder))
    try:
        second = subprocess.run([str(BIN / "ktrun"), "serve", str(model_dir), "--port", "0", "--prefix-cache-dir",
                                 str(folder)], check=False, capture_output=True, text=True, timeout=180)
        assert second.returncode == 1 and "in use by another ktrun server" in second.stderr, second.stderr
    finally:
        first.stop()
    bad = subprocess.run([str(BIN / "ktrun"), "serve", str(model_dir), "--prefix-cache-ram", "lots"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'lots' is not a size" in bad.stderr, bad.stderr
