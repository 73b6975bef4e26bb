"""HTTP app of `ktrun serve` on the standard library's `ThreadingHTTPServer` (one thread per connection).

Why the stdlib: SSE is chunked writes on the socket, a body size limit is a Content-Length check before reading,
and a vanished client shows up either as a failed write (streaming) or as an end-of-file peek on the socket while
the handler waits for tokens (non-streaming): all three need no framework. Generation itself runs on the single
`EngineThread` (engine_thread.py); handler threads only validate, tokenize, wait on their queue and write. The
endpoints are in routes.py, the OpenAI wire format in protocol.py, /metrics in metrics.py.
"""
from __future__ import annotations

import hmac
import json
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import protocol as proto
from .engine_thread import EngineThread
from .metrics import ServeMetrics
from .protocol import ApiError
from .routes import Routes

DEFAULT_MAX_BODY_BYTES = 4 << 20
DRAIN_LIMIT_BYTES = 64 << 20


class ServerState:
    """What every handler shares: the engine (None until loaded), its engine thread, metrics and settings."""

    def __init__(self, engine_factory, sampling_params_cls, api_key: str | None, max_body_bytes: int,
                 max_batch: int):
        self.engine_factory, self.sampling_params_cls = engine_factory, sampling_params_cls
        self.api_key, self.max_body_bytes, self.max_batch = api_key, max_body_bytes, max_batch
        self.engine = None
        self.engine_thread: EngineThread | None = None
        self.load_error: BaseException | None = None
        self.created = proto.now()
        self.metrics = ServeMetrics()
        m = self.metrics
        m.add_gauge("ktrun_num_requests_running", "Requests holding an engine slot (decoded together each step).",
                    lambda: self.engine_thread.num_running if self.engine_thread else 0)
        m.add_gauge("ktrun_num_requests_waiting", "Requests waiting for a free slot.",
                    lambda: self.engine_thread.num_waiting if self.engine_thread else 0)
        m.add_gauge("ktrun_kv_cache_bytes", "KV-cache bytes held by requests in the engine (freed on finish/abort).",
                    self._kv_cache_bytes)
        m.add_gauge("ktrun_max_batch", "Engine slots (max requests decoded together).", lambda: self.max_batch)
        m.add_gauge("ktrun_engine_ready", "1 once the model is loaded.", lambda: float(self.engine is not None))
        m.add_gauge("ktrun_slots_freed_by_abort_total", "Running requests stopped early (client gone, stop string).",
                    lambda: self.engine_thread.aborted if self.engine_thread else 0, kind="counter")
        m.add_gauge("ktrun_engine_steps_total", "engine.step() calls (each: prefill new requests + 1 batched decode).",
                    lambda: self.engine_thread.steps if self.engine_thread else 0, kind="counter")
        m.add_gauge("ktrun_engine_step_seconds_total", "Wall time inside engine.step().",
                    lambda: self.engine_thread.step_seconds if self.engine_thread else 0.0, kind="counter")
        m.add_gauge("ktrun_cpu_expert_seconds_total", "CPU time in routed-expert kernels (from Engine.stats).",
                    self._cpu_expert_seconds, kind="counter")

    def _kv_cache_bytes(self) -> float:
        read = getattr(self.engine, "kv_cache_bytes", None)
        return float(read()) if callable(read) else 0.0

    def _cpu_expert_seconds(self) -> float:
        stats = getattr(self.engine, "stats", None) or {}
        for key in ("expert_compute_s", "cpu_expert_s"):
            if isinstance(stats.get(key), (int, float)):
                return float(stats[key])
        return 0.0

    def load(self, on_failure) -> None:
        """Runs in a background thread after the socket is bound: /health says 503 until this finishes."""
        try:
            t0 = time.perf_counter()
            engine = self.engine_factory()
            self.engine_thread = EngineThread(engine, self.max_batch)
            self.engine = engine
            print(f"ktrun serve: model {engine.model_name!r} loaded in {time.perf_counter() - t0:.1f} s "
                  f"(ctx {engine.ctx}, max batch {self.max_batch}); ready", file=sys.stderr, flush=True)
        except BaseException as e:  # noqa: BLE001 -- report, then stop: a server that cannot load must not linger
            self.load_error = e
            if not isinstance(e, (ValueError, OSError)):  # bad input gets its message only (printed on exit)
                traceback.print_exc()
            on_failure()

    def require_ready(self):
        if self.engine is None:
            raise ApiError(503, "the model is still loading; retry when GET /health returns 200",
                           "service_unavailable", "model_loading")
        return self.engine


