"""HTTP app of `ktrun serve`: FastAPI on uvicorn (OpenAPI at /docs), one asyncio event loop for every connection,
whose callbacks also run the model's steps (engine_loop.py).

    create_app(state)  the FastAPI app: routes (routes.py), API-key check and request counting (ASGI middleware),
                       every error as the OpenAI envelope (pydantic's 422 becomes a 400 naming the field)
    run_server(...)    bind the socket first (and print it), then serve; the model loads in a background thread
                       meanwhile (/health answers 503 until it is ready); SIGINT/SIGTERM drain it (server.py: running
                       requests finish up to --drain-timeout, the rest end with an error) and exit 0; a second
                       signal exits at once (1)
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re
import socket
import sys
import threading
import time
import traceback
import weakref

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from .anthropic_errors import AnthropicErrors
from .engine_loop import EngineLoop
from .metrics import ServeMetrics
from .protocol import ApiError, error_param
from .reasoning import uses_thinking
from .response_store import ResponseStore
from .responses import error_body, now
from .routes import router
from .server import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
    DrainingServer,
    connection_protocol,
)
from .tool_parsers import PARSERS, detect

DEFAULT_MAX_BODY_BYTES = 4 << 20
PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")   # need the API key when one is set


class ServerState:
    """What every request shares: the engine (None until loaded), the loop that drives it, metrics and settings."""

    def __init__(self, engine_factory, sampling_params_cls, api_key: str | None, max_body_bytes: int,
                 max_batch: int, tool_call_parser: str = "auto", reasoning_parser: str = "auto",
                 separate_reasoning: bool = True, log_timings: bool = True,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES):
        self.engine_factory, self.sampling_params_cls = engine_factory, sampling_params_cls
        self.api_key, self.max_body_bytes, self.max_batch = api_key, max_body_bytes, max_batch
        self.max_header_bytes = max_header_bytes
        self.draining = False            # shutting down: new requests get 503 (server.DrainingServer)
        self.stopping = False            # the drain timeout passed: generations still running are ended
        self.generations: weakref.WeakSet = weakref.WeakSet()   # generation.Generation objects submitted
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.separate_reasoning, self.log_timings = separate_reasoning, log_timings
        self.engine = None
        self.engine_loop: EngineLoop | None = None
        self.load_error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_started = threading.Event()   # set by the app's startup: the engine's turns run on that loop
        self.created = now()
        self.responses = ResponseStore()   # /v1/responses kept for previous_response_id (bounded, in memory)
        self.metrics = ServeMetrics(lambda: dict(getattr(self.engine, "stats", None) or {}), self._prefix_cache_stats)
        self._detected: dict[str, object] = {}
        m = self.metrics
        et = lambda attr, default=0: lambda: getattr(self.engine_loop, attr) if self.engine_loop else default
        m.add_gauge("ktrun_num_requests_running", "Requests holding engine slots (decoded together each step).",
                    et("num_running"))
        m.add_gauge("ktrun_num_requests_waiting", "Requests waiting for a free slot.", et("num_waiting"))
        m.add_gauge("ktrun_kv_cache_bytes", "KV-cache bytes held by requests in the engine (freed on finish/abort).",
                    self._kv_cache_bytes)
        m.add_gauge("ktrun_recurrent_state_bytes", "Recurrent-state bytes held by requests (linear-attention layers: "
                    "each request's state and the one at its last block end; freed on finish/abort).",
                    lambda: self._engine_number("recurrent_state_bytes"))
        m.add_gauge("ktrun_max_batch", "Engine slots (max sequences decoded together).", lambda: self.max_batch)
        m.add_gauge("ktrun_engine_ready", "1 once the model is loaded.", lambda: float(self.engine is not None))
        m.add_gauge("ktrun_slots_freed_by_abort", "Running requests stopped early (client gone, stop string).",
                    et("aborted"), kind="counter")
        m.add_gauge("ktrun_engine_steps", "engine.step() calls (each: prefill new requests + 1 batched decode).",
                    et("steps"), kind="counter")
        m.add_gauge("ktrun_engine_step_seconds", "Wall time inside engine.step().", et("step_seconds", 0.0),
                    kind="counter")
        m.add_gauge("ktrun_cpu_expert_seconds", "CPU time in routed-expert kernels (from Engine.stats).",
                    self._cpu_expert_seconds, kind="counter")

    def _prefix_cache_stats(self) -> dict:
        read = getattr(self.engine, "prefix_cache_stats", None)   # None while loading (and for engines without one)
        return read() if read is not None else {}

    def _kv_cache_bytes(self) -> float:
        return self._engine_number("kv_cache_bytes")

    def _engine_number(self, name: str) -> float:
        read = getattr(self.engine, name, None)
        return float(read()) if callable(read) else 0.0

    def _cpu_expert_seconds(self) -> float:
        stats = getattr(self.engine, "stats", None) or {}
        for key in ("expert_compute_s", "cpu_expert_s"):
            if isinstance(stats.get(key), (int, float)):
                return float(stats[key])
        return 0.0

    # -- per-model choices, made once -------------------------------------------------------------------------
    def _vocab_and_template(self, tok):
        vocab = getattr(tok, "vocab", None)
        return (vocab if isinstance(vocab, dict) else {}), getattr(tok, "chat_template", None)

    def tool_parser_for(self, tok) -> str | None:
        if "tool" not in self._detected:
            name = self.tool_call_parser
            self._detected["tool"] = (detect(*self._vocab_and_template(tok)) if name == "auto"
                                      else None if name == "none" else name)
        return self._detected["tool"]

    def reasoning_for(self, tok) -> bool:
        if "reasoning" not in self._detected:
            mode = self.reasoning_parser
            self._detected["reasoning"] = (uses_thinking(*self._vocab_and_template(tok)) if mode == "auto"
                                           else mode != "none")
        return bool(self._detected["reasoning"])

    # -- loading ------------------------------------------------------------------------------------------------
    def load(self, on_failure) -> None:
        """Runs in a background thread after the socket is bound: /health says 503 until this finishes."""
        try:
            t0 = time.perf_counter()
            engine = self.engine_factory()
            self.loop_started.wait()
            self.engine_loop = EngineLoop(engine, self.max_batch, self.loop)
            tool = self.tool_parser_for(engine.tokenizer)
            # the line goes out before /health turns 200: whoever waits for ready can read what was detected
            print(f"ktrun serve: model {engine.model_name!r} loaded in {time.perf_counter() - t0:.1f} s "
                  f"(ctx {engine.ctx}, max batch {self.max_batch}, tool calls: {tool or 'off'}, reasoning split: "
                  f"{'on' if self.reasoning_for(engine.tokenizer) else 'off'}); ready", file=sys.stderr, flush=True)
            self.engine = engine
        except BaseException as e:  # noqa: BLE001 -- report, then stop: a server that cannot load must not linger
            self.load_error = e
            if not isinstance(e, (ValueError, OSError)):  # bad input gets its message only (printed on exit)
                traceback.print_exc()
            on_failure()

    def end_generations(self) -> None:
        """The drain is over: every running generation ends now with a 503 error (event loop only)."""
        self.stopping = True
        for gen in list(self.generations):
            gen.end()

    def require_ready(self):
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another server or once it is back",
                           "service_unavailable", "shutting_down")
        if self.engine is None:
            raise ApiError(503, "the model is still loading; retry when GET /health returns 200",
                           "service_unavailable", "model_loading")
        return self.engine


# -- ASGI middleware: API key, request counting -----------------------------------------------------------------
def _error_response(status: int, message: str, type_: str, code: str | None, param: str | None = None,
                    headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


class ApiKeyAndCounting:
    """Outermost layer: counts every answer by endpoint and status (ktrun_requests_total) and refuses protected
    paths without the right `Authorization: Bearer KEY` before anything reads the body."""

    def __init__(self, app, state: ServerState, known_paths: set[str]):
        self.app, self.state, self.known = app, state, known_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.known else "other"
        status = [499]  # client closed the connection before an answer

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            head = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if head > self.state.max_header_bytes:   # a head that arrived in one read, past h11's check (server.py)
                await _error_response(431, f"the request headers are {head} bytes, over the limit of "
                                           f"{self.state.max_header_bytes} bytes (--max-header-bytes)",
                                      "invalid_request_error", "header_too_large",
                                      headers={"Connection": "close"})(scope, receive, counting_send)
                return
            if self.state.api_key is not None and path.startswith(PROTECTED) and not self._key_ok(scope):
                await _error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (or "
                                           "'x-api-key: <key>')",
                                      "authentication_error", "invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})(scope, receive, counting_send)
                return
            await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.requests.labels(endpoint, str(status[0])).inc()

    def _key_ok(self, scope) -> bool:
        headers = dict(scope["headers"])
        got = headers.get(b"authorization", b"").decode("latin-1")
        # Anthropic's clients send the key as x-api-key
        token = got[7:].strip() if got[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode("latin-1")
        return bool(token) and hmac.compare_digest(token.encode(), self.state.api_key.encode())


# -- the app ------------------------------------------------------------------------------------------------------
_QUOTED = re.compile(r"'([a-z_]+)'")


def create_app(state: ServerState) -> FastAPI:
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        state.loop_started.set()
        yield

    app = FastAPI(title="ktrun serve", version="1", lifespan=lifespan,
                  description="OpenAI-compatible API of ktrun (MoE models on one GPU plus CPU experts).")
    app.state.ktrun = state
    app.include_router(router)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        """pydantic's 422 -> the OpenAI 400 envelope naming the first bad field."""
        errs = list(e.errors()) or [{"loc": (), "msg": "invalid request"}]
        err = next((x for x in errs if x.get("type") == "value_error"), errs[0])   # our own checks say most
        msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
        param = error_param(err.get("loc", ()))
        if param is None:                      # a check on the whole body names its field in quotes
            m = _QUOTED.search(msg)
            param = m.group(1) if m else None
        if err.get("type") == "json_invalid":
            return _error_response(400, f"request body is not valid JSON: {msg}", "invalid_request_error",
                                   "invalid_json")
        got = err.get("input")
        shown = "" if isinstance(got, dict) else f", got {json.dumps(got, default=str)[:100]}"
        return _error_response(400, f"{param or 'request'}: {msg}{shown}", "invalid_request_error",
                               "invalid_parameter", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        if e.status_code == 404:
            return _error_response(404, f"no route {request.method} {request.url.path}", "not_found_error",
                                   "not_found")
        if e.status_code == 405:
            return _error_response(405, f"method {request.method} not allowed on {request.url.path}",
                                   "invalid_request_error", "method_not_allowed")
        return _error_response(e.status_code, str(e.detail), "invalid_request_error", None, headers=e.headers)

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):  # a bug answers 500 with the reason; the server keeps running
        traceback.print_exception(e)
        return _error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error", "internal")

    known = {r.path for r in router.routes} | {"/docs", "/openapi.json"}
    app.add_middleware(ApiKeyAndCounting, state=state, known_paths=known)
    app.add_middleware(AnthropicErrors)   # outermost: rewrites every error under /v1/messages, the 401 included
    return app


