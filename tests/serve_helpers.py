"""Start `ktrun serve` (or the fake-engine server) as a real subprocess on a free loopback port; raw HTTP helpers."""
from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


class ServerProcess:
    """A server subprocess started with `--port 0`; the chosen port is read from its 'listening on' line."""

    def __init__(self, argv: list[str], wait_ready: bool = True, timeout: float = 120.0, cwd: Path = REPO):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + timeout
        self.port = None
        while self.port is None:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"server exited (rc={self.proc.wait()}) before listening:\n{self.stderr}")
            self.log.append(line)
            m = re.search(r"listening on http://([\d.]+):(\d+)", line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not bind in time")
        self._drain = threading.Thread(target=self._read_log, daemon=True)
        self._drain.start()
        if wait_ready:
            self.wait_ready(deadline - time.monotonic())

    def _read_log(self):
        for line in self.proc.stderr:
            self.log.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.log)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited (rc={self.proc.returncode}):\n{self.stderr}")
            try:
                if request(self, "GET", "/health")[0] == 200:
                    # the 'ready' line is printed before /health turns 200; the log thread may still be reading it
                    while "; ready" not in self.stderr and time.monotonic() < deadline:
                        time.sleep(0.02)
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{self.stderr}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def request(server, method: str, path: str, body=None, headers=None, timeout: float = 60.0):
    """Raw HTTP: returns (status, parsed JSON or text, headers). `body`: dict (sent as JSON), bytes or str.
    headers: the response's header mapping, case-insensitive as HTTP header names are."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read().decode("utf-8")
        try:
            parsed = json.loads(data)
        except json.JSONDecodeError:
            parsed = data
        return resp.status, parsed, resp.headers
    finally:
        conn.close()


def metric(server, name: str, labels: str = "") -> float:
    """A sample's value from GET /metrics (labels: the exact `{...}` text, or '' for none); 0 when absent."""
    _, text, _ = request(server, "GET", "/metrics")
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0


def wait_for_metric(server, name: str, done, timeout: float) -> float:
    """Poll /metrics until done(value) or the timeout; returns the last value (the caller asserts on it)."""
    deadline = time.monotonic() + timeout
    value = metric(server, name)
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.02)
        value = metric(server, name)
    return value


def sse_events(resp) -> list:
    """Read a streamed http.client response to the end; the `data:` payloads (JSON, or '[DONE]')."""
    events = []
    for raw in resp.read().decode("utf-8").split("\n\n"):
        if raw.startswith("data: "):
            payload = raw[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def fake_server(*args: str, wait_ready: bool = True) -> ServerProcess:
    return ServerProcess([PYTHON, str(REPO / "tests" / "serve_fake_engine.py"), "--port", "0", *args],
                         wait_ready=wait_ready)
