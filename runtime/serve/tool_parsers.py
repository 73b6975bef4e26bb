"""Tool calls in generated text -> OpenAI `tool_calls`, per model family, whole (non-streaming) or as deltas.

Every family marks a call its own way (written from the models' chat templates and model cards):

    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
                  ...<｜tool▁calls▁end｜>                                           (DeepSeek-V3, V3-0324, R1)
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    hermes        <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>      (Qwen2.5/Qwen3, Hermes)
    glm45         <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>   (GLM-4.5/4.6)
    kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS
                  <|tool_call_end|>...<|tool_calls_section_end|>

A parser reads the text generated so far (maybe cut mid-marker) and returns the plain content before the first call
and the calls seen so far, each with its arguments text so far: arguments only grow, so a stream can send what is
new. ToolCallStream turns that into OpenAI deltas; the whole text parsed once gives the same calls and content.
Text that never became a call of one of the request's tools (e.g. `<tool_call>` then junk) is content, as generated.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .text_markers import partial_tail


@dataclass
class Call:
    name: str | None          # None until the whole name is generated
    arguments: str = ""       # JSON text of the arguments so far (complete when done)
    done: bool = False
    id: str | None = None     # a family-given id (Kimi-K2), else the server makes one


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _grow(text: str, ends: tuple[str, ...]) -> str:
    """Argument text that may be sent now: without a tail that could start an end marker, and without trailing
    whitespace (the final arguments are stripped)."""
    keep = max((partial_tail(text, e) for e in ends), default=0)
    return text[:len(text) - keep].strip()


class ToolParser:
    name = ""
    start = ""                 # opens the first call (or the calls section): content is the text before it

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in (tools or [])}

    def parse(self, text: str, final: bool) -> tuple[str, list[Call]]:
        """-> (content before the calls, calls so far). Before the start marker, a tail that could begin it is held
        back from the content (until final)."""
        i = text.find(self.start)
        if i < 0:
            return (text if final else text[:len(text) - partial_tail(text, self.start)]), []
        calls = [c for c in self.calls(text[i + len(self.start):], final) if self._known(c.name)]
        if final and not calls:
            return text, []            # markers without a call of a known tool: the model's text as it is
        return text[:i], calls

    def _known(self, name: str | None) -> bool:
        """A call names one of the request's tools (any name when the parser was given none)."""
        return bool(name) and (not self.tools or name in self.tools)

    def calls(self, section: str, final: bool) -> list[Call]:
        raise NotImplementedError


class _SplitCalls(ToolParser):
    """Families whose calls sit between a begin and an end marker inside a section."""
    call_begin = ""
    call_end = ""

    def calls(self, section, final):
        out = []
        for piece in section.split(self.call_begin)[1:]:
            done = self.call_end in piece
            out.append(self.call(piece.split(self.call_end)[0], done or final))
        return out

    def call(self, body: str, done: bool) -> Call:
        raise NotImplementedError


class DeepSeekV3(_SplitCalls):
    name = "deepseek_v3"
    start = "<｜tool▁calls▁begin｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def call(self, body, done):
        if self.sep not in body:
            return Call(None, done=done)
        rest = body.split(self.sep, 1)[1]
        if "\n" not in rest:
            return Call(rest.strip() if done else None, done=done)
        name, rest = rest.split("\n", 1)
        args = rest[len("```json\n"):] if rest.startswith("```json\n") else rest.lstrip("`json\n")
        fence = args.find("\n```")
        if fence >= 0:
            return Call(name.strip(), args[:fence].strip(), True)
        return Call(name.strip(), args.strip() if done else _grow(args, ("\n```",)), done)


class DeepSeekV31(_SplitCalls):
    name = "deepseek_v31"
    start = "<｜tool▁calls▁begin｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def call(self, body, done):
        if self.sep not in body:
            return Call(body.strip() if done and body.strip() else None, done=done)
        name, args = body.split(self.sep, 1)
        return Call(name.strip(), args.strip() if done else _grow(args, (self.call_end,)), done)


class KimiK2(_SplitCalls):
    name = "kimi_k2"
    start = "<|tool_calls_section_begin|>"
    call_begin, call_end, arg_begin = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"

    def call(self, body, done):
        if self.arg_begin not in body:
            return Call(None, done=done)
        ident, args = body.split(self.arg_begin, 1)
        ident = ident.strip()                               # functions.get_weather:0
        name = ident.split(":")[0]
        name = name.removeprefix("functions.")
        return Call(name, args.strip() if done else _grow(args, (self.call_end,)), done, id=ident)


