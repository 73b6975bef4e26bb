"""`ktrun serve` against hostile and old clients (issue 34), through the real server code as a subprocess on loopback
(the fake engine: tests/serve_fake_engine.py) and raw sockets: read deadlines close slow clients while others are
served, the request head has a size limit (431), HTTP/1.0 clients get a stream they can read, a second signal stops
the server at once, and the smaller items (a message without content, xgrammar's error text, a wrong Content-Type,
WWW-Authenticate, the keep-alive limit, --help of every new flag). The SIGTERM drain on the default model:
tests/test_serve_drain.py."""
from __future__ import annotations

import http.client
import json
import re
import selectors
import signal
import socket
import threading
import time

import pytest
from serve_helpers import fake_server, request, sse_events

KEY = {"Authorization": "Bearer k"}
HEADER_TIMEOUT = BODY_TIMEOUT = 1.0
N_SLOW = 300


@pytest.fixture(scope="module")
def server():
    s = fake_server("--api-key", "k", "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                    "--keep-alive-timeout", "1")
    yield s
    assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


def raw(server, data: bytes, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """Send raw bytes, read the answer until the server closes: (status, headers (lower-case names), body)."""
    with socket.create_connection((server.host, server.port), timeout=timeout) as c:
        try:
            c.sendall(data)
        except (BrokenPipeError, ConnectionResetError):   # the server answered and closed before taking it all
            pass
        got = b""
        try:
            while chunk := c.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return int(lines[0].split()[1]), headers, body


# -- read deadlines ---------------------------------------------------------------------------------------------------
SLOW_KINDS = {
    "silent": b"",                                                                  # connects, never sends
    "head": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",                        # a head that never ends
    "trickle": b"POST /v1/completions HTTP/1.1\r\n",                                # then a byte every 0.2 s
    "body": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
             b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\""),   # a body that stalls
}


def test_slow_clients_are_closed_by_the_timeouts_while_a_request_is_served(server):
    kinds = list(SLOW_KINDS)
    socks, opened, kind_of = [], {}, {}
    sel = selectors.DefaultSelector()
    try:
        for i in range(N_SLOW):
            c = socket.create_connection((server.host, server.port), timeout=5)
            kind = kinds[i % len(kinds)]
            c.sendall(SLOW_KINDS[kind])
            c.setblocking(False)
            socks.append(c)
            opened[c], kind_of[c] = time.monotonic(), kind
            sel.register(c, selectors.EVENT_READ)
        t0 = time.monotonic()
        status, body, _ = request(server, "POST", "/v1/completions",
                                  {"model": "fake-model", "prompt": "hello", "max_tokens": 8}, headers=KEY, timeout=10)
        served_s = time.monotonic() - t0
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        assert served_s < 1.0, f"a normal request took {served_s:.2f} s beside {N_SLOW} slow clients"

        closed, answers = {}, {}
        deadline = time.monotonic() + HEADER_TIMEOUT + 5
        next_trickle = time.monotonic()
        while len(closed) < N_SLOW and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.05):
                c = key.fileobj
                try:
                    data = c.recv(65536)
                except ConnectionResetError:
                    data = b""
                if data:
                    answers[c] = answers.get(c, b"") + data
                else:
                    closed[c] = time.monotonic() - opened[c]
                    sel.unregister(c)
            if time.monotonic() >= next_trickle:     # the trickling heads send one more byte
                next_trickle += 0.2
                for c in socks:
                    if kind_of[c] == "trickle" and c not in closed:
                        try:
                            c.send(b"X")
                        except OSError:
                            pass
        assert len(closed) == N_SLOW, f"{N_SLOW - len(closed)} slow clients still open after {HEADER_TIMEOUT + 5} s"
        slowest = max(closed.values())
        assert slowest < HEADER_TIMEOUT + 2.5, slowest
        for c in socks:                              # a head that never came is answered 408 before the close
            if kind_of[c] in ("head", "trickle"):
                assert answers.get(c, b"").startswith(b"HTTP/1.1 408 "), answers.get(c)
        print(f"normal request served in {served_s * 1e3:.0f} ms beside {N_SLOW} slow clients; all closed by the "
              f"server within {slowest:.2f} s of connecting (--header-timeout / --body-timeout {HEADER_TIMEOUT:g})")
    finally:
        sel.close()
        for c in socks:
            c.close()
    assert request(server, "GET", "/health")[0] == 200


# -- the request head's size --------------------------------------------------------------------------------------
def test_a_64k_header_is_accepted_and_a_1mb_header_gets_431(server):
    status, _, _ = request(server, "GET", "/health", headers={"X-Pad": "a" * (64 << 10)})
    assert status == 200
    status, headers, body = raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n")
    assert status == 431 and headers.get("connection") == "close", (status, headers, body[:200])
    assert json.loads(body)["error"]["code"] == "header_too_large"


def test_a_head_over_a_small_limit_in_one_read_gets_431():
    """A head that arrives whole in one read is parsed by h11 before its buffer check: the app checks it too."""
    s = fake_server("--max-header-bytes", "4096")
    try:
        assert request(s, "GET", "/health", headers={"X-Pad": "a" * 3000})[0] == 200
        status, body, _ = request(s, "GET", "/health", headers={"X-Pad": "a" * 8000})
        assert status == 431 and body["error"]["code"] == "header_too_large" and "4096" in body["error"]["message"]
    finally:
        assert s.stop() == 0, s.stderr