def run_server(engine_factory, sampling_params_cls, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, max_batch: int = 16, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               log_requests: bool = False, tool_call_parser: str = "auto", reasoning_parser: str = "auto",
               separate_reasoning: bool = True, log_timings: bool = True,
               header_timeout: float = DEFAULT_HEADER_TIMEOUT, body_timeout: float = DEFAULT_BODY_TIMEOUT,
               keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT,
               max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES, max_connections: int = DEFAULT_MAX_CONNECTIONS,
               drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> int:
    """Bind, print the address, load the engine in the background, serve until SIGINT/SIGTERM (then drain: see
    server.DrainingServer). Returns an exit code."""
    import signal

    import uvicorn

    if tool_call_parser not in ("auto", "none", *PARSERS):
        print(f"ktrun serve: error: unknown --tool-call-parser {tool_call_parser!r} (choose auto, none, "
              f"{', '.join(PARSERS)})", file=sys.stderr, flush=True)
        return 2
    state = ServerState(engine_factory, sampling_params_cls, api_key, max_body_bytes, max_batch, tool_call_parser,
                        reasoning_parser, separate_reasoning, log_timings, max_header_bytes)
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: each SSE event goes out at once (no Nagle wait for the previous ACK)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(256)   # listen backlog: bursts of concurrent clients connect without SYN retries
    except OSError as e:
        print(f"ktrun serve: error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 2
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"ktrun serve: listening on http://{bound_host}:{bound_port} (loading model...)", file=sys.stderr,
          flush=True)
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=log_requests, lifespan="on", ws="none",
                            http=connection_protocol(header_timeout, body_timeout, max_header_bytes),
                            h11_max_incomplete_event_size=max_header_bytes, timeout_keep_alive=keep_alive_timeout,
                            limit_concurrency=max_connections or None, timeout_graceful_shutdown=drain_timeout + 1)
    server = DrainingServer(config, state, drain_timeout)

    def stop_serving():
        server.should_exit = True

    # uvicorn re-raises the signal that stopped it once it has shut down: these handlers make that a clean exit 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    threading.Thread(target=state.load, args=(stop_serving,), name="ktrun-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        if state.engine_loop is not None:   # a forced exit neither writes the prefix cache nor waits
            state.engine_loop.shutdown(timeout=0.5 if server.forced else 30.0, flush=not server.forced)
    if state.load_error is not None:
        print(f"ktrun serve: error: could not load the model: {state.load_error}", file=sys.stderr, flush=True)
        return 1
    if server.forced:
        print("ktrun serve: stopped by a second signal, without draining", file=sys.stderr, flush=True)
        return 1
    return 0
