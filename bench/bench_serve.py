"""Load test of `ktrun serve` over loopback: requests/s, output tokens/s, TTFT and TPOT (mean, median, p99) at
concurrency 1, 4 and 16, and the aggregate output rate at 16 streams against one stream's (measured in the same run).

Bounded in count and time: each level runs `--requests-per-stream x concurrency` streaming requests (at least
`--min-requests`) of exactly `--max-tokens` tokens (ignore_eos), or stops starting new ones after `--level-seconds`.
Clients are closed-loop: each of the `c` streams sends its next request when the previous one finishes.

    .venv/bin/python bench/bench_serve.py                       # tiny DeepSeek-V3 fixture, converted int4
    .venv/bin/python bench/bench_serve.py --model-dir converted/ --max-tokens 64
    .venv/bin/python bench/bench_serve.py --baseline 870c4c0 --rounds 3   # vs the server of another commit

--llama-server BIN --gguf FILE runs llama.cpp's server (built from the llama-cpp-python sdist, bench/README.md) on a
GGUF of the same model beside `ktrun serve`, both with 16 slots, alternated per level for --rounds rounds, on the
agent workload (every client's conversation opens with the same long system prompt listing tools,
then 3 user turns, each answer appended to the history): aggregate output tok/s, TTFT and inter-token latency
(per-request mean gap) p50 / p99 for each, and the ratios ours / llama-server.

    .venv/bin/python bench/bench_serve.py --model-dir converted/ --llama-server $L/build/bin/llama-server \
        --gguf default-q4_0.gguf --rounds 2

--baseline REV starts the `ktrun serve` of git revision REV (its runtime/, layouts/ and ktconvert/ exported to a
temporary folder, this checkout's kernel library copied in) and this checkout's side by side on the same converted
model, runs each level on one then the other, A B B A ... for --rounds rounds, and prints each one's median per
level plus the ratios (ours / baseline); the exit code is 1 when ours is more than --max-regression slower in
output tokens/s or median TTFT.
"""
from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEVELS = (1, 4, 16)
BIN = Path(sys.executable).parent  # the venv's console scripts: ktconvert, ktrun


def build_fixture(work: Path, arch: str) -> Path:
    from ktconvert.testing import make_checkpoint

    src = make_checkpoint(arch, work / "src")
    out = work / "converted"
    subprocess.run([str(BIN / "ktconvert"), "quantize", str(src), "-o", str(out), "--quiet"],
                   check=True, cwd=REPO)
    return out


def export_revision(rev: str, work: Path) -> Path:
    """The packages of git revision `rev` as an import folder (ktrun, ktlayouts, ktconvert), with this checkout's
    compiled kernel library: PYTHONPATH=<folder> runs that revision's server."""
    tree = work / f"rev-{rev}"
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev, "runtime", "layouts", "ktconvert"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(tree, filter="data")
    # the library beside the module that loads it in that revision: runtime/ops/ since the wings (issue 31),
    # runtime/ before; without it the revision's server would silently run the torch reference experts
    libs = list((REPO / "runtime").rglob("libktkernels*.so"))
    if not libs:
        raise SystemExit("no compiled kernel library under runtime/ (make kernels)")
    loaders = [f.parent for f in (tree / "runtime").rglob("library.py")] or [tree / "runtime"]
    for lib in libs:
        for folder in loaders:
            shutil.copy2(lib, folder / lib.name)
    pkgs = work / f"pkgs-{rev}"
    pkgs.mkdir()
    for name, folder in (("ktrun", "runtime"), ("ktlayouts", "layouts"), ("ktconvert", "ktconvert")):
        (pkgs / name).symlink_to(tree / folder)
    return pkgs


def start_server(model_dir: Path, ctx: int, max_batch: int, pythonpath: Path | None = None):
    """`ktrun serve` of this checkout, or (pythonpath) of an exported revision."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from ktrun.cli import main; sys.exit(main())",
                             "serve", str(model_dir), "--port", "0", "--ctx", str(ctx), "--max-batch",
                             str(max_batch)], cwd=REPO, stderr=subprocess.PIPE, text=True, env=env)
    port = None
    for line in proc.stderr:
        m = re.search(r"listening on http://[\d.]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        raise SystemExit(f"server exited with {proc.wait()} before listening")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep the pipe drained
    wait_healthy(proc, port, "ktrun serve")
    return proc, port


def wait_healthy(proc, port: int, what: str, seconds: float = 300) -> None:
    """Until GET /health answers 200 (a server loading its model answers 503 or nothing); the process killed and
    SystemExit if it exits or takes longer."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} while loading")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{what} did not become ready in {seconds:.0f} s")


