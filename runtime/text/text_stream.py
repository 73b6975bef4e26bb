"""Generated token ids -> text, and the one stop-string rule of ktrun: `generate()`, the Engine and `ktrun serve`'s
streaming all decide "a stop string was generated" and "this text may be shown now" with a TextStream.

Decoding token by token breaks multi-byte characters and word-initial spaces, so a delta is the difference between
decoding a short window of ids with and without the new tokens (the window starts a few prompt tokens back, so the
first generated token decodes with its left context). Text that ends in an incomplete character (U+FFFD) waits for
the next token. A stop string ends the text before it (OpenAI semantics: the stop string is not returned); text that
could be the start of a stop string is held back until it is known not to be one, so a streamed client never sees
part of a stop string. Torch-free: the server's handler threads and its test fakes use it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

PROMPT_CONTEXT_TOKENS = 4  # prompt tokens kept as left context for decoding the first generated tokens


class TextStream:
    """Per request: push(token) -> text to show now; finish() (or push(token, last=True)) -> the rest; `stopped`:
    a stop string was generated (the text ends before it and nothing more comes out)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 prompt_ids: Sequence[int] = ()):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0               # window start in _ids
        self._read = len(self._ids)    # ids before this are already in _text
        self._text = ""                # generated text decoded so far
        self._sent = 0                 # characters of _text already handed out
        self.stopped = False           # a stop string was found; the text ends before it
        self.stop_string: str | None = None   # which one (Anthropic's stop_sequence names it)

    @property
    def text(self) -> str:
        """Text handed out so far (after `finish()`: the whole completion)."""
        return self._text[: self._sent]

    def push(self, token: int, last: bool = False) -> str:
        """Add one generated token; return the text that can be sent now (maybe empty). last: no token follows
        (EOS, max_tokens, context full): the rest of the text goes out too, as finish() hands it out."""
        if self.stopped:
            return ""
        if last:
            delta = self.push(token)
            return delta + self.finish()
        self._ids.append(int(token))
        before = self._decode(self._ids[self._prefix: self._read])
        after = self._decode(self._ids[self._prefix:])
        new = after[len(before):]
        if new and not after.endswith("\ufffd"):
            self._text += new
            self._prefix, self._read = self._read, len(self._ids)
            new = ""
        # an incomplete character at the end waits for the next token, but the stop strings see it already
        return self._release(final=False, pending=new)

    def finish(self) -> str:
        """End of generation: flush held-back text (incomplete characters included); return the last delta."""
        if not self.stopped and self._read < len(self._ids):
            before = self._decode(self._ids[self._prefix: self._read])
            after = self._decode(self._ids[self._prefix:])
            self._text += after[len(before):]
            self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool, pending: str = "") -> str:
        """Find stop strings in the text + `pending` (decoded ids that end in an incomplete character); hand out
        the text that cannot be part of a stop string (all of it when final or stopped)."""
        if self.stopped:
            return ""
        if self._stop:
            text = self._text + pending
            start = max(0, self._sent - max(map(len, self._stop)))   # older text was checked (and sent) already
            hits = [(i, s) for s in self._stop for i in (text.find(s, start),) if i >= 0]
            if hits:
                first, self.stop_string = min(hits, key=lambda h: h[0])
                self._text = text[:first]
                self.stopped = True
                final = True
        end = len(self._text) if final else len(self._text) - self._held_back()
        end = max(end, self._sent)
        delta, self._sent = self._text[self._sent: end], end
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best
