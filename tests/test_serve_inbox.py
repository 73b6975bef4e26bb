"""The event loop's per-token helpers of serve.generation: Inbox behaves as asyncio.Queue does for its one reader
(order, waiting, a cancelled reader), and text_decoder gives decode()'s text."""
from __future__ import annotations

import asyncio
from pathlib import Path

from ktrun.serve.generation import Inbox, decode, text_decoder
from ktrun.text.tokenizer import Tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "ktconvert" / "data" / "default_model"


def test_inbox_keeps_order_and_wakes_its_reader():
    async def main():
        box = Inbox()
        box.put_nowait(1)
        box.put_nowait(2)
        assert [await box.get(), await box.get()] == [1, 2]
        reader = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        assert not reader.done()
        box.put_nowait(3)
        assert await asyncio.wait_for(reader, 1) == 3
        cancelled = asyncio.ensure_future(box.get())          # a reader cancelled while it waits (client gone)
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        box.put_nowait(4)                                      # nothing raises; the item waits for the next get
        assert await asyncio.wait_for(box.get(), 1) == 4

    asyncio.run(main())


def test_text_decoder_gives_decodes_text():
    tok = Tokenizer(DEFAULT_MODEL)
    ids = tok.encode("def f(x):\n    return x  # é 日本 <tab>\t") + [0, 1]
    for skip in (True, False):
        fast = text_decoder(tok, skip)
        for a in range(0, len(ids), 3):
            for b in range(a, len(ids) + 1, 2):
                assert fast(ids[a:b]) == decode(tok, ids[a:b], skip)
