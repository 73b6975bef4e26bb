"""Stored responses of the Responses API, for `previous_response_id` (and GET /v1/responses/{id}): in memory, bounded.

Each entry is a finished response and the conversation it ends: the chat messages of every earlier turn, this turn's
input and its output (instructions are not carried over, as OpenAI's API does not). Bounded twice, least recently
used first out: at most `max_entries` responses and `max_bytes` of their JSON text, so a server that runs for days
never grows past the bound whatever its clients send. Nothing is written to disk: a restart forgets every response.
One event loop uses it (no lock).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 256 << 20


@dataclass
class Stored:
    response: dict           # the response object as it was returned
    messages: list[dict]     # the conversation up to and including this response (chat messages)
    size: int


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, messages: list[dict]) -> None:
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(messages, ensure_ascii=False))
        if size > self.max_bytes:      # bigger than the whole store: kept nowhere (a follow-up gets a 404)
            return
        self.pop(response["id"])
        self._items[response["id"]] = Stored(response, messages, size)
        self.bytes += size
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, response_id: str) -> Stored | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)    # used: the last to go
        return item

    def pop(self, response_id: str) -> Stored | None:
        item = self._items.pop(response_id, None)
        if item is not None:
            self.bytes -= item.size
        return item
