"""The endpoints of `ktrun serve`, mixed into the HTTP handler (app.py): the route table, /health, /v1/models,
/metrics, /tokenize, /detokenize, and the generation routes (/v1/completions, /v1/chat/completions):
validate -> tokenize -> length checks -> submit to the engine thread -> stream or collect the text."""
from __future__ import annotations

import queue
import select
import socket
import time
from typing import ClassVar

from ..text_stream import TextStream
from . import protocol as proto
from .protocol import ApiError, GenerationRequest, bad_param

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
DISCONNECT_POLL_S = 0.05


class ClientGone(Exception):
    """The client closed its connection while its request was generating."""


# -- tokenizer adapters: accept a `tokenizers`-style or a transformers-style tokenizer --------------------------------
def encode(tok, text: str, special: bool = True) -> list[int]:
    try:
        out = tok.encode(text, add_special_tokens=special)
    except TypeError:
        out = tok.encode(text)
    return list(getattr(out, "ids", out))


def decode(tok, ids: list[int]) -> str:
    return tok.decode(list(ids))


def chat_prompt_ids(tok, messages: list[dict]) -> list[int]:
    try:
        out = tok.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # no template, or the template refused these messages (raise_exception / bad roles)
        if not isinstance(e, ValueError) and "jinja2" not in type(e).__module__:
            raise
        raise ApiError(400, f"the chat template cannot render these messages: {e}", code="chat_template_error",
                       param="messages") from None
    if isinstance(out, str):  # rendered text: the template already holds the BOS text, so add no special tokens
        return encode(tok, out, special=False)
    return list(getattr(out, "ids", out))


