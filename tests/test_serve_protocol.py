"""HTTP/OpenAI protocol tests of `ktrun serve`'s server code, run as a real subprocess on loopback with a small
deterministic fake engine (tests/serve_fake_engine.py) in place of the model: wire format, streaming, errors,
auth, loading state, scheduling (batching, waiting, aborts) and metrics. The same server on a real converted model
is tested in test_serve_model.py."""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serve_fake_engine import BOS, ByteTokenizer, fake_generate
from serve_helpers import REPO, fake_server, metric, request, sse_events, wait_for_metric

MODEL = "fake-model"


@pytest.fixture(scope="module")
def server():
    s = fake_server("--ctx", "256", "--max-batch", "16", "--step-delay", "0.003")
    yield s
    assert s.stop() == 0, s.stderr
    # the only tracebacks logged are those of the failure injected on purpose (one per crashing request)
    assert s.stderr.count("Traceback") == s.stderr.count("RuntimeError: fake engine: injected failure"), s.stderr


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def expected_text(prompt: str, max_tokens: int) -> str:
    ids = ByteTokenizer().encode(prompt)
    return ByteTokenizer().decode(fake_generate(ids, max_tokens))


def test_models_and_health(server, client):
    assert request(server, "GET", "/health")[0] == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_non_streaming(client):
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=12, temperature=0)
    assert r.choices[0].text == expected_text("hello world", 12)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (1 + len("hello world"), 12)


def test_chat_streaming_chunks_with_usage(client):
    msgs = [{"role": "user", "content": "stream me"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert streamed == full.choices[0].message.content
    prompt = ByteTokenizer().apply_chat_template(msgs, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(prompt.encode())  # template text, no second BOS


def test_raw_sse_framing(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 4,
                                                        "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text("abc", 4)
    # the connection is kept alive after a chunked stream and serves the next request
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()


def test_multibyte_characters_split_across_tokens(client):
    s = client.completions.create(model=MODEL, prompt="UTF8", max_tokens=8, stream=True)
    deltas = [c.choices[0].text for c in s]
    assert "".join(deltas) == "éééé" and all("\ufffd" not in d for d in deltas)


def test_stop_strings_and_eos(client):
    full = expected_text("stop test", 40)
    stop = full[10:13]
    cut = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt="stop test", max_tokens=40, stop=[stop, "@@"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    s = list(client.completions.create(model=MODEL, prompt="stop test", max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in s) == cut and s[-1].choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="EOS please", max_tokens=40)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4  # 3 tokens + EOS


def test_tokenize_detokenize(server):
    st, body, _ = request(server, "POST", "/tokenize", {"model": MODEL, "prompt": "hé"})
    assert st == 200 and body["tokens"] == [BOS, ord("h"), 0xC3, 0xA9] and body["max_model_len"] == 256
    st, body, _ = request(server, "POST", "/detokenize", {"tokens": [ord("o"), ord("k")]})
    assert (st, body) == (200, {"prompt": "ok"})


def _error(server, path, body, status, code=None, headers=None):
    st, resp, _ = request(server, "POST", path, body, headers)
    assert st == status, resp
    assert set(resp["error"]) >= {"message", "type", "code"}, resp
    if code:
        assert resp["error"]["code"] == code, resp
    return resp["error"]["message"]


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_k": 1.5}, "top_k"),
    ({"model": MODEL, "prompt": "x", "seed": "s"}, "seed"),
    ({"model": MODEL, "prompt": "x", "stop": 5}, "stop"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n"),  # n > 1 is served since issue 19; n < 1 is still refused
    ({"model": MODEL, "prompt": 7}, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL, "prompt": [1, -2]}, "prompt"),
    ({"model": MODEL, "prompt": [1, 99999]}, "prompt"),
    ({"prompt": "x"}, "model"),
])
def test_bad_parameters_400(server, body, param):
    st, resp, _ = request(server, "POST", "/v1/completions", body)
    assert st == 400 and resp["error"]["param"] == param, resp


@pytest.mark.parametrize("body", [
    {"model": MODEL, "messages": "hi"}, {"model": MODEL, "messages": []}, {"model": MODEL, "messages": [1]},
    {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
    {"model": MODEL, "messages": [{"role": "user", "content": {"a": 1}}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
])
def test_bad_chat_bodies_400(server, body):
    _error(server, "/v1/chat/completions", body, 400, "invalid_parameter")


def test_malformed_and_oversized_bodies(server):
    _error(server, "/v1/completions", b"{not json", 400, "invalid_json")
    _error(server, "/v1/completions", b"\xff\xfe", 400, "invalid_json")
    _error(server, "/v1/completions", b"[1, 2]", 400, "invalid_json")
    _error(server, "/v1/chat/completions", b"", 400, "invalid_json")
    _error(server, "/v1/completions", b"[" * 50000, 400, "invalid_json")
    _error(server, "/v1/completions", b'{"model": "fake-model", "prompt": "\\ud800"}', 400, "invalid_json")
    _error(server, "/v1/completions", b'{"model": "fake-model", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
           400, "invalid_json")
    _error(server, "/v1/completions", b'{"model": "fake-model", "prompt": "x", "max_tokens": 1e400}', 400,
           "invalid_parameter")
    msg = _error(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 70000}, 413, "body_too_large")
    assert "65536" in msg
    st, resp, _ = request(server, "GET", "/v1/nothing")
    assert st == 404 and resp["error"]["code"] == "not_found"
    st, resp, _ = request(server, "DELETE", "/v1/completions")
    assert st == 405 and resp["error"]["code"] == "method_not_allowed"


def test_context_limits(server):
    msg = _error(server, "/v1/completions", {"model": MODEL, "prompt": "y" * 300}, 400, "context_length_exceeded")
    assert "301 tokens" in msg and "256" in msg
    msg = _error(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400,
                 "context_length_exceeded")
    assert "1000000000" in msg and "256" in msg
    _error(server, "/v1/completions", {"model": "other-model", "prompt": "x"}, 404, "model_not_found")


def test_raw_garbage_and_half_requests(server):
    for payload in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"a\"",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: -3\r\n\r\n"):
        with socket.create_connection((server.host, server.port), timeout=10) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            s.recv(4096)
    assert request(server, "GET", "/health")[0] == 200


def test_16_concurrent_streams_batched(server, client):
    prompts = [f"prompt number {i} " + "z" * i for i in range(16)]
    steps0 = metric(server, "ktrun_engine_steps")

    def run(p):
        s = client.completions.create(model=MODEL, prompt=p, max_tokens=48, stream=True, temperature=0)
        return "".join(c.choices[0].text for c in s)

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(run, prompts))
    assert texts == [expected_text(p, 48) for p in prompts]
    assert metric(server, "ktrun_engine_max_batch_seen") > 4  # decoded together, not one after another
    assert metric(server, "ktrun_engine_steps") - steps0 < 16 * 48 / 4
    assert metric(server, "ktrun_num_requests_running") == 0


def test_disconnect_mid_stream_frees_the_slot(server):
    aborts0 = metric(server, "ktrun_request_finished_total", '{reason="abort"}')
    engine_aborts0 = metric(server, "ktrun_engine_aborts")
    for stream in (True, False):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "long one", "max_tokens": 240,
                                                            "stream": stream}), {"Content-Type": "application/json"})
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")  # a first event: generating
        else:
            wait_for_metric(server, "ktrun_num_requests_running", lambda v: v >= 1, timeout=10)
        assert metric(server, "ktrun_num_requests_running") == 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert wait_for_metric(server, "ktrun_num_requests_running", lambda v: v == 0, timeout=10) == 0
    assert metric(server, "ktrun_request_finished_total", '{reason="abort"}') == aborts0 + 2
    assert metric(server, "ktrun_engine_aborts") == engine_aborts0 + 2  # engine.abort() freed both slots
    assert metric(server, "ktrun_generation_tokens_total") < 10_000


def test_engine_failure_is_a_500_and_the_server_keeps_serving(server, client):
    st, body, _ = request(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "CRASH", "max_tokens": 3})
    assert st == 500 and body["error"]["code"] == "engine_error" and "injected failure" in body["error"]["message"]
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": MODEL, "stream": True, "max_tokens": 3,
                 "messages": [{"role": "user", "content": "CRASH"}]}), {"Content-Type": "application/json"})
    events = sse_events(conn.getresponse())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["error"]["code"] == "engine_error" and events[-1] == "[DONE]"
    conn.close()
    assert client.completions.create(model=MODEL, prompt="fine", max_tokens=3).usage.completion_tokens == 3
    assert metric(server, "ktrun_request_finished_total", '{reason="error"}') >= 2


