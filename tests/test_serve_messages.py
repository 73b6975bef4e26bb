"""`POST /v1/messages` (Anthropic's Messages API) and `/v1/messages/count_tokens` on a real `ktrun serve` of the
default model started with --api-key, driven with the official `anthropic` client (x-api-key): a system prompt,
create and stream (raw events in Anthropic's order, text_stream equal to the whole answer), greedy text equal to
/v1/chat/completions for the same conversation, a tool round trip's history (tool_use + tool_result blocks),
thinking blocks, stop_sequences / max_tokens stop reasons, output_config json_schema, token counts equal to
/tokenize; errors in Anthropic's envelope. The model's side of a tool call (tool_use blocks, input_json_delta) runs
on the fake engine's scripted output, at the end."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from serve_fake_engine import ByteTokenizer
from serve_helpers import ServerProcess, fake_server, request
from test_serve_model_features import SCHEMA, TEMPLATE

BIN = Path(__import__("sys").executable).parent
CTX = 512
KEY = "test-key"
SYSTEM = "You write short Python functions."
USER = "Write a Python function `add(a, b)`: Add two numbers."
GREEDY = {"temperature": 0}   # anthropic 2.x's create() has no temperature argument; the API still takes it
TOOL = {"name": "get_weather", "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                              "parameters": TOOL["input_schema"]}}


@pytest.fixture(scope="module")
def model_dir(default_converted, tmp_path_factory) -> Path:
    """The default conversion with a chat template that lists tools and can open a think block."""
    d = Path(shutil.copytree(default_converted, tmp_path_factory.mktemp("messages") / "default-chat"))
    (d / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    s = ServerProcess([str(BIN / "ktrun"), "serve", str(model_dir), "--port", "0", "--ctx", str(CTX),
                       "--api-key", KEY], timeout=180)
    yield s
    assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir.name


def chat(oa, model, messages, n=16, **kw):
    r = oa.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0, **kw)
    return r.choices[0].message, r.usage


def test_system_prompt_create_and_stream_equal_chat(an, oa, model):
    kw = {"model": model, "max_tokens": 24, "extra_body": GREEDY, "messages": [{"role": "user", "content": USER}],
          "system": [{"type": "text", "text": SYSTEM}]}
    want, usage = chat(oa, model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], 24)
    m = an.messages.create(**kw)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    assert m.usage.cache_read_input_tokens > 0          # chat's prefill of the same prompt is cached
    assert m.stop_reason == ("max_tokens" if usage.completion_tokens == 24 else "end_turn")
    with an.messages.stream(**kw) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    assert text == final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    events = list(an.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"] and set(types[2:-3]) == {"content_block_delta"}
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == m.content[0].text
    assert events[-2].usage.output_tokens == m.usage.output_tokens


def test_tool_round_trip_history_renders_as_chat(an, oa, server, model):
    """The client's side of a tool round trip: the model's tool_use and the tool_result sent back; the prompt is
    the chat template's rendering of the same conversation (count_tokens = /tokenize), the answer equals chat's."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "sunny, 24 C"}]}]}]
    chat_msgs = [msgs[0], {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 24 C"}]
    m = an.messages.create(model=model, max_tokens=16, messages=msgs, tools=[TOOL], system=SYSTEM,
                           extra_body=GREEDY)
    want, usage = chat(oa, model, [{"role": "system", "content": SYSTEM}] + chat_msgs, tools=[CHAT_TOOL])
    assert m.content[0].text == want.content and m.stop_reason != "tool_use"
    n = an.messages.count_tokens(model=model, messages=msgs, tools=[TOOL], system=SYSTEM).input_tokens
    tokenized = request(server, "POST", "/tokenize", {"messages": [{"role": "system", "content": SYSTEM}] + chat_msgs,
                                                      "tools": [CHAT_TOOL]}, headers={"x-api-key": KEY})[1]
    assert n == usage.prompt_tokens == tokenized["count"]


def test_thinking_blocks(an, oa, model):
    msgs = [{"role": "user", "content": USER}]
    # the template opens <think>: the tiny model's text is thinking (it may end at once: ignore_eos)
    want, _ = chat(oa, model, msgs, 12, extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                                    "ignore_eos": True})
    kw = {"model": model, "max_tokens": 12, "messages": msgs, "thinking": {"type": "enabled", "budget_tokens": 1024},
          "extra_body": {**GREEDY, "ignore_eos": True}}
    m = an.messages.create(**kw)
    assert m.content[0].type == "thinking" and m.content[0].thinking == want.reasoning_content
    events = list(an.messages.create(stream=True, **kw))
    assert events[1].content_block.type == "thinking"
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta") == want.reasoning_content


def test_stop_sequences_and_max_tokens(an, model):
    kw = {"model": model, "messages": [{"role": "user", "content": USER}],
          "extra_body": {**GREEDY, "ignore_eos": True}}
    m = an.messages.create(max_tokens=5, **kw)
    assert (m.stop_reason, m.stop_sequence, m.usage.output_tokens) == ("max_tokens", None, 5)
    text = an.messages.create(max_tokens=30, **kw).content[0].text
    k = next(i for i in range(4, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[k:k + 3]
    m = an.messages.create(max_tokens=30, stop_sequences=[stop, "never in it"], **kw)
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == (text[:k], "stop_sequence", stop)
    events = list(an.messages.create(max_tokens=30, stop_sequences=[stop], stream=True, **kw))
    assert events[-2].delta.stop_reason == "stop_sequence" and events[-2].delta.stop_sequence == stop


def test_output_config_json_schema(an, model):
    m = an.messages.create(model=model, max_tokens=60, messages=[{"role": "user", "content": "Describe Python."}],
                           output_config={"format": {"type": "json_schema", "schema": SCHEMA}}, extra_body=GREEDY)
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), SCHEMA)


def test_errors_in_anthropic_envelope(an, server, model):
    def shape(body, kind):
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]

    with pytest.raises(anthropic.NotFoundError) as e:
        an.messages.create(model="claude-other", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    shape(e.value.body, "not_found_error")
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    shape(e.value.body, "invalid_request_error")
    assert "messages[0].content[0].type" in e.value.body["error"]["message"] or "image" in e.value.body["error"][
        "message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                           tool_choice={"type": "any"})
    shape(e.value.body, "invalid_request_error")
    status, body, _ = request(server, "POST", "/v1/messages", {"model": model, "messages": [
        {"role": "user", "content": "x"}]}, headers={"x-api-key": KEY})
    assert status == 400 and "max_tokens" in body["error"]["message"]
    shape(body, "invalid_request_error")
    for headers in ({}, {"x-api-key": "wrong"}):
        status, body, _ = request(server, "POST", "/v1/messages", {"model": model}, headers=headers)
        assert status == 401
        shape(body, "authentication_error")
    status, body, _ = request(server, "POST", "/v1/messages/count_tokens", {"model": model, "messages": []},
                              headers={"Authorization": f"Bearer {KEY}"})
    assert status == 400
    shape(body, "invalid_request_error")
    status, body, _ = request(server, "POST", "/v1/messages", {"model": model, "max_tokens": CTX, "messages": [
        {"role": "user", "content": "x"}]}, headers={"x-api-key": KEY})
    assert status == 400 and "context limit" in body["error"]["message"]


# -- the model's side of a tool call, on the fake engine's scripted output -------------------------------------
SCRIPT = ('SCRIPT:<think>need weather</think>Checking.<tool_call>\\n{"name": "get_weather", "arguments": '
          '{"city": "Paris"}}\\n</tool_call>')


@pytest.fixture(scope="module")
def fake():
    s = fake_server("--tool-call-parser", "hermes", "--reasoning-parser", "think", "--ctx", "2048")
    yield s
    assert s.stop() == 0, s.stderr
    # the only tracebacks: the engine loop reporting the CRASH test's injected failure (its text shows twice in each)
    assert s.stderr.count("Traceback") == s.stderr.count("fake engine: injected failure") // 2, s.stderr


def test_tool_use_blocks_and_round_trip_on_scripted_output(fake):
    an = anthropic.Anthropic(base_url=fake.base_url, api_key="unused", max_retries=0, timeout=60)
    kw = {"model": "fake-model", "max_tokens": 200, "tools": [TOOL], "system": "Be brief.",
          "messages": [{"role": "user", "content": SCRIPT}]}
    m = an.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use"
    assert (m.content[0].thinking, m.content[1].text) == ("need weather", "Checking.")
    call = m.content[2]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"}) and call.id.startswith("toolu_")
    with an.messages.stream(**kw) as st:
        events = list(st)
        final = st.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"] and final.content[2].input == call.input
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"
             and e.delta.type == "input_json_delta"]
    assert len(parts) > 1 and json.loads("".join(parts)) == call.input and final.stop_reason == "tool_use"
    # the round trip: the client sends the assistant turn back with the tool's result
    msgs = kw["messages"] + [{"role": "assistant", "content": m.content},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                           "content": "sunny"}]}]
    r = an.messages.create(**{**kw, "messages": msgs, "max_tokens": 4})
    want = ByteTokenizer().apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": SCRIPT},
         {"role": "assistant", "content": "Checking."}, {"role": "tool", "content": "sunny"}],
        add_generation_prompt=True, tools=[CHAT_TOOL])
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(want.encode())
    assert an.messages.count_tokens(model="fake-model", messages=msgs, tools=[TOOL],
                                    system="Be brief.").input_tokens == len(want.encode())


def test_end_turn_on_eos(fake):
    an = anthropic.Anthropic(base_url=fake.base_url, api_key="unused", max_retries=0, timeout=60)
    m = an.messages.create(model="fake-model", max_tokens=50, messages=[{"role": "user", "content": "EOS now"}])
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == 4 and len(m.content[0].text) == 3


def test_engine_error_mid_stream_is_an_error_event(fake):
    an = anthropic.Anthropic(base_url=fake.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.APIStatusError) as e:     # the client raises on Anthropic's `error` event
        list(an.messages.create(model="fake-model", max_tokens=8, stream=True,
                                messages=[{"role": "user", "content": "CRASH"}]))
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
    m = an.messages.create(model="fake-model", max_tokens=3, messages=[{"role": "user", "content": "fine"}])
    assert m.usage.output_tokens == 3                       # the server keeps serving
