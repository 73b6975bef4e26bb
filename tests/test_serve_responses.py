"""`POST /v1/responses` (OpenAI's Responses API) on a real `ktrun serve` of the default model, driven with the official
`openai` client: greedy text equal to /v1/chat/completions and /v1/messages for the same conversation; streamed
events in OpenAI's order, their deltas equal to the whole answer; instructions, a tool round trip's history
(function_call + function_call_output items), previous_response_id (and store: false), reasoning items, text.format
json_schema; each request's output under 4 and 16 concurrent clients (both new APIs) equal to its solo run; errors in
OpenAI's envelope. The tiny model never writes a tool call by itself: the model's side of the round trip (the call
parsed into a function_call item, streamed and not) runs on the fake engine's scripted output, at the end."""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
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
SYSTEM = "You write short Python functions."
USER = "Write a Python function `add(a, b)`: Add two numbers."
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GREEDY = {"temperature": 0}   # anthropic 2.x's create() has no temperature argument; the API still takes it
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def model_dir(default_converted, tmp_path_factory) -> Path:
    """The default conversion with a chat template that lists tools and can open a think block."""
    d = Path(shutil.copytree(default_converted, tmp_path_factory.mktemp("responses") / "default-chat"))
    (d / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    s = ServerProcess([str(BIN / "ktrun"), "serve", str(model_dir), "--port", "0", "--ctx", str(CTX),
                       "--max-batch", "8"], timeout=180)
    yield s
    assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir.name


def chat_text(oa, model, messages, n=16, **kw):
    r = oa.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0, **kw)
    return r.choices[0].message, r.usage


def prompt_tokens(server, messages, tools=None, **kw) -> int:
    return request(server, "POST", "/tokenize", {"messages": messages, "tools": tools, **kw})[1]["count"]


def test_same_greedy_text_through_all_three_apis(oa, an, model):
    want, _ = chat_text(oa, model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], 24)
    r = oa.responses.create(model=model, instructions=SYSTEM, input=USER, max_output_tokens=24, temperature=0)
    m = an.messages.create(model=model, system=SYSTEM, messages=[{"role": "user", "content": USER}], max_tokens=24,
                           extra_body=GREEDY)
    assert want.content and r.output_text == want.content == m.content[0].text
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.status == ("incomplete" if m.stop_reason == "max_tokens" else "completed")


