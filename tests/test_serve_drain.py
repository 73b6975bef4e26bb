"""SIGTERM drains `ktrun serve` (issue 34), on the embedded default model served by the real `ktrun serve` subprocess:
it stops accepting, lets running requests finish up to --drain-timeout, then ends each remaining stream with an
OpenAI-style error event and [DONE] (a non-streamed request: a 503 body), writes the prefix cache to its disk tier,
and exits 0 within the drain timeout + 2 s, with no traceback."""
from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serve_helpers import ServerProcess, sse_events

import ktconvert

BIN = Path(sys.executable).parent
SRC = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"
DRAIN = 2.0
N_STREAMS = 8
N_SHORT = 3                # streams that finish inside the drain timeout; the rest are ended by it


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("drain") / "default-model"
    subprocess.run([str(BIN / "ktconvert"), "quantize", str(SRC), "-o", str(out), "--expert-quantizer", "rtn",
                    "--gpu-method", "bf16", "--quiet"], check=True, capture_output=True, timeout=300)
    return out


def test_sigterm_drains_streams_then_exits(model, tmp_path):
    cache = tmp_path / "prefix-cache"
    s = ServerProcess([str(BIN / "ktrun"), "serve", str(model), "--port", "0", "--ctx", "1024",
                       "--drain-timeout", str(DRAIN), "--prefix-cache-dir", str(cache)], timeout=180)
    results: dict = {}
    started = threading.Barrier(N_STREAMS + 2)

    def stream(i: int) -> None:
        conn = http.client.HTTPConnection(s.host, s.port, timeout=60)
        body = {"model": model.name, "messages": [{"role": "user", "content": f"Tell me a story, number {i}."}],
                "max_tokens": 6 if i < N_SHORT else 900, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        started.wait(30)
        results[i] = (resp.status, sse_events(resp), time.monotonic())

    def collect() -> None:
        conn = http.client.HTTPConnection(s.host, s.port, timeout=60)
        body = {"model": model.name, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        started.wait(30)
        resp = conn.getresponse()
        results["collect"] = (resp.status, json.loads(resp.read()), time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(N_STREAMS)]
    threads.append(threading.Thread(target=collect))
    for t in threads:
        t.start()
    started.wait(30)
    time.sleep(0.3)                                   # every request is generating
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(OSError):                      # no longer accepting
        socket.create_connection((s.host, s.port), timeout=2).close()
    rc = s.proc.wait(DRAIN + 10)
    exit_s = time.monotonic() - t0
    for t in threads:
        t.join(10)
    s._drain.join(5)

    assert rc == 0, s.stderr
    assert exit_s < DRAIN + 2, f"exited {exit_s:.2f} s after SIGTERM (drain timeout {DRAIN} s)"
    ended = []
    for i in range(N_STREAMS):
        status, events, t_end = results[i]
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        last = events[-2]
        if i < N_SHORT:                               # finished inside the drain: a finish_reason
            assert last["choices"][0]["finish_reason"] == "length", last
        else:                                         # ended by it: the error event, at the drain timeout
            assert last["error"]["code"] == "shutting_down" and last["error"]["type"] == "service_unavailable", last
            assert len(events) > 3                    # it was generating until then
            ended.append(t_end - t0)
    status, body, t_end = results["collect"]
    assert status == 503 and body["error"]["code"] == "shutting_down", body
    assert all(DRAIN - 0.2 < x < DRAIN + 1.5 for x in ended + [t_end - t0]), (ended, t_end - t0)
    assert "Traceback" not in s.stderr and "CancelledError" not in s.stderr, s.stderr
    assert list(cache.rglob("*.kvblock")), "the prefix cache was not written to its disk tier at shutdown"
    print(f"SIGTERM with {N_STREAMS} streams + 1 non-streamed: {N_SHORT} finished, {len(ended)} streams ended with "
          f"an error event at {min(ended):.2f}-{max(ended):.2f} s, the non-streamed got 503 at {t_end - t0:.2f} s; "
          f"exit 0 after {exit_s:.2f} s (--drain-timeout {DRAIN:g})")
