"""The OpenAI features of `ktrun serve` beyond plain text, through the real server code and the official `openai`
client, with the deterministic fake engine (tests/serve_fake_engine.py): scripted token streams ("SCRIPT:...", one
byte per token) drive the tool-call parsers of every family and the reasoning split, streamed and not; logprobs
(chat, completions, echo) are the fake's own distribution; n choices; response_format enforced by xgrammar (the
output validates with jsonschema, an independent validator); timings; what is refused; slow clients; /docs.
The same features on a real converted model are in test_serve_model_features.py."""
from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from serve_fake_engine import ByteTokenizer, fake_generate, fake_logprobs
from serve_helpers import fake_server, metric, request

MODEL = "fake-model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ARGS = {"city": "Paris", "days": 3}
# what each family's model would write (backslash-n: a newline in the fake's script)
SCRIPTS = {
    "hermes": 'Checking.<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\\n</tool_call>',
    "deepseek_v3": "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\\n```json\\n"
                   '{"city": "Paris", "days": 3}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek_v31": "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                    '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "glm45": "Checking.<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n"
             "<arg_key>days</arg_key>\\n<arg_value>3</arg_value>\\n</tool_call>",
    "kimi_k2": "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
               '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
}


def _client(s):
    return openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server():
    s = fake_server("--tool-call-parser", "hermes", "--reasoning-parser", "think", "--max-batch", "8", "--ctx", "2048")
    yield s
    assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


def chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def collect_stream(chunks):
    """What a client assembles from a chat stream: content, reasoning, tool calls, finish_reason, per index."""
    out: dict[int, dict] = {}
    for c in chunks:
        for ch in c.choices:
            o = out.setdefault(ch.index, {"content": "", "reasoning": "", "calls": {}, "finish": None})
            o["content"] += ch.delta.content or ""
            o["reasoning"] += getattr(ch.delta, "reasoning_content", None) or ""
            for tc in ch.delta.tool_calls or []:
                call = o["calls"].setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            o["finish"] = ch.finish_reason or o["finish"]
    return out


# -- tools ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def family(request):
    s = fake_server("--tool-call-parser", request.param, "--ctx", "2048")
    yield request.param, s
    assert s.stop() == 0, s.stderr


def test_tool_call_round_trip_every_family(family):
    name, s = family
    c = _client(s)
    msgs = [{"role": "user", "content": "SCRIPT:" + SCRIPTS[name]}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], max_tokens=400)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Checking."
    assert len(m.tool_calls) == 1 and m.tool_calls[0].function.name == "get_weather"
    assert json.loads(m.tool_calls[0].function.arguments) == ARGS and m.tool_calls[0].id
    streamed = collect_stream(c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                                        max_tokens=400, stream=True))[0]
    assert streamed["finish"] == "tool_calls" and streamed["content"] == "Checking."
    call = streamed["calls"][0]
    assert call["name"] == "get_weather" and call["arguments"] == m.tool_calls[0].function.arguments
    # the round trip: the call and its result go back and render through the template
    msgs += [m.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny, 21 C"}]
    r2 = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], max_tokens=5)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens and r2.choices[0].finish_reason == "length"
    assert request(s, "POST", "/tokenize", {"messages": msgs, "tools": [WEATHER]})[1]["count"] > 0


def test_tools_reach_the_template_and_tool_choice(server, client):
    plain = chat(client, "hi", max_tokens=1).usage.prompt_tokens
    with_tools = chat(client, "hi", max_tokens=1, tools=[WEATHER, TIME]).usage.prompt_tokens
    assert with_tools == plain + len("<|tools|>get_weather,get_time\n")
    none = chat(client, "SCRIPT:" + SCRIPTS["hermes"], max_tokens=400, tools=[WEATHER], tool_choice="none")
    assert none.usage.prompt_tokens < chat(client, "SCRIPT:" + SCRIPTS["hermes"], max_tokens=1,
                                           tools=[WEATHER]).usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content
    r = chat(client, "SCRIPT:" + SCRIPTS["hermes"], max_tokens=400, tools=[TIME])   # not one of the tools given
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            chat(client, "x", tools=[WEATHER], tool_choice=choice)


