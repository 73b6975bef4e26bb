"""The Responses API's answers (`POST /v1/responses`): one chat Generation (routes.prepare) read out as a response
object with output items (reasoning, message, function_call), whole or as OpenAI's typed SSE events:

    response.created, response.in_progress
    per item: response.output_item.added, [response.content_part.added], deltas
              (response.reasoning_text.delta / response.output_text.delta / response.function_call_arguments.delta),
              their .done, [response.content_part.done], response.output_item.done
    response.completed (or response.incomplete when max_output_tokens ran out)

An error once the stream has started is an `error` event then `response.failed`. A finished response is stored
(unless `store: false`) with its conversation for `previous_response_id` (response_store.py).
"""
from __future__ import annotations

import json
import uuid

from starlette.responses import JSONResponse, Response, StreamingResponse

from ..defaults import API_TEMPERATURE, API_TOP_P
from .generation import ClientGone, Generation
from .output_blocks import Block, BlockSequence
from .protocol import ApiError
from .response_store import ResponseStore
from .responses import now
from .responses_request import ResponsesRequest

PREFIX = {"reasoning": "rs_", "text": "msg_", "tool": "fc_"}


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _count_tokens(tok, text: str) -> int:
    if not text:
        return 0
    try:
        out = tok.encode(text, add_special_tokens=False)
    except TypeError:
        out = tok.encode(text)
    return len(getattr(out, "ids", out))


