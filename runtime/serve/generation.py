"""One generation request on the event loop: its tokens arrive from the engine's steps; per choice they become text
(TextStream: stop strings, whole characters), then reasoning vs answer (reasoning.py), then tool calls
(tool_parsers.py), with logprobs alongside; out go SSE chunks (stream) or one response, plus timings and metrics.

A client that goes away aborts the request at once: a streamed response is cancelled by Starlette when the
disconnect arrives; a non-streamed one has a watcher on the connection that wakes the waiting handler. A server
shutting down ends the requests still running at its drain timeout (`end`): a 503 error, as an event in a stream.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import sys
import time
from dataclasses import dataclass, field
from json.encoder import encode_basestring

from ..text.text_stream import TextStream
from . import responses as R
from .engine_loop import Token
from .protocol import ApiError
from .reasoning import ReasoningSplitter
from .tool_parsers import ToolCallStream, ToolParser


class ClientGone(Exception):
    """The client closed its connection while its request was generating."""


GONE = object()   # put in a request's queue by the disconnect watcher
ENDED = object()  # put in a request's queue when the server's drain timeout passed (ServerState.end_generations)


def decode(tok, ids: list[int], skip_special: bool = True) -> str:
    try:
        return tok.decode(list(ids), skip_special_tokens=skip_special)
    except TypeError:  # tokenizers without the option (test fakes)
        return tok.decode(list(ids))


def text_decoder(tok, skip_special: bool):
    """ids -> text for a TextStream: what decode(tok, ids, skip_special) returns. For ktrun's Tokenizer it calls the
    `tokenizers` object itself: a TextStream decodes twice a token, and every Python frame between costs the event
    loop on every streamed token."""
    backend = getattr(tok, "backend", None)
    if backend is not None and hasattr(backend, "decode"):
        return functools.partial(backend.decode, skip_special_tokens=skip_special)
    return lambda ids: decode(tok, ids, skip_special)


class Inbox:
    """One request's items from the engine's steps (put by the engine loop's delivery), read by its one task; also
    GONE / ENDED. asyncio.Queue with one reader, minus its getter bookkeeping: about ten Python calls fewer on each
    streamed token, all paid by the event loop."""

    __slots__ = ("_items", "_waiter")

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():     # done: its reader was cancelled
            waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


def token_bytes(tok, token_id: int) -> bytes:
    read = getattr(tok, "token_bytes", None)
    return read(token_id) if read else decode(tok, [token_id], False).encode("utf-8", "replace")


@dataclass
class Plan:
    """What the route decided for a request (everything the driver needs besides the engine)."""
    kind: str                                  # "chat" | "completion"
    model: str
    prompt_ids: list[int]
    params: object                             # SamplingParams
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    stop_ids: set[int] = field(default_factory=set)   # EOS ids + stop_token_ids: never part of the text
    skip_special: bool = True                  # decode without special tokens (off when a parser needs markers)
    echo_text: str | None = None               # completions with echo: the prompt text returned first
    logprobs: int | None = None                # top alternatives per token (None: no logprobs)
    prompt_logprobs: bool = False              # completions echo + logprobs: score the prompt too
    tool_parser: type[ToolParser] | None = None
    tools: list[dict] | None = None
    parallel_tool_calls: bool = True
    reasoning: bool = False                    # split <think> text into reasoning_content
    in_reasoning: bool = False                 # the prompt opened the think block
    t_arrival: float = field(default_factory=time.perf_counter)


class Choice:
    """One choice's text pipeline: tokens -> text -> (reasoning, content, tool-call deltas), and its logprobs."""

    def __init__(self, index: int, plan: Plan, tok):
        self.index, self.plan, self.tok = index, plan, tok
        self.text = TextStream(text_decoder(tok, plan.skip_special), plan.stop, plan.prompt_ids)
        self.splitter = ReasoningSplitter(plan.in_reasoning) if plan.reasoning else None
        self.tools = (ToolCallStream(plan.tool_parser(plan.tools), plan.parallel_tool_calls)
                      if plan.tool_parser else None)
        self.finish: str | None = None
        self.n_tokens = 0
        self.drafted = self.accepted = 0   # speculative decoding: tokens drafted / accepted (engine totals)
        self.reasoning, self.content = [], []
        self.logprobs: list = []         # TokenLogprobs of generated tokens (all of them)
        self.pending_lp: list = []       # not yet sent in a chunk

    def feed(self, item: Token) -> tuple[str, str, list[dict]]:
        """-> (reasoning piece, content piece, tool-call deltas) this token releases."""
        self.n_tokens += 1
        self.drafted, self.accepted = getattr(item, "drafted", 0), getattr(item, "accepted", 0)
        last = item.finish_reason is not None
        if item.logprobs is not None:
            self.logprobs.append(item.logprobs)
            self.pending_lp.append(item.logprobs)
        if last and item.finish_reason == "stop" and item.token in self.plan.stop_ids:
            piece = self.text.finish()                     # EOS / a stop token id is not text
        else:
            piece = self.text.push(item.token, last=last)
        if self.text.stopped:
            self.finish = "stop"
        elif last:
            self.finish = item.finish_reason
        return self._route(piece, final=self.finish is not None)

    def _route(self, piece: str, final: bool) -> tuple[str, str, list[dict]]:
        reasoning, content = (self.splitter.push(piece, final) if self.splitter else ("", piece))
        deltas: list[dict] = []
        if self.tools is not None:
            content, deltas = self.tools.push(content, final)
        if reasoning:
            self.reasoning.append(reasoning)
        if content:
            self.content.append(content)
        return reasoning, content, deltas

    @property
    def finish_reason(self) -> str | None:
        if self.finish == "stop" and self.tools is not None and self.tools.calls:
            return "tool_calls"
        return self.finish

    # -- logprobs in the two wire formats ------------------------------------------------------------------------
    def _token_str(self, t: int) -> str:
        return decode(self.tok, [t], False)

    def chat_logprobs(self, entries) -> R.ChatLogprobs:
        out = []
        for e in entries:
            top = [R.TopLogprob(token=self._token_str(t), logprob=lp, bytes=list(token_bytes(self.tok, t)))
                   for t, lp in e.top]
            out.append(R.ChatTokenLogprob(token=self._token_str(e.token), logprob=e.logprob,
                                          bytes=list(token_bytes(self.tok, e.token)), top_logprobs=top))
        return R.ChatLogprobs(content=out)

    def completion_logprobs(self, entries, prompt_entries=None, offset: int = 0) -> R.CompletionLogprobs:
        """prompt_entries (echo): one per prompt token after the first; the first prompt token has null."""
        lp = R.CompletionLogprobs()
        rows = []
        if prompt_entries is not None:
            rows.append((self.plan.prompt_ids[0], None, None))
            rows += [(e.token, e.logprob, e.top) for e in prompt_entries]
        rows += [(e.token, e.logprob, e.top) for e in entries]
        for t, logprob, top in rows:
            s = self._token_str(t)
            lp.tokens.append(s)
            lp.token_logprobs.append(logprob)
            if logprob is None:
                lp.top_logprobs.append(None)
            else:   # the top alternatives and the token itself (as vLLM does), by their text
                d = {self._token_str(a): b for a, b in top}
                d.setdefault(s, logprob)
                lp.top_logprobs.append(d)
            lp.text_offset.append(offset)
            offset += len(s)
        return lp


class Generation:
    """Drives one request from submit to the last byte (one per HTTP request)."""

    def __init__(self, state, plan: Plan, request):
        self.state, self.plan, self.request = state, plan, request
        self.engine = state.engine
        self.tok = self.engine.tokenizer
        self.rid = R.new_id(plan.kind)
        self.created = R.now()
        n = getattr(plan.params, "n", 1)
        self.choices = [Choice(i, plan, self.tok) for i in range(n)]
        self.queue = Inbox()
        self.handle = None
        self.done = False
        self.prompt_lp = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self._frame: list[tuple[str, str]] | None = None

    # -- engine side --------------------------------------------------------------------------------------------
    def submit(self) -> None:
        self.state.metrics.prompt_tokens.inc(len(self.plan.prompt_ids))
        self.state.metrics.prompt_len.observe(len(self.plan.prompt_ids))
        self.handle = self.state.engine_loop.submit(self.rid, self.plan.prompt_ids, self.plan.params,
                                                      sink=self.queue)
        self.state.generations.add(self)
        if self.state.stopping:        # submitted after the drain timeout: ends at once
            self.end()

    def end(self) -> None:
        """Stop waiting for the engine: the request ends with a 503 (the server is shutting down)."""
        if not self.done:
            self.queue.put_nowait(ENDED)

    async def items(self):
        """Engine items (Token) until every choice finished; raises ClientGone / ApiError."""
        metrics = self.state.metrics
        while not self.done:
            batch = await self.queue.get()
            if batch is GONE:
                raise ClientGone()
            if batch is ENDED:
                self.abort()
                raise ApiError(503, "the server shut down before this request finished (its drain timeout passed); "
                                    "retry it", "service_unavailable", "shutting_down")
            for item in batch:
                if isinstance(item, BaseException):
                    self.done = True
                    metrics.finished.labels("error").inc()
                    if isinstance(item, ValueError):   # the engine refused the request (e.g. over its context)
                        raise ApiError(400, str(item), code="invalid_request")
                    raise ApiError(500, str(item), "server_error", "engine_error")
                choice = self.choices[item.index]
                if choice.finish is not None:
                    continue                           # a choice stopped by a stop string: the rest is dropped
                now = item.t or time.perf_counter()
                if self.t_first is None:
                    self.t_first = now
                    metrics.ttft.observe(now - self.plan.t_arrival)
                elif self.t_last is not None:
                    metrics.itl.observe(max(now - self.t_last, 0.0))
                self.t_last = now
                metrics.generated_tokens.inc()
                if item.prompt_logprobs is not None and self.prompt_lp is None:
                    self.prompt_lp = item.prompt_logprobs
                yield choice, item
                if choice.finish is not None and item.finish_reason is None:
                    self.state.engine_loop.abort(self.rid, choice.index if len(self.choices) > 1 else None)
                if all(c.finish is not None for c in self.choices):
                    self.done = True
                    break

    def abort(self) -> None:
        if not self.done:
            self.done = True
            if self.handle is not None:
                self.state.engine_loop.abort(self.rid)
            self.state.metrics.finished.labels("abort").inc()

    # -- the end: metrics, timings, log ---------------------------------------------------------------------------
    def finished(self) -> R.Timings:
        m, plan, h = self.state.metrics, self.plan, self.handle
        n = sum(c.n_tokens for c in self.choices)
        for c in self.choices:
            m.finished.labels(c.finish or "error").inc()
            m.success.labels(c.finish_reason or "error").inc()
            m.gen_len.observe(c.n_tokens)
        t_first = self.t_first or time.perf_counter()
        t_last = self.t_last or t_first
        admitted = h.admitted_at or h.submitted_at
        m.e2e.observe(t_last - plan.t_arrival)
        m.queue.observe(admitted - h.submitted_at)
        m.prefill.observe(max(t_first - admitted, 0.0))
        m.decode.observe(t_last - t_first)
        per_choice = max(c.n_tokens for c in self.choices)
        if per_choice > 1:
            m.tpot.observe((t_last - t_first) / (per_choice - 1))
        prompt_s, gen_s = max(t_first - admitted, 1e-9), t_last - t_first
        steps = max(per_choice - 1, 1)
        t = R.Timings(queue_ms=(admitted - h.submitted_at) * 1e3, prompt_n=len(plan.prompt_ids),
                      prompt_ms=prompt_s * 1e3, prompt_per_token_ms=prompt_s * 1e3 / len(plan.prompt_ids),
                      prompt_per_second=len(plan.prompt_ids) / prompt_s, predicted_n=n, predicted_ms=gen_s * 1e3,
                      predicted_per_token_ms=gen_s * 1e3 / steps,
                      predicted_per_second=(per_choice - 1) * len(self.choices) / gen_s if gen_s > 0 else 0.0)
        drafted = sum(c.drafted for c in self.choices)
        if drafted:                                  # speculative decoding (llama-server's names)
            t.draft_n, t.draft_n_accepted = drafted, sum(c.accepted for c in self.choices)
        if self.state.log_timings:
            print(f"ktrun serve: {self.rid} prompt {t.prompt_n} tok in {t.prompt_ms:.1f} ms "
                  f"(queue {t.queue_ms:.1f} ms), generated {n} tok in {t.predicted_ms:.1f} ms "
                  f"({t.predicted_per_second:.1f} tok/s"
                  + (f", {t.draft_n_accepted}/{t.draft_n} drafted accepted" if drafted else "") + "), finish "
                  f"{','.join(str(c.finish_reason) for c in self.choices)}", file=sys.stderr, flush=True)
        return t

    def usage(self) -> R.Usage:
        """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache supplied (not
        prefilled; set by the engine loop before the request's first token went out)."""
        cached = self.handle.cached_tokens if self.handle is not None else 0
        return R.usage(len(self.plan.prompt_ids), sum(c.n_tokens for c in self.choices), cached)

    # -- non-streaming ----------------------------------------------------------------------------------------
    async def run(self, each=None) -> R.Timings:
        """Non-streamed: submit, feed every token to its choice until all finished (each(choice, pieces) sees what
        each token released), watching the connection; -> timings. The Responses and Messages APIs build their own
        answers from the choices."""
        watcher = asyncio.ensure_future(self._watch_disconnect())
        self.submit()
        try:
            async for choice, item in self.items():
                pieces = choice.feed(item)
                if each is not None:
                    each(choice, pieces)
        except ClientGone:
            self.abort()
            raise
        finally:
            watcher.cancel()
        return self.finished()

    async def collect(self):
        timings = await self.run()
        if self.plan.kind == "chat":
            return R.ChatCompletionResponse(id=self.rid, created=self.created, model=self.plan.model,
                                            choices=[self._chat_choice(c) for c in self.choices],
                                            usage=self.usage(), timings=timings)
        return R.CompletionResponse(id=self.rid, created=self.created, model=self.plan.model,
                                    choices=[self._completion_choice(c) for c in self.choices],
                                    usage=self.usage(), timings=timings)

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.queue.put_nowait(GONE)
                return

    def _chat_choice(self, c: Choice) -> R.ChatChoice:
        calls = c.tools.calls if c.tools is not None else []
        content = "".join(c.content)    # none beside reasoning or tool calls is null (as OpenAI / vLLM send it)
        msg = R.AssistantMessage(content=content or (None if (c.reasoning or calls) else ""))
        if self.plan.reasoning:
            msg.reasoning_content = "".join(c.reasoning) if c.reasoning else None
        if calls:
            msg.tool_calls = [R.ToolCallOut(id=x["id"], function=R.FunctionCallOut(**x["function"])) for x in calls]
        out = R.ChatChoice(index=c.index, message=msg, finish_reason=c.finish_reason)
        out.logprobs = c.chat_logprobs(c.logprobs) if self.plan.logprobs is not None else None
        return out

    def _completion_choice(self, c: Choice) -> R.CompletionChoice:
        text = "".join(c.content)
        echo = self.plan.echo_text
        out = R.CompletionChoice(index=c.index, text=(echo or "") + text, finish_reason=c.finish_reason)
        if self.plan.logprobs is not None:
            out.logprobs = c.completion_logprobs(c.logprobs, self.prompt_lp if self.plan.prompt_logprobs else None)
        else:
            out.logprobs = None
        return out

    # -- streaming ----------------------------------------------------------------------------------------------
    def _text_chunk(self, index: int, text: str) -> bytes:
        """The common chunk (one choice's new text, nothing else) from pre-rendered JSON around the text: the same
        bytes as R.CompletionResponse / R.ChatCompletionChunk would give, without building models per token."""
        if self._frame is None:
            plain = (R.ChatCompletionChunk if self.plan.kind == "chat" else R.CompletionResponse)(
                id=self.rid, created=self.created, model=self.plan.model, choices=[])
            if self.plan.include_usage:
                plain.usage = None
            head, tail = plain.model_dump_json(exclude_unset=True).split('"choices":[]')
            field = '"delta":{"content":' if self.plan.kind == "chat" else '"text":'
            close = "}" if self.plan.kind == "chat" else ""
            end = f'{close},"logprobs":null,"finish_reason":null}}]{tail}\n\n'
            self._frame = [(f'data: {head}"choices":[{{"index":{i},{field}', end) for i in range(len(self.choices))]
        head, tail = self._frame[index]
        # what json.dumps(text, ensure_ascii=False) returns, without building a JSONEncoder for every token
        return (head + encode_basestring(text) + tail).encode()

    def _chunk(self, choices: list, usage: R.Usage | None = None, timings=None) -> bytes:
        cls = R.ChatCompletionChunk if self.plan.kind == "chat" else R.CompletionResponse
        obj = cls(id=self.rid, created=self.created, model=self.plan.model, choices=choices)
        if self.plan.kind == "completion":
            obj.object = "text_completion"
        if self.plan.include_usage:
            obj.usage = usage
        if timings is not None:
            obj.timings = timings
        return obj.sse()

    def _delta_choice(self, c: Choice, reasoning="", content="", tool_deltas=(), role=False, finish=False):
        if self.plan.kind == "chat":
            d = R.Delta()
            if role:
                d.role, d.content = "assistant", ""
            if content:
                d.content = content
            if reasoning:
                d.reasoning_content = reasoning
            if tool_deltas:
                d.tool_calls = [R.DeltaToolCall(index=x["index"], id=x.get("id"), type=x.get("type"),
                                                function=R.DeltaFunction(**x["function"])) for x in tool_deltas]
                for x, tc in zip(tool_deltas, d.tool_calls):   # only what this delta carries
                    for k in ("id", "type"):
                        if k not in x:
                            tc.__pydantic_fields_set__.discard(k)
            ch = R.ChatChunkChoice(index=c.index, delta=d, finish_reason=c.finish_reason if finish else None)
            ch.logprobs = None
            if c.pending_lp and self.plan.logprobs is not None:
                ch.logprobs, c.pending_lp = c.chat_logprobs(c.pending_lp), []
            return ch
        ch = R.CompletionChoice(index=c.index, text=content, finish_reason=c.finish_reason if finish else None)
        ch.logprobs = None
        if c.pending_lp and self.plan.logprobs is not None:
            ch.logprobs, c.pending_lp = c.completion_logprobs(c.pending_lp), []
        return ch

    async def stream(self):
        """The SSE body: chunks as text comes, then the finish chunk(s), usage (if asked), [DONE]."""
        try:
            if self.plan.kind == "chat":   # the role goes out at once, before the first token
                yield self._chunk([self._delta_choice(c, role=True) for c in self.choices])
            # submitted only now, with the headers (and the role) out: from here on this request just waits, so the
            # prefill (in the engine loop's worker thread) has the interpreter to itself
            self.submit()
            try:
                async for c, item in self.items():
                    reasoning, content, tool_deltas = c.feed(item)
                    if content and not (reasoning or tool_deltas or c.pending_lp):
                        yield self._text_chunk(c.index, content)
                    elif reasoning or content or tool_deltas:
                        yield self._chunk([self._delta_choice(c, reasoning, content, tool_deltas)])
            except ApiError as e:          # headers are out: report the error as an event, then end the stream
                yield R.sse(e.body()) + R.sse("[DONE]")
                return
            timings = self.finished()
            events = b"".join(self._chunk([self._delta_choice(c, finish=True)]) for c in self.choices)
            if self.plan.include_usage:
                u = R.ChatCompletionChunk if self.plan.kind == "chat" else R.CompletionResponse
                last = u(id=self.rid, created=self.created, model=self.plan.model, choices=[], usage=self.usage(),
                         timings=timings)
                if self.plan.kind == "completion":
                    last.object = "text_completion"
                events += last.sse()
            yield events + R.sse("[DONE]")
        finally:
            self.abort()   # no-op when finished; a cancelled stream (client gone) frees its slot here