def test_metrics_text(server, client):
    p0, g0 = metric(server, "ktrun_prompt_tokens_total"), metric(server, "ktrun_generation_tokens_total")
    r = client.completions.create(model=MODEL, prompt="count me", max_tokens=5)
    assert metric(server, "ktrun_prompt_tokens_total") - p0 == r.usage.prompt_tokens
    assert metric(server, "ktrun_generation_tokens_total") - g0 == 5
    _, text, hdrs = request(server, "GET", "/metrics")
    assert hdrs["Content-Type"].startswith("text/plain")
    for name in ("ktrun_time_to_first_token_seconds_count", "ktrun_time_per_output_token_seconds_bucket",
                 "ktrun_cpu_expert_seconds_total", "ktrun_requests_total{", "ktrun_num_requests_running"):
        assert name in text
    assert metric(server, "ktrun_cpu_expert_seconds_total") > 0


def test_api_key_and_loading_state():
    s = fake_server("--api-key", "sekret", "--load-delay", "2", wait_ready=False)
    try:
        st, body, _ = request(s, "GET", "/health")
        assert st == 503 and body["error"]["code"] == "model_loading"
        _error(s, "/v1/completions", {"model": MODEL, "prompt": "x"}, 503, "model_loading",
               {"Authorization": "Bearer sekret"})
        s.wait_ready(30)
        _error(s, "/v1/completions", {"model": MODEL, "prompt": "x"}, 401, "invalid_api_key")
        _error(s, "/v1/completions", {"model": MODEL, "prompt": "x"}, 401, "invalid_api_key",
               {"Authorization": "Bearer wrong"})
        assert request(s, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base_url + "/v1", api_key="nope", max_retries=0).models.list()
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="sekret", max_retries=0)
        assert c.completions.create(model=MODEL, prompt="k", max_tokens=3).usage.completion_tokens == 3
    finally:
        assert s.stop() == 0, s.stderr


def test_port_in_use(server):
    out = subprocess.run([sys.executable, "tests/serve_fake_engine.py", "--port", str(server.port)], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{server.port}" in out.stderr


def test_waiting_requests_beyond_max_batch():
    s = fake_server("--max-batch", "3")
    try:
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        prompts = [f"queue {i}" for i in range(10)]
        with ThreadPoolExecutor(10) as pool:
            texts = list(pool.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=8).choices[0].text,
                                  prompts))
        assert texts == [expected_text(p, 8) for p in prompts]
        assert metric(s, "ktrun_engine_max_batch_seen") == 3  # the fake engine raises past max_batch
    finally:
        assert s.stop() == 0, s.stderr