class ResponsesAnswer:
    """One /v1/responses request from its Generation to the last byte."""

    def __init__(self, gen: Generation, body: ResponsesRequest, conversation: list[dict], store: ResponseStore):
        self.gen, self.body, self.conversation, self.store = gen, body, conversation, store
        self.id, self.created = _id("resp_"), now()
        gen.rid = self.id          # the engine's request id and the timings log line: the id the client sees
        self.seq = BlockSequence()
        self.item_ids: dict[int, str] = {}
        self.seqno = 0

    async def answer(self) -> Response:
        if self.body.stream:
            return StreamingResponse(self.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self.collect()

    # -- the response object -------------------------------------------------------------------------------------
    def _response(self, status: str, output: list[dict], usage: dict | None = None, **extra) -> dict:
        b = self.body
        fmt = (b.text.format if b.text is not None else None) or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": None, "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "model": b.model, "output": output, "parallel_tool_calls": b.parallel_tool_calls,
                "previous_response_id": b.previous_response_id, "reasoning": b.reasoning or {"effort": None},
                "store": b.store, "temperature": API_TEMPERATURE if b.temperature is None else b.temperature,
                "text": {"format": fmt}, "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
                "top_p": API_TOP_P if b.top_p is None else b.top_p, "truncation": "disabled", "usage": usage,
                "user": b.user, "metadata": b.metadata or {}, **extra}

    def _item_id(self, block: Block) -> str:
        return self.item_ids.setdefault(block.index, _id(PREFIX[block.kind]))

    def _item(self, block: Block, status: str) -> dict:
        iid = self._item_id(block)
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": iid, "summary": [],
                    "content": [{"type": "reasoning_text", "text": block.text}]}
        if block.kind == "text":
            return {"type": "message", "id": iid, "status": status, "role": "assistant",
                    "content": [self._part(block)]}
        return {"type": "function_call", "id": iid, "call_id": block.call_id, "name": block.name,
                "arguments": block.text, "status": status}

    @staticmethod
    def _part(block: Block) -> dict:
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": block.text}
        return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}

    def _finish(self) -> dict:
        """The finished response (stored unless store: false)."""
        choice = self.gen.choices[0]
        incomplete = choice.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        last = self.seq.blocks[-1] if self.seq.blocks else None   # only the item max_output_tokens cut is incomplete
        output = [self._item(b, status if b is last else "completed") for b in self.seq.blocks]
        u = self.gen.usage()
        reasoning = "".join(b.text for b in self.seq.blocks if b.kind == "reasoning")
        usage = {"input_tokens": u.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens,
                                          "cache_write_tokens": 0},
                 "output_tokens": u.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": _count_tokens(self.gen.tok, reasoning)},
                 "total_tokens": u.total_tokens}
        resp = self._response(status, output, usage, completed_at=None if incomplete else now())
        if incomplete:
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.body.store:
            self.store.put(resp, self.conversation + [self._assistant_message()])
        return resp

    def _assistant_message(self) -> dict:
        """This turn's output as the chat message the next turn's template renders."""
        blocks = self.seq.blocks
        text = "".join(b.text for b in blocks if b.kind == "text")
        calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
                 for b in blocks if b.kind == "tool"]
        msg: dict = {"role": "assistant", "content": text or (None if calls else "")}
        reasoning = "".join(b.text for b in blocks if b.kind == "reasoning")
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg

    # -- non-streamed ---------------------------------------------------------------------------------------------
    async def collect(self) -> Response:
        try:
            await self.gen.run(lambda c, pieces: self.seq.push(*pieces))
        except ClientGone:
            return Response(status_code=499)
        self.seq.ensure_one()
        self.seq.close()
        return JSONResponse(self._finish())

    # -- streamed -------------------------------------------------------------------------------------------------
    def _event(self, type_: str, **fields) -> bytes:
        data = {"type": type_, "sequence_number": self.seqno, **fields}
        self.seqno += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    def _block_events(self, events: list[tuple], final_status: str = "completed") -> bytes:
        out = []
        for ev in events:
            kind, block = ev[0], ev[1]
            at = {"item_id": self._item_id(block), "output_index": block.index}
            if kind == "start":
                item = self._item(block, "in_progress")
                if block.kind != "tool":
                    item["content"] = []
                out.append(self._event("response.output_item.added", output_index=block.index, item=item))
                if block.kind != "tool":
                    out.append(self._event("response.content_part.added", **at, content_index=0,
                                           part=self._part(block)))
            elif kind == "delta":
                if block.kind == "reasoning":
                    out.append(self._event("response.reasoning_text.delta", **at, content_index=0, delta=ev[2]))
                elif block.kind == "text":
                    out.append(self._event("response.output_text.delta", **at, content_index=0, delta=ev[2],
                                           logprobs=[]))
                else:
                    out.append(self._event("response.function_call_arguments.delta", **at, delta=ev[2]))
            else:
                if block.kind == "reasoning":
                    out.append(self._event("response.reasoning_text.done", **at, content_index=0, text=block.text))
                elif block.kind == "text":
                    out.append(self._event("response.output_text.done", **at, content_index=0, text=block.text,
                                           logprobs=[]))
                else:
                    out.append(self._event("response.function_call_arguments.done", **at, name=block.name,
                                           arguments=block.text))
                if block.kind != "tool":
                    out.append(self._event("response.content_part.done", **at, content_index=0,
                                           part=self._part(block)))
                out.append(self._event("response.output_item.done", output_index=block.index,
                                       item=self._item(block, final_status)))
        return b"".join(out)

    async def stream(self):
        gen = self.gen
        try:
            yield (self._event("response.created", response=self._response("in_progress", []))
                   + self._event("response.in_progress", response=self._response("in_progress", [])))
            gen.submit()   # after the first bytes, as chat streams do: the prefill gets the interpreter
            try:
                async for c, item in gen.items():
                    out = self._block_events(self.seq.push(*c.feed(item)))
                    if out:
                        yield out
            except ApiError as e:   # headers are out: the error as events, then the end
                error = {"code": e.code or e.type, "message": e.message}
                yield (self._event("error", code=e.code, message=e.message, param=e.param)
                       + self._event("response.failed", response=self._response(
                           "failed", [self._item(b, "incomplete") for b in self.seq.blocks], error=error)))
                return
            gen.finished()
            status = "incomplete" if gen.choices[0].finish_reason == "length" else "completed"
            tail = self._block_events(self.seq.ensure_one()) + self._block_events(self.seq.close(), status)
            final = self._finish()
            yield tail + self._event(f"response.{final['status']}", response=final)
        finally:
            gen.abort()   # no-op when finished; a cancelled stream (client gone) frees its slot here