class Routes:
    """route_<name> methods for ROUTES; the handler (app.Handler) supplies state, read_json and send_json."""

    ROUTES: ClassVar[dict[tuple[str, str], str]] = {
        ("GET", "/health"): "health", ("GET", "/v1/models"): "models", ("GET", "/metrics"): "metrics",
        ("POST", "/v1/completions"): "completions", ("POST", "/v1/chat/completions"): "chat_completions",
        ("POST", "/tokenize"): "tokenize", ("POST", "/detokenize"): "detokenize",
    }
    PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # need the API key when one is set

    # -- simple routes --------------------------------------------------------------------------------------------
    def route_health(self) -> None:
        self.state.require_ready()
        self.send_json(200, {"status": "ok"})

    def route_models(self) -> None:
        engine = self.state.require_ready()
        self.send_json(200, proto.models_list(engine.model_name, self.state.created, engine.ctx))

    def route_metrics(self) -> None:
        stats = dict(getattr(self.state.engine, "stats", None) or {})
        prefix = getattr(self.state.engine, "prefix_cache_stats", None)
        self.send_json(200, self.state.metrics.render(stats, prefix() if prefix else None),
                       "text/plain; version=0.0.4; charset=utf-8")

    # -- /tokenize, /detokenize (vLLM-compatible shapes) ------------------------------------------------------------
    def route_tokenize(self) -> None:
        body = self.read_json()
        engine = self.state.require_ready()
        self._check_model(engine, body.get("model"), optional=True)
        if "messages" in body:
            ids = chat_prompt_ids(engine.tokenizer, proto.parse_chat({**body, "model": engine.model_name}).messages)
        elif isinstance(body.get("prompt"), str):
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise bad_param("add_special_tokens", "'add_special_tokens' must be true or false")
            ids = encode(engine.tokenizer, body["prompt"], special)
        else:
            raise bad_param("prompt", "send 'prompt' (a string) or 'messages'")
        self.send_json(200, {"tokens": ids, "count": len(ids), "max_model_len": engine.ctx})

    def route_detokenize(self) -> None:
        body = self.read_json()
        engine = self.state.require_ready()
        self._check_model(engine, body.get("model"), optional=True)
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise bad_param("tokens", "'tokens' must be a list of integer token ids")
        self._check_ids(engine, ids, "tokens", model_vocab=False)
        self.send_json(200, {"prompt": decode(engine.tokenizer, ids)})

    def _check_model(self, engine, model, optional=False) -> None:
        if model is None and optional:
            return
        if model != engine.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {engine.model_name!r}",
                           "not_found_error", "model_not_found", "model")

    def _check_ids(self, engine, ids, param: str, model_vocab: bool = True) -> None:
        """Token ids in range: the model's vocabulary for prompts, the tokenizer's for /detokenize."""
        model_cfg = getattr(getattr(engine, "model", None), "cfg", None)
        vocab = getattr(model_cfg, "vocab_size", None) if model_vocab else None
        vocab = vocab or getattr(engine.tokenizer, "vocab_size", None)
        if isinstance(vocab, int) and any(not 0 <= t < vocab for t in ids):
            raise bad_param(param, f"token ids must be in [0, {vocab})")

    # -- /v1/completions, /v1/chat/completions ----------------------------------------------------------------------
    def route_completions(self) -> None:
        self._generate("completion")

    def route_chat_completions(self) -> None:
        self._generate("chat")

    def _generate(self, kind: str) -> None:
        t_arrival = time.perf_counter()
        body = self.read_json()
        engine = self.state.require_ready()
        req = proto.parse_chat(body) if kind == "chat" else proto.parse_completion(body)
        self._check_model(engine, req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            prompt_ids = chat_prompt_ids(tok, req.messages)
        elif isinstance(req.prompt, str):
            prompt_ids = encode(tok, req.prompt)
        else:
            self._check_ids(engine, req.prompt, "prompt")
            prompt_ids = list(req.prompt)
        max_tokens = self._check_lengths(req, len(prompt_ids), engine.ctx)
        try:  # stop strings are matched here (TextStream), on the text sent, so the engine gets none
            params = self.state.sampling_params_cls(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                seed=req.seed, stop=[], ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise ApiError(400, f"invalid sampling parameters: {e}", code="invalid_parameter") from None
        rid = proto.new_id(kind)
        metrics = self.state.metrics
        metrics.prompt_tokens.inc(len(prompt_ids))
        handle = self.state.engine_thread.submit(rid, prompt_ids, params)
        text = TextStream(lambda ids: decode(tok, ids), req.stop, prompt_ids)
        try:
            if req.stream:
                self._stream(req, rid, handle, text, len(prompt_ids), t_arrival)
            else:
                finish, n = self._drive(req, handle, text, t_arrival, on_delta=None)
                out = text.text
                if req.echo:
                    out = (req.prompt if isinstance(req.prompt, str) else decode(tok, prompt_ids)) + out
                self.send_json(200, proto.full_response(req, rid, proto.now(), out, finish,
                                                        proto.usage(len(prompt_ids), n, handle.cached_tokens)))
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            self.state.engine_thread.abort(rid)  # frees the slot on the engine thread's next turn
            self.state.metrics.finished.inc(1, "abort")
            self.close_connection = True
            self._status = 499

    def _check_lengths(self, req: GenerationRequest, n_prompt: int, ctx: int) -> int:
        if n_prompt == 0:
            raise bad_param("prompt", "the prompt is empty (0 tokens)")
        if n_prompt >= ctx:
            raise ApiError(400, f"the prompt is {n_prompt} tokens, over the context limit of {ctx} tokens "
                                f"(the prompt must leave room for at least 1 generated token)",
                           code="context_length_exceeded", param="messages" if req.kind == "chat" else "prompt")
        if req.max_tokens is None:
            return min(DEFAULT_COMPLETION_MAX_TOKENS, ctx - n_prompt) if req.kind == "completion" else ctx - n_prompt
        if n_prompt + req.max_tokens > ctx:
            raise ApiError(400, f"max_tokens={req.max_tokens} plus the prompt's {n_prompt} tokens is "
                                f"{n_prompt + req.max_tokens} tokens, over the context limit of {ctx} tokens",
                           code="context_length_exceeded", param="max_tokens")
        return req.max_tokens

    def _stream(self, req, rid, handle, text, n_prompt, t_arrival) -> None:
        created = proto.now()
        self._status = 200
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if req.kind == "chat":  # the role goes out at once, before the first token
            self._write_event(proto.sse(proto.chunk(req, rid, created, role=True)))

        def on_delta(delta):
            self._write_event(proto.sse(proto.chunk(req, rid, created, text=delta)))

        try:
            finish, n = self._drive(req, handle, text, t_arrival, on_delta)
        except ApiError as e:  # headers are out: report the error as an event, then end the stream
            self._write_event(proto.sse(e.body()) + proto.sse("[DONE]"))
            self.wfile.write(b"0\r\n\r\n")
            return
        events = proto.sse(proto.chunk(req, rid, created, finish_reason=finish))
        if req.include_usage:
            events += proto.sse(proto.usage_chunk(req, rid, created, proto.usage(n_prompt, n, handle.cached_tokens)))
        self._write_event(events + proto.sse("[DONE]"))
        self.wfile.write(b"0\r\n\r\n")  # end of the chunked body; the connection stays usable

    def _write_event(self, data: bytes) -> None:
        """One HTTP chunk holding whole SSE events (the socket writer is unbuffered: it goes out now)."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _drive(self, req, handle, text: TextStream, t_arrival: float, on_delta) -> tuple[str, int]:
        """Consume the request's tokens until it finishes; returns (finish_reason, completion tokens)."""
        metrics = self.state.metrics
        n, t_first, t_last, finish = 0, None, None, None
        for token, engine_finish in self._tokens(handle):
            t_last = time.perf_counter()
            if t_first is None:
                t_first = t_last
                metrics.ttft.observe(t_first - t_arrival)
            n += 1
            metrics.generated_tokens.inc()
            delta = text.push(token, last=engine_finish is not None)
            if text.stopped:
                finish = "stop"
                if engine_finish is None:
                    self.state.engine_thread.abort(handle.req_id)
            else:
                finish = engine_finish
            if delta and on_delta is not None:
                on_delta(delta)
            if finish is not None:
                break
        metrics.finished.inc(1, finish)
        metrics.e2e.observe(t_last - t_arrival)
        metrics.gen_len.observe(n)
        if n > 1:
            metrics.tpot.observe((t_last - t_first) / (n - 1))
        return finish, n

    def _tokens(self, handle):
        """Yield (token, finish_reason | None) from the engine thread; raise ClientGone when the peer hung up."""
        last_check = time.perf_counter()
        while True:
            try:
                item = handle.out.get(timeout=DISCONNECT_POLL_S)
            except queue.Empty:
                item = None
            if item is None or time.perf_counter() - last_check > DISCONNECT_POLL_S:
                last_check = time.perf_counter()
                if self._peer_closed():
                    raise ClientGone()
            if item is None:
                continue
            if isinstance(item, BaseException):
                self.state.metrics.finished.inc(1, "error")
                if isinstance(item, ValueError):  # the engine refused the request (e.g. over its context)
                    raise ApiError(400, str(item), code="invalid_request")
                raise ApiError(500, str(item), "server_error", "engine_error")
            yield item
            if item[1] is not None:
                return

    def _peer_closed(self) -> bool:
        """True when the client closed its end: the socket reads as end-of-file (data waiting is not a close)."""
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True
