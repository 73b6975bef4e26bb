"""Reasoning text (`<think>...</think>`) split from the answer, for `message.reasoning_content` (and the streamed
`delta.reasoning_content`), as DeepSeek-R1 / V3.1 (thinking), Qwen3, GLM-4.5 and Kimi-K2-Thinking write it.

Two ways a think block opens: the chat template already wrote `<think>` at the end of the prompt (DeepSeek-R1's and
V3.1-thinking's templates do; Qwen3's with enable_thinking writes none, and `<think>\\n\\n</think>` without), so the
output starts inside it; or the output itself starts with `<think>`. Either way, everything up to `</think>` is
reasoning and the rest is the answer. A tail that could be the start of a marker waits for the next piece.
"""
from __future__ import annotations

from .text_markers import partial_tail

THINK_START, THINK_END = "<think>", "</think>"


def prompt_opens_thinking(prompt_text: str, start: str = THINK_START, end: str = THINK_END) -> bool:
    """The rendered prompt ends inside a think block (the template opened it and did not close it)."""
    i = prompt_text.rfind(start)
    return i >= 0 and prompt_text.find(end, i) < 0 and not prompt_text[i + len(start):].strip()


def uses_thinking(vocab: dict[str, int], template: str | None) -> bool:
    """The model writes think blocks: `<think>` is a token of its own, or its chat template mentions one."""
    marks = (THINK_START, THINK_END)
    return any(m in vocab for m in marks) or any(m in (template or "") for m in marks)


class ReasoningSplitter:
    """push(text) -> (reasoning piece, content piece); finish() -> the rest. Concatenated, the pieces are exactly
    the input without the two markers."""

    def __init__(self, in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END):
        self.start, self.end = start, end
        self.state = "reasoning" if in_reasoning else "opening"   # opening: the output may start with <think>
        self.buf = ""

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        if self.state == "opening":
            lead = self.buf.lstrip()
            if lead.startswith(self.start):
                self.state, self.buf = "reasoning", lead[len(self.start):]
            elif self.start.startswith(lead) and not final:
                return "", ""                                      # "<thi": wait for more
            else:
                self.state = "content"
        if self.state == "reasoning":
            i = self.buf.find(self.end)
            if i >= 0:
                reasoning, self.buf = self.buf[:i], self.buf[i + len(self.end):]
                self.state = "content"
            else:
                keep = 0 if final else partial_tail(self.buf, self.end)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        if self.state == "content":
            content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.push("", final=True)

    @property
    def in_reasoning(self) -> bool:
        return self.state != "content"