class Handler(Routes, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "ktrun"
    timeout = 300  # seconds a client may stall while sending a request or reading our response

    @property
    def state(self) -> ServerState:
        return self.server.state

    def log_message(self, format, *args):  # access log off by default (--log-requests turns it on)
        if getattr(self.server, "log_requests", False):
            super().log_message(format, *args)

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PATCH(self):
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        name = self.ROUTES.get((method, path))
        self._endpoint = path if name else "other"
        self._status = 500
        try:
            if name is None:
                if any(p == path for _, p in self.ROUTES):
                    raise ApiError(405, f"method {method} not allowed on {path}", code="method_not_allowed")
                raise ApiError(404, f"no route {method} {path}", "not_found_error", "not_found")
            if self.state.api_key is not None and path.startswith(self.PROTECTED):
                self._check_api_key()
            getattr(self, "route_" + name)()
        except ApiError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            self._status = 499  # client closed the connection
        except Exception as e:  # noqa: BLE001 -- a bug answers 500 with the reason; the server keeps running
            traceback.print_exc()
            self._send_error(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error", "internal"))
        self.state.metrics.requests.inc(1, self._endpoint, str(self._status))

    def _check_api_key(self) -> None:
        got = self.headers.get("Authorization", "")
        token = got[7:].strip() if got[:7].lower() == "bearer " else ""
        if not token or not hmac.compare_digest(token.encode(), self.state.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", "invalid_api_key")

    def read_json(self) -> dict:
        """The request body as a JSON object, refusing bodies over the limit before reading them."""
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked" or length is None:
            self.close_connection = True
            raise ApiError(411, "a Content-Length header is required", code="length_required")
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise ApiError(400, f"bad Content-Length {length!r}", code="invalid_header") from None
        if n > self.state.max_body_bytes:
            self.close_connection = True
            self._discard_body(n)
            raise ApiError(413, f"request body is {n} bytes, over the limit of {self.state.max_body_bytes} bytes",
                           code="body_too_large")
        raw = self.rfile.read(n)
        if len(raw) != n:
            self.close_connection = True
            raise ApiError(400, f"request body ended after {len(raw)} of {n} bytes", code="invalid_json")
        return proto.parse_json_body(raw)

    def _discard_body(self, n: int) -> None:
        """Read and drop a refused body (up to DRAIN_LIMIT_BYTES) so the client, still sending, gets our 413
        instead of a reset connection; beyond that the connection is just closed."""
        if n > DRAIN_LIMIT_BYTES:
            return
        while n > 0:
            chunk = self.rfile.read(min(n, 1 << 16))
            if not chunk:
                return
            n -= len(chunk)

    def send_json(self, status: int, obj, content_type: str = "application/json") -> None:
        data = obj.encode() if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: ApiError) -> None:
        try:
            self.send_json(e.status, e.body())
        except OSError:
            self.close_connection = True


class KtrunHTTPServer(ThreadingHTTPServer):
    daemon_threads = True        # a stuck client never blocks shutdown
    request_queue_size = 256     # listen backlog: bursts of concurrent clients connect without SYN retries

    def __init__(self, addr, state: ServerState, log_requests: bool = False):
        super().__init__(addr, Handler)
        self.state, self.log_requests = state, log_requests

    def handle_error(self, request, client_address):
        """A client that resets or stalls its connection is routine, not a server error worth a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


def run_server(engine_factory, sampling_params_cls, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, max_batch: int = 16, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               log_requests: bool = False) -> int:
    """Bind, print the address, load the engine in the background, serve until SIGINT/SIGTERM. Returns an exit code."""
    import signal

    state = ServerState(engine_factory, sampling_params_cls, api_key, max_body_bytes, max_batch)
    try:
        httpd = KtrunHTTPServer((host, port), state, log_requests)
    except OSError as e:
        print(f"ktrun serve: error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 2
    bound_host, bound_port = httpd.server_address[:2]
    print(f"ktrun serve: listening on http://{bound_host}:{bound_port} (loading model...)", file=sys.stderr,
          flush=True)

    def stop_serving():
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, lambda *_: stop_serving())
    threading.Thread(target=state.load, args=(stop_serving,), name="ktrun-load", daemon=True).start()
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        if state.engine_thread is not None:
            state.engine_thread.shutdown()
    if state.load_error is not None:
        print(f"ktrun serve: error: could not load the model: {state.load_error}", file=sys.stderr, flush=True)
        return 1
    return 0
