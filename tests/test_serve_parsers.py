"""Tool-call parsers and the reasoning splitter of `ktrun serve`, on model outputs written out by hand in each family's
format (from the models' chat templates and cards): the whole text parsed once, and the same text streamed in
every possible two-piece split and one character at a time, must give the same content and calls; streamed
arguments only ever grow."""
from __future__ import annotations

import json

import pytest
from ktrun.serve.reasoning import ReasoningSplitter, prompt_opens_thinking, uses_thinking
from ktrun.serve.tool_parsers import PARSERS, ToolCallStream, detect

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]

CALL1 = ("get_weather", {"city": "Paris", "days": 3})
CALL2 = ("get_time", {})
DSV3 = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
        "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DSV31 = ('Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
         "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
GLM = ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
       "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>")
KIMI = ('Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
CASES = {"deepseek_v3": DSV3, "deepseek_v31": DSV31, "hermes": HERMES, "glm45": GLM, "kimi_k2": KIMI}


def run(parser: str, pieces: list[str], parallel: bool = True):
    s = ToolCallStream(PARSERS[parser](TOOLS), parallel)
    content, calls, grown = "", {}, True
    for i, piece in enumerate(pieces):
        c, deltas = s.push(piece, final=i == len(pieces) - 1)
        content += c
        for d in deltas:
            entry = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert entry["id"] is None and d["function"]["name"] and d["function"]["arguments"] == ""
                entry["id"], entry["name"] = d["id"], d["function"]["name"]
            else:
                assert entry["id"] is not None     # the name always comes first
                grown &= bool(d["function"]["arguments"])
                entry["arguments"] += d["function"]["arguments"]
    assert grown
    return content, [calls[i] for i in sorted(calls)], s


@pytest.mark.parametrize("parser", sorted(CASES))
def test_whole_and_streamed_agree(parser):
    text = CASES[parser]
    content, calls, s = run(parser, [text])
    assert content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [CALL1, CALL2]
    assert [c["function"]["arguments"] for c in s.calls] == [c["arguments"] for c in calls]
    for pieces in ([text[:k], text[k:]] for k in range(1, len(text))):
        assert run(parser, pieces)[:2] == (content, calls) or _same_but_ids(run(parser, pieces)[:2], content, calls)
    by_char = run(parser, list(text))
    assert _same_but_ids(by_char[:2], content, calls)


def _same_but_ids(got, content, calls) -> bool:
    g_content, g_calls = got
    strip = [{k: v for k, v in c.items() if k != "id"} for c in calls]
    return g_content == content and [{k: v for k, v in c.items() if k != "id"} for c in g_calls] == strip


def test_kimi_keeps_its_call_ids_and_parallel_false_keeps_one_call():
    _, calls, _ = run("kimi_k2", [KIMI])
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    _, calls, _ = run("hermes", [HERMES], parallel=False)
    assert [c["name"] for c in calls] == ["get_weather"]


def test_glm_values_follow_the_schema():
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n<arg_key>days</arg_key>\n"
            "<arg_value>7</arg_value>\n</tool_call>")
    _, calls, _ = run("glm45", [text])
    assert json.loads(calls[0]["arguments"]) == {"city": "123", "days": 7}   # city is a string in the schema


@pytest.mark.parametrize("parser", sorted(CASES))
def test_no_call_is_plain_content(parser):
    for text in ("Just an answer, no tools.", "An answer < with a lone bracket", "ends with a partial <"):
        content, calls, _ = run(parser, list(text))
        assert (content, calls) == (text, [])
    start = PARSERS[parser].start
    content, calls, _ = run(parser, list("Hmm " + start + "garbage"))   # a marker but never a named call
    assert (content, calls) == ("Hmm " + start + "garbage", [])


def test_detect_from_vocabulary_and_template():
    assert detect({"<｜tool▁calls▁begin｜>": 1}, "...```json...") == "deepseek_v3"
    assert detect({"<｜tool▁calls▁begin｜>": 1}, "{{'<｜tool▁sep｜>' + tool['function']['arguments']}}") == "deepseek_v31"
    assert detect({"<|tool_calls_section_begin|>": 5}, None) == "kimi_k2"
    assert detect({"<tool_call>": 5, "<arg_key>": 6}, None) == "glm45"
    assert detect({"<tool_call>": 5}, None) == "hermes"
    assert detect({"hello": 1}, "{{ messages }}") is None


@pytest.mark.parametrize("in_reasoning,text", [
    (False, "<think>\nI should add.\n</think>\n\nThe answer is 4."),
    (True, "\nI should add.\n</think>\n\nThe answer is 4."),
])
def test_reasoning_split_whole_and_streamed(in_reasoning, text):
    def split(pieces):
        s = ReasoningSplitter(in_reasoning)
        r = c = ""
        for i, p in enumerate(pieces):
            a, b = s.push(p, final=i == len(pieces) - 1)
            r, c = r + a, c + b
        return r, c

    want = ("\nI should add.\n", "\n\nThe answer is 4.")
    assert split([text]) == want and split(list(text)) == want
    assert all(split([text[:k], text[k:]]) == want for k in range(1, len(text)))


def test_reasoning_edge_cases():
    s = ReasoningSplitter(False)
    assert s.push("No thinking here") == ("", "No thinking here")
    s = ReasoningSplitter(True)
    assert s.push("cut off mid-thought </thi") == ("cut off mid-thought ", "")
    assert s.finish() == ("</thi", "")     # never closed: all of it is reasoning
    assert prompt_opens_thinking("<｜Assistant｜><think>\n") and not prompt_opens_thinking("<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|assistant|>")
    assert uses_thinking({"<think>": 7}, None) and not uses_thinking({"a": 1}, "{{ x }}")