def stream_request(port: int, path: str, body: dict, text_of) -> dict:
    """POST body (streamed, with usage) to path; times at the client: TTFT at the first event with text, the
    per-token gap (TPOT) over the rest. text_of(event) -> the event's text or None. -> ttft, tpot (s), tokens (the
    usage's, else the text events'), text."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    t_first = t_last = None
    n_tokens, text = 0, []
    for line in resp:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        event = json.loads(line[6:])
        now = time.perf_counter()
        piece = text_of(event) if event.get("choices") else None
        if piece:
            t_first = t_first or now
            t_last = now
            text.append(piece)
        if event.get("usage"):
            n_tokens = event["usage"]["completion_tokens"]
    conn.close()
    end = time.perf_counter()
    t_first, t_last = t_first or end, t_last or end
    n_tokens = n_tokens or len(text)
    return {"ttft": t_first - t0, "tpot": (t_last - t_first) / max(n_tokens - 1, 1), "tokens": n_tokens,
            "text": "".join(text)}


def one_request(port: int, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion. (Text that is not yet a whole character is sent with a later token, so a
    random-weight fixture's client TTFT can include a few tokens; the server's own per-token TTFT/TPOT means are
    printed as *_server_*.)"""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return stream_request(port, "/v1/completions", body, lambda e: e["choices"][0]["text"])