def test_parallel_tool_calls(server, client):
    two = SCRIPTS["hermes"] + '<tool_call>\\n{"name": "get_time", "arguments": {}}\\n</tool_call>'
    r = chat(client, "SCRIPT:" + two, max_tokens=300, tools=[WEATHER, TIME])
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    r = chat(client, "SCRIPT:" + two, max_tokens=300, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]


# -- reasoning ------------------------------------------------------------------------------------------------
def test_reasoning_content_stream_and_not(server, client):
    r = chat(client, "SCRIPT:<think>\\nadd 2 and 2\\n</think>\\n\\nIt is 4.", max_tokens=100)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == ("\nadd 2 and 2\n", "\n\nIt is 4.")
    s = collect_stream(chat(client, "SCRIPT:<think>\\nadd 2 and 2\\n</think>\\n\\nIt is 4.", max_tokens=100,
                            stream=True))[0]
    assert (s["reasoning"], s["content"]) == ("\nadd 2 and 2\n", "\n\nIt is 4.")
    # the template opened the think block (chat_template_kwargs reach it): the output starts inside it
    r = chat(client, "SCRIPT:hmm</think>Done.", max_tokens=100, extra_body={"chat_template_kwargs":
                                                                               {"enable_thinking": True}})
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("hmm", "Done.")
    # kept inline on request
    r = chat(client, "SCRIPT:<think>x</think>y", max_tokens=100, extra_body={"separate_reasoning": False})
    assert r.choices[0].message.content == "<think>x</think>y"
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    # reasoning, then a tool call
    r = chat(client, "SCRIPT:<think>need weather</think>" + SCRIPTS["hermes"], max_tokens=300, tools=[WEATHER])
    m = r.choices[0].message
    assert m.reasoning_content == "need weather" and m.tool_calls[0].function.name == "get_weather"


def test_reasoning_inline_by_default_with_the_flag():
    s = fake_server("--reasoning-parser", "think", "--reasoning-inline")
    try:
        r = chat(_client(s), "SCRIPT:<think>x</think>y", max_tokens=50)
        assert r.choices[0].message.content == "<think>x</think>y"
        r = chat(_client(s), "SCRIPT:<think>x</think>y", max_tokens=50, extra_body={"separate_reasoning": True})
        assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("x", "y")
    finally:
        assert s.stop() == 0, s.stderr


# -- logprobs -------------------------------------------------------------------------------------------------
def test_chat_logprobs_stream_and_not(server, client):
    msgs = [{"role": "user", "content": "logprobs please"}]
    prompt = ByteTokenizer().encode(ByteTokenizer().apply_chat_template(msgs, add_generation_prompt=True),
                                    add_special_tokens=False)
    toks = fake_generate(prompt, 6)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert [e.bytes for e in entries] == [[t] for t in toks]
    for i, e in enumerate(entries):
        lp, top = fake_logprobs(prompt + toks[:i], toks[i], 3)
        assert e.logprob == pytest.approx(lp) and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([b for _, b in top])
        assert e.top_logprobs[0].token == e.token            # the fake's emitted token is its most likely
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, logprobs=True,
                                                 top_logprobs=3, stream=True))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]


def test_completion_echo_logprobs_score_the_prompt_like_lm_eval(server, client):
    """lm-eval's local-completions: prompt = context + continuation ids, echo, logprobs=1, max_tokens=1; it sums
    token_logprobs[ctxlen:-1] and checks each against max(top_logprobs)."""
    ids = ByteTokenizer().encode("The cat sat on the mat")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("The cat sat on the mat") and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        want, top = fake_logprobs(ids[:i], ids[i], 1)
        assert lp.token_logprobs[i] == pytest.approx(want)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(max(want, top[0][1]))
    assert lp.text_offset[:3] == [0, 0, 1]                    # BOS has no text
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, logprobs=2, temperature=0)
    assert len(r.choices[0].logprobs.tokens) == 4 and all(len(t) >= 1 for t in r.choices[0].logprobs.top_logprobs)


