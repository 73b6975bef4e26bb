"""One choice's output as a sequence of blocks, for the APIs whose answers are lists of typed parts: the Responses
API's output items (reasoning, message, function_call) and the Messages API's content blocks (thinking, text,
tool_use).

Each token releases (reasoning piece, content piece, tool-call deltas) from generation.Choice.feed; `push` turns
them into block events in order: ("start", block), ("delta", block, text), ("stop", block). Only one block is open
at a time (both APIs stream blocks one after the other), so a piece of another kind closes the open one. The parsers
release reasoning, then content, then tool calls, so a choice has at most one block of each kind but tool calls,
one per call. Non-streamed answers are built from `blocks` after `close()`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Block:
    index: int                 # position among the choice's blocks (output_index / content block index)
    kind: str                  # "reasoning" | "text" | "tool"
    text: str = ""             # reasoning or text so far; a tool call's argument JSON text so far
    call_id: str | None = None
    name: str | None = None


class BlockSequence:
    def __init__(self):
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self._calls: dict[int, Block] = {}     # tool-call index (the chat deltas') -> its block

    def push(self, reasoning: str, content: str, tool_deltas: list[dict]) -> list[tuple]:
        events: list[tuple] = []
        if reasoning:
            events += self._append("reasoning", reasoning)
        if content:
            events += self._append("text", content)
        for d in tool_deltas:
            fn = d.get("function") or {}
            if "id" in d:                          # the first delta of a call: id and name
                events += self._start(Block(len(self.blocks), "tool", call_id=d["id"], name=fn.get("name")))
                self._calls[d["index"]] = self.open
            args = fn.get("arguments")
            if args:
                block = self._calls[d["index"]]
                block.text += args
                events.append(("delta", block, args))
        return events

    def ensure_one(self) -> list[tuple]:
        """A choice that produced nothing (EOS at once) still answers with one (empty) text block."""
        return [] if self.blocks else self._start(Block(0, "text"))

    def close(self) -> list[tuple]:
        """The end of the choice: the open block stops."""
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [("stop", block)]

    def _append(self, kind: str, piece: str) -> list[tuple]:
        events = [] if self.open is not None and self.open.kind == kind else self._start(Block(len(self.blocks), kind))
        self.open.text += piece
        return events + [("delta", self.open, piece)]

    def _start(self, block: Block) -> list[tuple]:
        events = self.close()
        self.blocks.append(block)
        self.open = block
        return events + [("start", block)]