class Hermes(_SplitCalls):
    name = "hermes"
    start = "<tool_call>"
    call_begin, call_end = "<tool_call>", "</tool_call>"
    NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
    ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')

    def calls(self, section, final):
        return super().calls(self.call_begin + section, final)

    def call(self, body, done):
        m = self.NAME.search(body)
        if m is None:
            return Call(None, done=done)
        name = json.loads(f'"{m.group(1)}"')
        a = self.ARGS.search(body)
        if a is None:
            return Call(name, "{}" if done else "", done)
        args = body[a.end():]
        if done:                                            # drop the object's own closing brace
            args = args.strip()
            args = args[:-1].strip() if args.endswith("}") else args
            return Call(name, args, True)
        return Call(name, _grow(args, (self.call_end,)).rstrip("}\n\t "), False)


class Glm45(_SplitCalls):
    name = "glm45"
    start = "<tool_call>"
    call_begin, call_end = "<tool_call>", "</tool_call>"
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def calls(self, section, final):
        return super().calls(self.call_begin + section, final)

    def call(self, body, done):
        cut = [i for i in (body.find("\n"), body.find("<arg_key>")) if i >= 0]
        if not cut:
            return Call(body.strip() if done and body.strip() else None, "{}", done=done)
        name = body[:min(cut)].strip()
        pairs = [f"{json.dumps(k.strip(), ensure_ascii=False)}: {self._value(name, k.strip(), v)}"
                 for k, v in self.PAIR.findall(body)]
        args = "{" + ", ".join(pairs)
        return Call(name, args + "}" if done else args, done)

    def _value(self, tool: str, key: str, raw: str) -> str:
        """A value is a string unless the tool's schema types it otherwise and it parses as JSON."""
        prop = ((self.tools.get(tool) or {}).get("parameters") or {}).get("properties", {}).get(key, {})
        if prop.get("type") != "string":
            try:
                return json.dumps(json.loads(raw.strip()), ensure_ascii=False)
            except ValueError:
                pass
        return json.dumps(raw, ensure_ascii=False)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (DeepSeekV3, DeepSeekV31, Hermes, Glm45, KimiK2)}


def detect(vocab: dict[str, int], template: str | None) -> str | None:
    """The tool-call format of a model, from its vocabulary and chat template (None: no known format)."""
    t = template or ""
    if "<｜tool▁calls▁begin｜>" in vocab or "<｜tool▁calls▁begin｜>" in t:
        # V3/R1 templates write `function<｜tool▁sep｜>name` then a ```json fence; V3.1 writes `name<｜tool▁sep｜>args`
        return "deepseek_v31" if t and "```json" not in t else "deepseek_v3"
    if "<|tool_calls_section_begin|>" in vocab or "<|tool_calls_section_begin|>" in t:
        return "kimi_k2"
    if "<arg_key>" in vocab or "<arg_key>" in t:
        return "glm45"
    if "<tool_call>" in vocab or "<tool_call>" in t:
        return "hermes"
    return None


class ToolCallStream:
    """Per choice: push(text piece) -> (content piece, [tool-call delta dicts]); whole-text results in .content and
    .calls after finish(). Deltas follow OpenAI: the first for call i has index, id, type and the name (arguments
    ""), later ones only argument text; concatenated they are the final arguments."""

    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser, self.parallel = parser, parallel
        self.text, self.content, self.calls = "", "", []
        self._sent: list[tuple[str, int]] = []              # per call: (id, argument characters sent)

    def push(self, piece: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += piece
        content, calls = self.parser.parse(self.text, final)
        if not self.parallel:
            calls = calls[:1]
        new_content = content[len(self.content):] if content.startswith(self.content) else ""
        self.content = content if content.startswith(self.content) else self.content
        deltas = []
        for i, c in enumerate(calls):
            if i == len(self._sent):
                self._sent.append((c.id or new_call_id(), 0))
                deltas.append({"index": i, "id": self._sent[i][0], "type": "function",
                               "function": {"name": c.name, "arguments": ""}})
            call_id, n = self._sent[i]
            if len(c.arguments) > n:
                deltas.append({"index": i, "function": {"arguments": c.arguments[n:]}})
                self._sent[i] = (call_id, len(c.arguments))
        self.calls = [{"id": self._sent[i][0], "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]
        return new_content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        return self.push("", final=True)
