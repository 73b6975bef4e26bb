"""Anthropic's Messages API answers (`POST /v1/messages`): one chat Generation (routes.prepare) read out as a
message with content blocks (thinking, text, tool_use), whole or as Anthropic's SSE events:

    message_start, ping
    per block: content_block_start, content_block_delta (thinking_delta / text_delta / input_json_delta),
               content_block_stop
    message_delta (stop_reason end_turn / max_tokens / stop_sequence / tool_use, stop_sequence, usage), message_stop

An error once the stream has started is an `error` event (Anthropic's envelope). Usage follows Anthropic:
input_tokens are the prompt tokens the prefix cache did not supply, cache_read_input_tokens those it did.
"""
from __future__ import annotations

import json
import uuid

from starlette.responses import JSONResponse, Response, StreamingResponse

from .anthropic_errors import anthropic_error
from .generation import Choice, ClientGone, Generation
from .messages_request import MessagesRequest
from .output_blocks import Block, BlockSequence
from .protocol import ApiError


def tool_use_id(call_id: str | None) -> str:
    """The parsers' OpenAI-style call ids ("call_...") in Anthropic's form ("toolu_..."); family-given ids stay."""
    call_id = call_id or ""
    return "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id


def tool_input(arguments: str) -> dict:
    """A tool call's arguments as the input object; text that is not a JSON object is kept under "arguments"."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def stop_reason(choice: Choice) -> tuple[str, str | None]:
    """-> (stop_reason, stop_sequence)."""
    if choice.finish_reason == "tool_calls":
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.text.stopped:
        return "stop_sequence", choice.text.stop_string
    return "end_turn", None


class MessagesAnswer:
    """One /v1/messages request from its Generation to the last byte."""

    def __init__(self, gen: Generation, body: MessagesRequest):
        self.gen, self.body = gen, body
        self.id = "msg_" + uuid.uuid4().hex
        gen.rid = self.id          # the engine's request id and the timings log line: the id the client sees
        self.seq = BlockSequence()

    async def answer(self) -> Response:
        if self.body.stream:
            return StreamingResponse(self.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self.collect()

    def _usage(self) -> dict:
        u = self.gen.usage()
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        return {"input_tokens": u.prompt_tokens - cached, "output_tokens": u.completion_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    @staticmethod
    def _block(block: Block, whole: bool = True) -> dict:
        """A content block: whole (the non-streamed answer) or as content_block_start opens it (empty)."""
        if block.kind == "reasoning":
            return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
        if block.kind == "text":
            return {"type": "text", "text": block.text if whole else ""}
        return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name,
                "input": tool_input(block.text) if whole else {}}

    def _message(self, content: list[dict], reason: str | None, sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.body.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    # -- non-streamed ---------------------------------------------------------------------------------------------
    async def collect(self) -> Response:
        try:
            await self.gen.run(lambda c, pieces: self.seq.push(*pieces))
        except ClientGone:
            return Response(status_code=499)
        self.seq.ensure_one()
        self.seq.close()
        reason, sequence = stop_reason(self.gen.choices[0])
        return JSONResponse(self._message([self._block(b) for b in self.seq.blocks], reason, sequence,
                                          self._usage()))

    # -- streamed -------------------------------------------------------------------------------------------------
    @staticmethod
    def _event(type_: str, **fields) -> bytes:
        data = json.dumps({"type": type_, **fields}, ensure_ascii=False, separators=(",", ":"))
        return f"event: {type_}\ndata: {data}\n\n".encode()

    def _block_events(self, events: list[tuple]) -> bytes:
        out = []
        for ev in events:
            kind, block = ev[0], ev[1]
            if kind == "start":
                out.append(self._event("content_block_start", index=block.index,
                                       content_block=self._block(block, whole=False)))
            elif kind == "delta":
                delta = ({"type": "thinking_delta", "thinking": ev[2]} if block.kind == "reasoning" else
                         {"type": "text_delta", "text": ev[2]} if block.kind == "text" else
                         {"type": "input_json_delta", "partial_json": ev[2]})
                out.append(self._event("content_block_delta", index=block.index, delta=delta))
            else:
                out.append(self._event("content_block_stop", index=block.index))
        return b"".join(out)

    async def stream(self):
        gen = self.gen
        try:
            start = self._message([], None, None, {"input_tokens": len(gen.plan.prompt_ids), "output_tokens": 0})
            yield self._event("message_start", message=start) + self._event("ping")
            gen.submit()   # after the first bytes, as chat streams do: the prefill gets the interpreter
            try:
                async for c, item in gen.items():
                    out = self._block_events(self.seq.push(*c.feed(item)))
                    if out:
                        yield out
            except ApiError as e:   # headers are out: the error as an event, then the end
                yield self._event("error", error=anthropic_error(e.status, e.message)["error"])
                return
            gen.finished()
            tail = self._block_events(self.seq.ensure_one()) + self._block_events(self.seq.close())
            reason, sequence = stop_reason(gen.choices[0])
            # usage on message_delta is cumulative: input_tokens / cache_read_input_tokens are known only now
            yield (tail + self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                      usage=self._usage())
                   + self._event("message_stop"))
        finally:
            gen.abort()   # no-op when finished; a cancelled stream (client gone) frees its slot here