def run_level(port, model, c, n_requests, max_tokens, seconds) -> tuple[list[dict], float]:
    results, lock, counter = [], threading.Lock(), iter(range(n_requests))
    t_stop = time.perf_counter() + seconds

    def stream():
        while time.perf_counter() < t_stop:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = one_request(port, model, f"Request {i}: the story of number {i * 7919 % 1000} goes", max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def scrape(port: int) -> dict[str, float]:
    """Unlabelled samples of GET /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    out = {}
    for line in conn.getresponse().read().decode().splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            out[parts[0]] = float(parts[1])
    return out


def level_results(port: int, model: str, c: int, a) -> dict[str, float]:
    """One level (c closed-loop streams): the `name: value` results (value in the unit printed)."""
    res: dict[str, float] = {}
    n = max(a.min_requests, a.requests_per_stream * c)
    m0 = scrape(port)
    results, wall = run_level(port, model, c, n, a.max_tokens, a.level_seconds)
    m1 = scrape(port)
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in ("ktrun_generation_tokens_total", "ktrun_engine_steps_total",
                                                      "ktrun_engine_step_seconds_total",
                                                      "ktrun_cpu_expert_seconds_total",
                                                      "ktrun_time_to_first_token_seconds_sum",
                                                      "ktrun_time_to_first_token_seconds_count",
                                                      "ktrun_time_per_output_token_seconds_sum",
                                                      "ktrun_time_per_output_token_seconds_count")}
    tokens = sum(r["tokens"] for r in results)
    res[f"c{c}_requests"] = len(results)
    res[f"c{c}_requests_per_s"] = len(results) / wall
    res[f"c{c}_output_tokens_per_s"] = tokens / wall
    steps = max(d["ktrun_engine_steps_total"], 1)
    res[f"c{c}_tokens_per_engine_step"] = d["ktrun_generation_tokens_total"] / steps
    res[f"c{c}_engine_step_time_share"] = d["ktrun_engine_step_seconds_total"] / wall
    res[f"c{c}_cpu_expert_time_share"] = d["ktrun_cpu_expert_seconds_total"] / wall
    for what, vals in (("ttft", [r["ttft"] for r in results]), ("tpot", [r["tpot"] for r in results])):
        v = sorted(vals)
        res[f"c{c}_{what}_mean"] = statistics.fmean(v) * 1e3
        res[f"c{c}_{what}_median"] = statistics.median(v) * 1e3
        res[f"c{c}_{what}_p99"] = v[min(len(v) - 1, round(0.99 * (len(v) - 1)))] * 1e3
    for what, key in (("ttft", "time_to_first_token"), ("tpot", "time_per_output_token")):
        s_, n_ = d[f"ktrun_{key}_seconds_sum"], d[f"ktrun_{key}_seconds_count"]
        res[f"c{c}_server_{what}_mean"] = s_ / max(n_, 1) * 1e3
    return res


def bench_levels(port: int, model: str, a) -> dict[str, float]:
    res: dict[str, float] = {}
    for c in LEVELS:
        res.update(level_results(port, model, c, a))
    res["c16_vs_c1_output_tokens_per_s_ratio"] = res["c16_output_tokens_per_s"] / res["c1_output_tokens_per_s"]
    return res


UNITS = {"requests": "requests", "requests_per_s": "req/s", "output_tokens_per_s": "tok/s",
         "tokens_per_engine_step": "tokens", "engine_step_time_share": "of wall", "cpu_expert_time_share": "of wall",
         "ratio": "x"}


def unit(name: str) -> str:
    for suffix, u in UNITS.items():
        if name.endswith(suffix):
            return u
    return "ms"


def ready_server(model_dir: Path, a, pythonpath: Path | None = None):
    """A started and warmed-up server -> (process, port, model id)."""
    proc, port = start_server(model_dir, a.ctx, max(LEVELS), pythonpath)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    one_request(port, model, "warm up", 4)
    return proc, port, model


def stop(proc) -> None:
    proc.terminate()
    proc.wait(30)


# --- the agent workload and llama-server ---------------------------------------------------------------------------

# A coding agent's shared prefix: its instructions and the tools it may call, the same for every conversation.
TOOLS = [("read_file", "path", "the file's text"), ("write_file", "path, text", "ok or an error"),
         ("run_tests", "pattern", "the failures"), ("grep", "regex, folder", "matching lines"),
         ("list_dir", "folder", "its entries")]
AGENT_SYSTEM = ("You are a careful coding agent working in a Python repository. Read before you write, keep changes "
                "small, run the tests after each change and report what you did.\nTools (answer with one call per "
                "line, as name(arguments)):\n" + "".join(f"- {n}({args}): returns {ret}.\n" for n, args, ret in TOOLS)
                + "Rules: never delete files; ask before renaming a public function; say when a test is skipped.\n")
AGENT_TURNS = ("Find where the config file is parsed.", "Add a check that the port is a number, with a test.",
               "Run the tests and tell me what failed.")


def chat_request(port: int, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion; its text goes into the next turn's history."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return stream_request(port, "/v1/chat/completions", body, lambda e: e["choices"][0].get("delta", {}).get("content"))


def agent_level(port: int, model: str, c: int, a) -> dict[str, float]:
    """c clients, each running conversations of len(AGENT_TURNS) turns one after another (closed loop) until
    max(min_requests, requests_per_stream x c) requests ran or level_seconds passed."""
    results, lock = [], threading.Lock()
    n = max(a.min_requests, a.requests_per_stream * c)
    t_stop = time.perf_counter() + a.level_seconds

    def client(k: int):
        conv = 0
        while time.perf_counter() < t_stop:
            messages = [{"role": "system", "content": AGENT_SYSTEM}]
            for turn in AGENT_TURNS:
                with lock:
                    if len(results) >= n:
                        return
                messages.append({"role": "user", "content": f"[task {k}.{conv}] {turn}"})
                r = chat_request(port, model, messages, a.max_tokens)
                messages.append({"role": "assistant", "content": r["text"]})
                with lock:
                    results.append(r)
            conv += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    res = {f"c{c}_requests": len(results), f"c{c}_output_tokens_per_s": sum(r["tokens"] for r in results) / wall}
    for what, key in (("ttft", "ttft"), ("itl", "tpot")):
        v = sorted(r[key] for r in results)
        res[f"c{c}_{what}_median"] = statistics.median(v) * 1e3
        res[f"c{c}_{what}_p99"] = v[min(len(v) - 1, round(0.99 * (len(v) - 1)))] * 1e3
    return res


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_llama_server(binary: Path, gguf: Path, ctx: int, slots: int, threads: int):
    """llama.cpp's server on gguf with `slots` parallel sequences of ctx tokens each (its -c is their total), its
    jinja renderer for the GGUF's chat template -> (process, port, model id)."""
    port = free_port()
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-np", str(slots), "-c", str(ctx * slots), "-t", str(threads), "--jinja"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(proc, port, f"llama-server on {gguf}")
    chat_request(port, "peer", [{"role": "user", "content": "warm up"}], 4)
    return proc, port, "peer"


def against_llama_server(model_dir: Path, a) -> int:
    """ktrun serve and llama-server up at once, every level alternated, agent workload; medians over the rounds."""
    runs = alternate({"llamacpp": start_llama_server(a.llama_server, a.gguf, a.ctx, max(LEVELS), a.threads),
                      "ours": ready_server(model_dir, a)}, a, agent_level)
    print(f"workload: agent (system prompt {len(AGENT_SYSTEM)} chars, {len(AGENT_TURNS)} turns per conversation)")
    for c in LEVELS:
        print_medians(runs, "llamacpp", c)
    return 0


def alternate(servers: dict[str, tuple], a, level) -> dict[str, dict[int, list[dict]]]:
    """Every level on each started server in turn (first, second, second, first, ... for a.rounds rounds), so load
    from elsewhere on the machine falls on both alike; the servers are stopped after. -> runs[who][c]: results."""
    names = list(servers)
    runs: dict[str, dict[int, list[dict]]] = {w: {c: [] for c in LEVELS} for w in names}
    try:
        for c in LEVELS:
            for r in range(a.rounds):
                for who in (names if r % 2 == 0 else names[::-1]):
                    _, port, model = servers[who]
                    res = level(port, model, c, a)
                    runs[who][c].append(res)
                    print(f"round{r}_{who}_c{c}_output_tokens_per_s: {res[f'c{c}_output_tokens_per_s']:.1f} tok/s",
                          flush=True)
    finally:
        for proc, _, _ in servers.values():
            stop(proc)
    print(f"rounds: {a.rounds} per level, alternated")
    return runs


def print_medians(runs: dict, peer: str, c: int) -> tuple[float, float]:
    """Each result's median over the rounds for peer and ours at level c, then ours / peer for output tok/s and
    median TTFT. -> those two ratios."""
    med = {w: {k: statistics.median(x[k] for x in runs[w][c]) for k in runs[w][c][0]} for w in (peer, "ours")}
    for k in med["ours"]:
        for w in (peer, "ours"):
            print(f"{w}_{k}: {med[w][k]:.2f} {unit(k)}")
    tps = med["ours"][f"c{c}_output_tokens_per_s"] / med[peer][f"c{c}_output_tokens_per_s"]
    ttft = med["ours"][f"c{c}_ttft_median"] / med[peer][f"c{c}_ttft_median"]
    print(f"c{c}_output_tokens_per_s_ours_vs_{peer}: {tps:.3f} x")
    print(f"c{c}_ttft_median_ours_vs_{peer}: {ttft:.3f} x")
    return tps, ttft


def compare(model_dir: Path, a, base_path: Path) -> int:
    """Both servers up at once (the idle one waits on its socket), every level alternated; medians over the rounds."""
    runs = alternate({"baseline": ready_server(model_dir, a, base_path), "ours": ready_server(model_dir, a)}, a,
                     level_results)
    print(f"baseline: {a.baseline}")
    worst = 1.0
    for c in LEVELS:
        tps, ttft = print_medians(runs, "baseline", c)
        worst = min(worst, tps, 1 / ttft)
    print(f"worst_ratio_ours_vs_baseline: {worst:.3f} x (limit {1 - a.max_regression:.2f})")
    return 0 if worst >= 1 - a.max_regression else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="a converted directory (default: build the tiny fixture)")
    ap.add_argument("--arch", default="deepseek_v3", help="fixture architecture when no --model-dir")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--level-seconds", type=float, default=60.0, help="stop starting requests after this long")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--baseline", help="git revision whose server to compare against (alternated with ours)")
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline: runs of each server")
    ap.add_argument("--max-regression", type=float, default=0.05,
                    help="with --baseline: allowed slowdown in output tokens/s and TTFT (fraction)")
    ap.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary: run it as the peer")
    ap.add_argument("--gguf", type=Path, help="with --llama-server: a GGUF of the same model")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="with --llama-server: its threads (ktrun uses every core of this process)")
    a = ap.parse_args()
    if a.llama_server is not None and (a.gguf is None or a.baseline is not None):
        ap.error("--llama-server needs --gguf FILE and no --baseline")
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        model_dir = a.model_dir or build_fixture(Path(tmp), a.arch)
        print(f"max_tokens_per_request: {a.max_tokens} tokens")
        if a.llama_server is not None:
            return against_llama_server(model_dir, a)
        if a.baseline is None:
            proc, port, model = ready_server(model_dir, a)
            try:
                print(f"model: {model}")
                res = bench_levels(port, model, a)
            finally:
                stop(proc)
            for k, v in res.items():
                print(f"{k}: {v:.2f} {unit(k)}" if unit(k) != "requests" else f"{k}: {v:.0f} {unit(k)}")
            return 0 if res["c16_vs_c1_output_tokens_per_s_ratio"] > 1.0 else 1
        return compare(model_dir, a, export_revision(a.baseline, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