# -- HTTP/1.0 ---------------------------------------------------------------------------------------------------------
def test_http10_client_reads_a_stream_without_chunked_encoding(server):
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                       "stream": True}).encode()
    status, headers, data = raw(server, b"POST /v1/chat/completions HTTP/1.0\r\nAuthorization: Bearer k\r\n"
                                        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                                + body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert "transfer-encoding" not in headers and headers.get("connection", "").lower() == "close", headers
    events = [x[6:] for x in data.decode().split("\n\n") if x.startswith("data: ")]   # the body as sent: plain SSE
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# -- the smaller items --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("message,param", [({"role": "user"}, "messages[0]"),
                                           ({"role": "user", "content": None}, "messages[0]"),
                                           ({"role": "tool", "tool_call_id": "1"}, "messages[0]")])
def test_a_message_without_content_is_refused(server, message, param):
    status, body, _ = request(server, "POST", "/v1/chat/completions",
                              {"model": "fake-model", "messages": [message]}, headers=KEY)
    assert status == 400 and body["error"]["param"] == param, body
    assert "'content' is required" in body["error"]["message"], body


def test_an_assistant_message_with_tool_calls_needs_no_content(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    status, body, _ = request(server, "POST", "/tokenize", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]}, headers=KEY)
    assert status == 200, body


def test_an_unsupported_schema_error_has_no_internal_path_or_time(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                         "maximum": 1}}}
    status, body, _ = request(server, "POST", "/v1/chat/completions", {
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "response_format": fmt}, headers=KEY)
    msg = body["error"]["message"]
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert "minimum greater than maximum" in msg, msg
    assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+|/project/", msg), msg


def test_a_wrong_content_type_says_send_json(server):
    status, body, _ = request(server, "POST", "/v1/chat/completions", b'{"model": "fake-model"}',
                              headers={**KEY, "Content-Type": "text/plain"})
    msg = body["error"]["message"]
    assert status == 415 and body["error"]["code"] == "unsupported_media_type", body
    assert "'text/plain'" in msg and "Content-Type: application/json" in msg and "b'" not in msg, msg
    status, body, _ = request(server, "POST", "/v1/completions",               # curl -d without -H
                              b"model=fake-model", headers={**KEY, "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415, body


def test_401_says_how_to_authenticate(server):
    status, body, headers = request(server, "GET", "/v1/models")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer", dict(headers)
    assert body["error"]["code"] == "invalid_api_key"


def test_idle_keep_alive_connection_is_closed_after_its_timeout(server):
    with socket.create_connection((server.host, server.port), timeout=10) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got or not got.endswith(b"}"):
            got += c.recv(65536)
        assert got.startswith(b"HTTP/1.1 200 ")
        t0 = time.monotonic()
        assert c.recv(1) == b""                  # the server closes the idle connection
        idle_s = time.monotonic() - t0
    assert 0.5 < idle_s < 3.0, idle_s


def test_every_new_flag_has_help():
    from ktrun.cli.cmd_serve import serve

    helps = {opt: p.help for p in serve.params for opt in p.opts}
    for flag in ("--drain-timeout", "--header-timeout", "--body-timeout", "--keep-alive-timeout",
                 "--max-header-bytes", "--max-connections"):
        assert len(helps.get(flag) or "") > 30, flag


# -- a second signal --------------------------------------------------------------------------------------------
def test_a_second_signal_exits_at_once():
    s = fake_server("--step-delay", "0.02", "--drain-timeout", "30", "--ctx", "4096")
    events: list = [None, None]

    def stream(i):
        conn = http.client.HTTPConnection(s.host, s.port, timeout=20)
        conn.request("POST", "/v1/completions", json.dumps({"model": "fake-model", "prompt": f"p{i}",
                                                            "max_tokens": 3000, "stream": True}),
                     {"Content-Type": "application/json"})
        events[i] = sse_events(conn.getresponse())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    s.proc.send_signal(signal.SIGTERM)
    rc = s.proc.wait(10)
    exit_s = time.monotonic() - t0
    for t in threads:
        t.join(5)
    assert rc == 1 and exit_s < 2.0, (rc, exit_s, s.stderr)       # not the 30 s drain
    for ev in events:
        assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "shutting_down", ev[-3:]
    s._drain.join(5)
    assert "second signal" in s.stderr and "Traceback" not in s.stderr, s.stderr
    print(f"second SIGTERM 0.3 s after the first (--drain-timeout 30): exit {rc} after {exit_s:.2f} s")


# -- the loop during a long prefill ---------------------------------------------------------------------------------
def test_health_and_metrics_answer_during_a_long_prefill():
    """The engine's steps run on the event loop, but one with a long prefill (here the first: its time is not known
    yet) runs in a thread of its own: /health and /metrics answer meanwhile, and the request completes."""
    s = fake_server("--step-delay", "2.0")
    try:
        done: list = []

        def complete():
            done.append(request(s, "POST", "/v1/completions", {"model": "fake-model", "prompt": "a long prompt",
                                                                "max_tokens": 1}))

        t = threading.Thread(target=complete)
        t0 = time.monotonic()
        t.start()
        time.sleep(0.4)                                    # the request is in, its 2 s prefill step running
        for path in ("/health", "/metrics"):
            t1 = time.monotonic()
            status, _, _ = request(s, "GET", path, timeout=5)
            assert status == 200 and time.monotonic() - t1 < 0.5, (path, time.monotonic() - t1)
        assert time.monotonic() - t0 < 1.5 and not done    # all of it while the prefill ran
        t.join(10)
        assert done and done[0][0] == 200 and done[0][1]["usage"]["completion_tokens"] == 1, done
    finally:
        s.stop()