# -- n, sampling fields ---------------------------------------------------------------------------------------
def test_n_choices_stream_and_not(server, client):
    r = client.completions.create(model=MODEL, prompt="many", max_tokens=6, n=3, temperature=0)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts[0] == ByteTokenizer().decode(fake_generate(ByteTokenizer().encode("many"), 6))
    assert len(set(texts)) == 3 and r.usage.completion_tokens == 18
    chunks = list(client.completions.create(model=MODEL, prompt="many", max_tokens=6, n=3, temperature=0,
                                            stream=True))
    got = {i: "".join(ch.text for c in chunks for ch in c.choices if ch.index == i) for i in range(3)}
    assert [got[i] for i in range(3)] == texts
    assert sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason) == [0, 1, 2]
    st, body, _ = request(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 9})
    assert st == 400 and body["error"]["param"] == "n"           # more than --max-batch 8


def test_stop_token_ids_and_sampling_fields(server, client):
    full = ByteTokenizer().decode(fake_generate(ByteTokenizer().encode("stop ids"), 30))
    cut = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    r = client.completions.create(model=MODEL, prompt="stop ids", max_tokens=30,
                                  extra_body={"stop_token_ids": [ord(full[cut])]})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[:cut], "stop")
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=2, presence_penalty=0.5,
                                   frequency_penalty=0.5, logit_bias={"97": 5}, extra_body={"min_p": 0.1,
                                                                                            "repetition_penalty": 1.1})
    assert ok.usage.completion_tokens == 2
    for bad, param in (({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"min_p": 2}, "min_p"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
                       ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                       ({"echo": True, "stream": True}, "echo"), ({"best_of": 3}, "best_of"),
                       ({"suffix": "z"}, "suffix")):
        st, body, _ = request(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", **bad})
        assert st == 400 and body["error"]["param"].startswith(param), (bad, body)
    st, body, _ = request(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert st == 400 and "only text content parts" in body["error"]["message"]


# -- structured output ---------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "ok", "n"], "additionalProperties": False}


def test_json_schema_and_json_object(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    r = chat(client, "give json", max_tokens=80, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    s = collect_stream(chat(client, "give json", max_tokens=80, response_format=fmt, stream=True))[0]
    assert s["content"] == r.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt="n choices of json", max_tokens=80, n=2, temperature=0,
                                  extra_body={"response_format": fmt})
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    r = chat(client, "an object", max_tokens=200, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a long string value ran into max_tokens: still a prefix of an object
        assert r.choices[0].message.content.startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}
    with pytest.raises(openai.BadRequestError, match="not supported") as e:
        chat(client, "x", response_format=bad)
    assert e.value.body["param"] == "response_format"
    st, body, _ = request(server, "POST", "/v1/chat/completions", {"model": MODEL, "ignore_eos": True,
                          "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})
    assert st == 400 and body["error"]["param"] == "ignore_eos"


# -- timings, metrics, docs ------------------------------------------------------------------------------------
def test_timings_in_response_stream_and_log(server, client):
    r = client.completions.create(model=MODEL, prompt="time me", max_tokens=5)
    t = r.model_extra["timings"]
    assert t["prompt_n"] == r.usage.prompt_tokens and t["predicted_n"] == 5
    assert t["predicted_ms"] > 0 and t["predicted_per_second"] > 0 and t["queue_ms"] >= 0
    chunks = list(client.completions.create(model=MODEL, prompt="time me", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].model_extra["timings"]["predicted_n"] == 5
    deadline = time.monotonic() + 5
    while f"{r.id} prompt " not in server.stderr and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"{r.id} prompt {r.usage.prompt_tokens} tok" in server.stderr


def test_vllm_metric_names(server, client):
    client.completions.create(model=MODEL, prompt="m", max_tokens=3)
    for name in ("ktrun_request_queue_time_seconds_count", "ktrun_request_prefill_time_seconds_count",
                 "ktrun_request_decode_time_seconds_count", "ktrun_inter_token_latency_seconds_count",
                 "ktrun_request_prompt_tokens_count", "ktrun_e2e_request_latency_seconds_count"):
        assert metric(server, name) >= 1, name
    assert metric(server, "ktrun_request_success_total", '{finished_reason="length"}') >= 1


def test_openapi_docs_and_tokenizer_info(server):
    st, spec, _ = request(server, "GET", "/openapi.json")
    assert st == 200 and {"/v1/chat/completions", "/v1/completions", "/tokenize", "/health"} <= set(spec["paths"])
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ChatCompletionRequest")
    assert {"tools", "logprobs", "response_format", "n"} <= set(spec["components"]["schemas"]
                                                                ["ChatCompletionRequest"]["properties"])
    st, html, hdrs = request(server, "GET", "/docs")
    assert st == 200 and hdrs["Content-Type"].startswith("text/html") and "openapi.json" in html
    assert request(server, "GET", "/tokenizer_info")[0] == 200


def test_fast_text_chunks_are_the_models_bytes():
    from ktrun.serve.generation import Generation, Plan

    class C:
        finish_reason, pending_lp = None, []

    for kind in ("chat", "completion"):
        for usage in (False, True):
            g = Generation.__new__(Generation)
            g.plan = Plan(kind=kind, model='m"odel', prompt_ids=[1], params=None, include_usage=usage)
            g.rid, g.created, g._frame, g.choices = "rid", 5, None, [C(), C()]
            C.index = 1
            text = 'hé "q"\n\t\u2028'
            assert g._text_chunk(1, text) == g._chunk([g._delta_choice(C(), content=text)])


# -- slow clients ---------------------------------------------------------------------------------------------
def test_slow_clients_do_not_hold_up_others(server, client):
    """A client that sends half a body and stalls, and one that stops reading its stream, while others are served;
    the reader that stalled still gets every byte when it reads again."""
    stalled = socket.create_connection((server.host, server.port), timeout=30)
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 200\r\n\r\n{\"model\": ")
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect((server.host, server.port))
    body = json.dumps({"model": MODEL, "prompt": "slow reader", "max_tokens": 200, "stream": True,
                       "ignore_eos": True})
    reader.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=8).choices[0]
                              .text, [f"quick {i}" for i in range(8)]))
    assert texts == [ByteTokenizer().decode(fake_generate(ByteTokenizer().encode(f"quick {i}"), 8))
                     for i in range(8)]
    assert time.monotonic() - t0 < 20
    time.sleep(0.5)
    data = b""
    reader.settimeout(30)
    while not data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        chunk = reader.recv(65536)
        if not chunk:
            break
        data += chunk
    reader.close()
    body_text = data.split(b"\r\n\r\n", 1)[1]
    events = [json.loads(line[6:]) for line in body_text.split(b"\n") if line.startswith(b"data: {")]
    want = ByteTokenizer().decode(fake_generate(ByteTokenizer().encode("slow reader"), 200))
    assert "".join(e["choices"][0]["text"] for e in events) == want
    stalled.close()
    assert request(server, "GET", "/health")[0] == 200


def test_chunked_request_body_and_limit(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    body = json.dumps({"model": MODEL, "prompt": "chunked", "max_tokens": 2}).encode()
    conn.request("POST", "/v1/completions", body=iter([body[:10], body[10:]]),
                 headers={"Content-Type": "application/json"})   # an iterable body: http.client sends it chunked
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2
    conn.request("POST", "/v1/completions", body=iter([b'{"prompt": "' + b"x" * 40000, b"y" * 40000 + b'"}']),
                 headers={"Content-Type": "application/json"})   # an iterable body: http.client sends it chunked
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "body_too_large"
    conn.close()
