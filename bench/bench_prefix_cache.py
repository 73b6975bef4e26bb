"""Prefix cache of `ktrun serve`: TTFT and prefill tokens with and without the cache, per tier, in one run.

Five servers of the same model run side by side on loopback, and every request goes to each of them in turn
(alternated, so the machine's noise hits all of them alike):
- off:    --no-prefix-cache (every prompt prefilled in full)
- device: the default (blocks stay in the KV pool; RAM tier behind)
- ram:    --prefix-cache-device 0 (a finished request's blocks go to the RAM tier at once: hits copy them back)
- disk:   --prefix-cache-device 0 --prefix-cache-ram 0 --prefix-cache-dir DIR (blocks go to disk at once; before
          each request the block files are dropped from the OS page cache with posix_fadvise, so hits read the disk)
- disk_pagecache: the same, without dropping the page cache (recently written blocks are read from the OS cache)

Scenarios (greedy, so all four servers produce the same text; the run checks it):
- agent: a fixed system prompt of --system-tokens tokens (Python source from the default model's held-out text)
  plus a short, different task per request (completions with token ids); the first request is cold everywhere;
- chat: a multi-turn conversation (/v1/chat/completions): each turn sends the whole conversation so far plus a new
  user message, so a cache can reuse the previous turns, replies included.

Per request it reads usage.prompt_tokens_details.cached_tokens, and from /metrics the server-side TTFT (arrival to
first token) and the tokens each tier supplied. Reported: TTFT median over warm requests per server, prefill tokens,
and the speed-up of each tier over `off`; the target is a fully cached system prompt >= 10x lower TTFT.

    .venv/bin/python bench/bench_prefix_cache.py                    # the embedded default model, converted int4
    .venv/bin/python bench/bench_prefix_cache.py --model-dir converted/ --system-tokens 2048 --agent-requests 6
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEFAULT_MODEL = REPO / "ktconvert" / "data" / "default_model"
TARGET = 10.0


def convert_default(work: Path) -> Path:
    out = work / "default-model"
    subprocess.run([str(BIN / "ktconvert"), "quantize", str(DEFAULT_MODEL), "-o", str(out), "--method", "int4-amx",
                    "--gpu-method", "rtn-int4", "--quiet"], check=True, cwd=REPO)
    return out


class Server:
    def __init__(self, name: str, model_dir: Path, ctx: int, args: list[str]):
        self.name = name
        self.proc = subprocess.Popen([str(BIN / "ktrun"), "serve", str(model_dir), "--port", "0", "--ctx", str(ctx),
                                      "--max-batch", "4", *args], cwd=REPO, stderr=subprocess.PIPE, text=True)
        self.port = None
        for line in self.proc.stderr:
            m = re.search(r"listening on http://[\d.]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            raise SystemExit(f"{name}: server exited with {self.proc.wait()} before listening")
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.call("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name}: server exited with {self.proc.returncode} while loading")
            time.sleep(0.2)
        raise SystemExit(f"{self.name}: not ready in {timeout:.0f} s")

    def call(self, method: str, path: str, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read().decode()
            return r.status, (json.loads(data) if data[:1] in "{[" else data)
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.call("GET", "/metrics")[1].splitlines():
            parts = line.rsplit(" ", 1)
            if len(parts) == 2 and not line.startswith("#"):
                out[parts[0]] = float(parts[1])
        return out

    def stream(self, path: str, body: dict) -> dict:
        """One streaming request: text, usage, client TTFT (first chunk with text)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{self.name}: HTTP {resp.status}: {resp.read()[:300]!r}")
        text, usage, t_first = [], None, None
        for line in resp:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            ev = json.loads(line[6:])
            for c in ev.get("choices") or []:
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if piece:
                    t_first = t_first or time.perf_counter()
                    text.append(piece)
            usage = ev.get("usage") or usage
        conn.close()
        return {"text": "".join(text), "usage": usage, "client_ttft": (t_first or time.perf_counter()) - t0}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def drop_page_cache(folder: Path) -> None:
    """Evict the block files' pages (clean: they were fsynced) from the OS page cache, so the next read hits disk."""
    for p in folder.rglob("*.kvblock"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tier_key(name: str, tier: str) -> str:
    return name + '{tier="' + tier + '"}'


def measure(server: Server, path: str, body: dict, disk_dir: Path | None) -> dict:
    if disk_dir is not None:
        drop_page_cache(disk_dir)
    m0 = server.metrics()
    r = server.stream(path, body)
    m1 = server.metrics()

    def d(key):
        return m1.get(key, 0.0) - m0.get(key, 0.0)

    n = d("ktrun_time_to_first_token_seconds_count")
    assert n == 1, f"{server.name}: {n} requests between the two scrapes"
    cached = (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"text": r["text"], "ttft": d("ktrun_time_to_first_token_seconds_sum"), "client_ttft": r["client_ttft"],
            "prompt": r["usage"]["prompt_tokens"], "cached": cached, "prefill": r["usage"]["prompt_tokens"] - cached,
            **{t: d(tier_key("ktrun_prefix_cache_tier_hit_tokens_total", t)) for t in ("device", "ram", "disk")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="a converted directory (default: convert the embedded model)")
    ap.add_argument("--system-tokens", type=int, default=2048, help="agent scenario: tokens of the system prompt")
    ap.add_argument("--agent-requests", type=int, default=6, help="agent requests per server (the first is cold)")
    ap.add_argument("--turns", type=int, default=5, help="chat turns per server")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--ctx", type=int, default=4096)
    a = ap.parse_args()
    text = (DEFAULT_MODEL / "heldout_eval.txt").read_text()
    with tempfile.TemporaryDirectory(prefix="bench_prefix_cache_") as tmp:
        tmp = Path(tmp)
        model_dir = a.model_dir or convert_default(tmp)
        disk_dir = tmp / "kv"
        to_disk = ["--prefix-cache-device", "0", "--prefix-cache-ram", "0", "--prefix-cache-dir"]
        configs = {"off": ["--no-prefix-cache"], "device": [], "ram": ["--prefix-cache-device", "0"],
                   "disk": [*to_disk, str(disk_dir)], "disk_pagecache": [*to_disk, str(tmp / "kv2")]}
        servers = {name: Server(name, model_dir, a.ctx, args) for name, args in configs.items()}
        try:
            for s in servers.values():
                s.wait_ready()
            any_server = servers["off"]
            model = any_server.call("GET", "/v1/models")[1]["data"][0]["id"]
            tokens = any_server.call("POST", "/tokenize", {"prompt": text})[1]["tokens"]
            if len(tokens) < a.system_tokens + 64 * a.agent_requests:
                raise SystemExit(f"held-out text has {len(tokens)} tokens, fewer than asked for")
            system = tokens[: a.system_tokens]
            print(f"model: {model}")
            print(f"system_prompt: {len(system)} tokens")
            for s in servers.values():                                   # warm-up (not measured)
                s.stream("/v1/completions", {"model": model, "prompt": tokens[-40:], "max_tokens": 2,
                                             "temperature": 0})
            results = {"agent": {n: [] for n in servers}, "chat": {n: [] for n in servers}}

            # agent: the same system prompt, a different task each time
            for i in range(a.agent_requests):
                task = tokens[a.system_tokens + 64 * i: a.system_tokens + 64 * i + 48]
                body = {"model": model, "prompt": system + task, "max_tokens": a.max_tokens, "temperature": 0,
                        "ignore_eos": True}
                for name, s in servers.items():
                    results["agent"][name].append(
                        measure(s, "/v1/completions", body, disk_dir if name == "disk" else None))

            # chat: the conversation grows by a user message and the reply each turn
            chunks = [c for c in re.split(r"\n\n+", text[len(text) // 2:]) if 200 < len(c) < 1200]
            messages = [{"role": "system", "content": "You are a Python assistant. Continue the code."}]
            for t in range(a.turns):
                messages.append({"role": "user", "content": chunks[t]})
                body = {"model": model, "messages": messages, "max_tokens": a.max_tokens, "temperature": 0,
                        "ignore_eos": True}
                for name, s in servers.items():
                    results["chat"][name].append(
                        measure(s, "/v1/chat/completions", body, disk_dir if name == "disk" else None))
                messages.append({"role": "assistant", "content": results["chat"]["off"][-1]["text"]})

            ok = report(results, servers)
            for name, s in servers.items():
                m = s.metrics()
                held = " ".join(f"{t} {m.get(tier_key('ktrun_prefix_cache_bytes', t), 0):.0f}"
                                for t in ("device", "ram", "disk"))
                print(f"{name}_tier_bytes_at_end: {held} bytes")
            return 0 if ok else 1
        finally:
            for s in servers.values():
                s.stop()


def report(results: dict, servers: dict) -> bool:
    """Print the lines; -> True when all servers gave the same texts and the device tier met the target."""
    ok = True
    for scenario, per in results.items():
        texts = {n: [r["text"] for r in rs] for n, rs in per.items()}
        same = all(t == texts["off"] for t in texts.values())
        print(f"{scenario}_same_text_on_all_servers: {same}")
        ok &= same
        for name, rs in per.items():
            warm = rs[1:]
            print(f"{scenario}_{name}_cold_ttft: {rs[0]['ttft'] * 1e3:.1f} ms (prefilled {rs[0]['prefill']} of "
                  f"{rs[0]['prompt']} tokens)")
            print(f"{scenario}_{name}_warm_ttft_median: {statistics.median(r['ttft'] for r in warm) * 1e3:.1f} ms "
                  f"(client {statistics.median(r['client_ttft'] for r in warm) * 1e3:.1f} ms)")
            print(f"{scenario}_{name}_warm_prefill_tokens: {sum(r['prefill'] for r in warm)} of "
                  f"{sum(r['prompt'] for r in warm)} tokens")
            tiers = {t: sum(r[t] for r in warm) for t in ("device", "ram", "disk")}
            print(f"{scenario}_{name}_warm_cached_tokens_by_tier: " + " ".join(f"{t} {v:.0f}" for t, v in tiers.items()))
        base = statistics.median(r["ttft"] for r in per["off"][1:])
        for name in [n for n in per if n != "off"]:
            x = base / statistics.median(r["ttft"] for r in per[name][1:])
            print(f"{scenario}_{name}_ttft_speedup_vs_off: {x:.1f} x")
            if scenario == "agent":
                print(f"agent_target_{name}: fully cached system prompt TTFT >= {TARGET:.0f}x lower than recomputing "
                      f"it: {'met' if x >= TARGET else 'NOT met'}")
                ok &= x >= TARGET or name != "device"
    return ok


if __name__ == "__main__":
    sys.exit(main())