def test_streamed_events_in_openai_order_equal_the_whole_answer(oa, model):
    kw = {"model": model, "instructions": SYSTEM, "input": USER, "max_output_tokens": 20, "temperature": 0}
    whole = oa.responses.create(**kw)
    events = list(oa.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens == 20


def test_tool_round_trip_history_renders_as_chat(server, oa, model):
    """The client's side of a tool round trip: the model's call and the tool's output sent back as items; the
    prompt is the chat template's rendering of the same conversation, and the greedy answer equals chat's."""
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"}]
    chat = [items[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    r = oa.responses.create(model=model, input=items, tools=[WEATHER], max_output_tokens=16, temperature=0)
    want, usage = chat_text(oa, model, chat, tools=[CHAT_WEATHER])
    assert r.usage.input_tokens == usage.prompt_tokens == prompt_tokens(server, chat, [CHAT_WEATHER])
    assert r.output_text == want.content and not want.tool_calls


def test_previous_response_id_continues_the_stored_conversation(server, oa, model):
    r1 = oa.responses.create(model=model, instructions=SYSTEM, input=USER, max_output_tokens=12, temperature=0)
    r2 = oa.responses.create(model=model, previous_response_id=r1.id, input="Now subtract them.",
                             max_output_tokens=12, temperature=0)
    # instructions are not carried over (OpenAI's rule); the earlier turn and its answer are
    convo = [{"role": "user", "content": USER}, {"role": "assistant", "content": r1.output_text},
             {"role": "user", "content": "Now subtract them."}]
    want, usage = chat_text(oa, model, convo, 12)
    assert r2.previous_response_id == r1.id and r2.usage.input_tokens == usage.prompt_tokens
    assert r2.output_text == want.content
    assert oa.responses.retrieve(r1.id).output_text == r1.output_text
    r3 = oa.responses.create(model=model, input=USER, max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        oa.responses.create(model=model, previous_response_id=r3.id, input="more", max_output_tokens=4)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"


def test_reasoning_item_and_json_schema(oa, model):
    msgs = [{"role": "user", "content": USER}]
    # the template opens <think>: the tiny model's text is reasoning (it may end at once: ignore_eos)
    want, _ = chat_text(oa, model, msgs, 12, extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                                         "ignore_eos": True})
    r = oa.responses.create(model=model, input=USER, max_output_tokens=12, temperature=0,
                            reasoning={"effort": "medium"}, extra_body={"ignore_eos": True})
    assert r.output[0].type == "reasoning" and want.reasoning_content
    assert r.output[0].content[0].text == want.reasoning_content
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    streamed = "".join(e.delta for e in oa.responses.create(model=model, input=USER, max_output_tokens=12,
                                                             temperature=0, reasoning={"effort": "medium"},
                                                             stream=True, extra_body={"ignore_eos": True})
                       if e.type == "response.reasoning_text.delta")
    assert streamed == want.reasoning_content
    fmt = {"format": {"type": "json_schema", "name": "language", "schema": SCHEMA, "strict": True}}
    r = oa.responses.create(model=model, input="Describe Python as JSON.", max_output_tokens=60, temperature=0,
                            text=fmt)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    with oa.responses.stream(model=model, input="Describe Python as JSON.", max_output_tokens=60, temperature=0,
                             text=fmt) as st:    # the client's stream helper assembles the same response
        assert st.get_final_response().output_text == r.output_text


PROMPTS = ["def read_config(path):", "Write a Python function `fib(n)`.", "import os\nimport sys\n", "class Stack:",
           "def is_prime(n):", "Write a Python function `mean(xs)`.", "from pathlib import Path\n", "class Queue:"]


def _run(oa, an, model, i: int) -> str:
    """Client i: prompt i % 8 through one of four ways (Responses whole / streamed, Messages whole / streamed)."""
    p = PROMPTS[i % len(PROMPTS)]
    if i % 4 == 0:
        return oa.responses.create(model=model, input=p, max_output_tokens=24, temperature=0).output_text
    if i % 4 == 1:
        return "".join(e.delta for e in oa.responses.create(model=model, input=p, max_output_tokens=24, temperature=0,
                                                             stream=True) if e.type == "response.output_text.delta")
    kw = {"model": model, "max_tokens": 24, "extra_body": GREEDY, "messages": [{"role": "user", "content": p}]}
    if i % 4 == 2:
        return an.messages.create(**kw).content[0].text
    with an.messages.stream(**kw) as st:
        return "".join(st.text_stream)


@pytest.mark.parametrize("clients", [4, 16])
def test_concurrent_clients_equal_their_solo_runs(oa, an, model, clients):
    """16 clients on --max-batch 8: half of them wait for a slot, and still get their solo text."""
    solo = [_run(oa, an, model, i) for i in range(clients)]
    with ThreadPoolExecutor(clients) as pool:
        assert list(pool.map(lambda i: _run(oa, an, model, i), range(clients))) == solo


def test_errors_in_openai_envelope(server, oa, model):
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model=model, input=[{"role": "user", "content": [{"type": "input_image",
                                                                               "image_url": "x"}]}])
    assert e.value.body["param"] == "input[0].content[0]" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        oa.responses.create(model="other", input="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools[0].type"
    status, body, _ = request(server, "POST", "/v1/responses", {"model": model})
    assert status == 400 and body["error"]["param"] == "input" and set(body["error"]) == {"message", "type", "param",
                                                                                           "code"}
    status, body, _ = request(server, "POST", "/v1/responses", {"model": model, "input": "x",
                                                                "max_output_tokens": CTX})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


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


def test_function_call_items_and_round_trip_on_scripted_output(fake):
    oa = openai.OpenAI(base_url=fake.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = oa.responses.create(model="fake-model", input=SCRIPT, tools=[WEATHER])
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"] and r.status == "completed"
    assert r.output[0].content[0].text == "need weather" and r.output_text == "Checking."
    call = r.output[2]
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris"}, "completed")
    events = list(oa.responses.create(model="fake-model", input=SCRIPT, tools=[WEATHER], stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done[0].arguments == call.arguments and done[0].name == "get_weather"
    final = events[-1].response
    assert events[-1].type == "response.completed" and [o.type for o in final.output] == [o.type for o in r.output]
    # the round trip: the tool's output after the stored call; the prompt holds the whole conversation
    r2 = oa.responses.create(model="fake-model", previous_response_id=r.id, tools=[WEATHER], max_output_tokens=4,
                             input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    msgs = [{"role": "user", "content": SCRIPT}, {"role": "assistant", "content": "Checking."},
            {"role": "tool", "content": "sunny"}]
    want = ByteTokenizer().apply_chat_template(msgs, add_generation_prompt=True, tools=[CHAT_WEATHER])
    assert r2.usage.input_tokens == len(want.encode())


def test_response_store_is_bounded():
    from ktrun.serve.response_store import ResponseStore

    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(5):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * 10}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r2") is not None
    store.put({"id": "r5"}, [])                      # r2 was used last: r3 goes first
    assert store.get("r3") is None and store.get("r2") is not None
    store.put({"id": "big"}, [{"content": "y" * 6000}])
    store.put({"id": "big2"}, [{"content": "y" * 6000}])
    assert store.get("big") is None and store.bytes <= 10_000
    store.put({"id": "huge"}, [{"content": "z" * 20_000}])
    assert store.get("huge") is None and store.get("big2") is not None


def test_engine_error_mid_stream_and_empty_input(fake):
    oa = openai.OpenAI(base_url=fake.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    events = list(oa.responses.create(model="fake-model", input="CRASH", stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "engine_error"
    status, body, _ = request(fake, "POST", "/v1/responses", {"model": "fake-model", "input": []})
    assert status == 400 and body["error"]["param"] == "input"
