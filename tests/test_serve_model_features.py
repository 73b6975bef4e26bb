"""`ktrun serve`'s OpenAI features end to end on the real default model (converted by `ktconvert quantize`), driven
with the official `openai` client: logprobs (chat, completions, echo) equal to the model's own log-softmax computed
in this process; n choices equal to solo seeded runs; penalties / logit_bias / min_p equal to the Engine alone with
the same SamplingParams; a grammar-constrained json_schema answer that validates (jsonschema) although the tiny
model writes Python, not JSON; tools and reasoning rendered through a chat template (the prompt tokens equal
transformers' apply_chat_template) and split from the model's real output. The model writes junk for these
requests; the parsers themselves are tested on scripted outputs in test_serve_features.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from serve_helpers import ServerProcess, request

BIN = Path(__import__("sys").executable).parent
CTX = 256
# the default model's template plus what chat models add: a tool list (Hermes/Qwen style) and an opened think block
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + (m['content'] or '') }}"
    "{% for c in (m['tool_calls'] or []) %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% if enable_thinking %}{{ '<think>\n' }}{% endif %}"
    "{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"lang": {"enum": ["python", "c", "rust"]}, "typed": {"type": "boolean"},
                                           "year": {"type": "integer", "minimum": 1950, "maximum": 2030}},
          "required": ["lang", "typed", "year"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(default_converted):
    s = ServerProcess([str(BIN / "ktrun"), "serve", str(default_converted), "--port", "0", "--ctx", str(CTX),
                       "--max-batch", "8"], timeout=180)
    yield s
    assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(default_converted):
    from ktrun.engine import Engine

    return Engine(default_converted, ctx=CTX, max_batch=4)


def solo(engine, ids, **params):
    """The Engine alone, one request: -> (tokens, per-token StepOutputs)."""
    from ktrun.engine import SamplingParams

    engine.add_request("solo", ids, SamplingParams(**params))
    outs = []
    while engine.has_work():
        outs += engine.step()
    return [o[1] for o in outs], outs


def test_completion_echo_logprobs_equal_the_models_log_softmax(client, default_converted, engine):
    from ktrun.models.kv_cache import Batch

    ids = engine.tokenizer.encode("def read_config(path):\n    with open(path) as f:")
    r = client.completions.create(model=default_converted.name, prompt=ids, max_tokens=1, echo=True, logprobs=2,
                                  temperature=0)
    lp = r.choices[0].logprobs
    cache = engine.model.new_cache(CTX)
    ref = torch.log_softmax(engine.model.forward(Batch.build([(cache, ids)], engine.model.device), all_logits=True),
                            -1)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)],
                                                          abs=1e-4)
    top1 = [max(d.values()) for d in lp.top_logprobs[1:len(ids)]]
    assert top1 == pytest.approx(ref[:-1].max(-1).values.tolist(), abs=1e-4)
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)   # greedy: the top token
    assert r.choices[0].text == engine.tokenizer.decode(ids) + engine.tokenizer.decode([ref[-1].argmax().item()])


def test_chat_logprobs_equal_the_engine_alone(client, default_converted, engine):
    msgs = [{"role": "user", "content": "Write a Python function `add(a, b)`: Add two numbers."}]
    ids = engine.tokenizer.apply_chat_template(msgs)
    toks, outs = solo(engine, ids, max_tokens=8, logprobs=3)
    r = client.chat.completions.create(model=default_converted.name, messages=msgs, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    got = r.choices[0].logprobs.content
    assert [e.logprob for e in got] == pytest.approx([o.logprobs.logprob for o in outs], abs=1e-4)
    assert [t.logprob for e in got for t in e.top_logprobs] == pytest.approx(
        [lp for o in outs for _, lp in o.logprobs.top], abs=1e-4)
    assert b"".join(bytes(e.bytes) for e in got).decode("utf-8", "replace") == engine.tokenizer.decode(toks)


def test_n_choices_and_sampling_fields_equal_the_engine_alone(client, default_converted, engine):
    ids = engine.tokenizer.encode("import os\nimport sys\n")
    r = client.completions.create(model=default_converted.name, prompt=ids, max_tokens=10, n=3, temperature=0.9,
                                  seed=7, extra_body={"ignore_eos": True})
    want = [engine.tokenizer.decode(solo(engine, ids, max_tokens=10, temperature=0.9, seed=7 + i,
                                         ignore_eos=True)[0]) for i in range(3)]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    params = {"presence_penalty": 1.2, "frequency_penalty": 0.7, "repetition_penalty": 1.3, "min_p": 0.05,
              "logit_bias": {"11": 4.0}}
    r = client.completions.create(model=default_converted.name, prompt=ids, max_tokens=12, temperature=0,
                                  presence_penalty=1.2, frequency_penalty=0.7, logit_bias={"11": 4.0},
                                  extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "ignore_eos": True})
    toks = solo(engine, ids, max_tokens=12, ignore_eos=True, **{**params, "logit_bias": {11: 4.0}})[0]
    assert r.choices[0].text == engine.tokenizer.decode(toks)
    assert toks != solo(engine, ids, max_tokens=12, ignore_eos=True)[0]      # the fields did change the output


def test_json_schema_output_validates(client, default_converted):
    fmt = {"type": "json_schema", "json_schema": {"name": "language", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "Describe Python as JSON."}]
    r = client.chat.completions.create(model=default_converted.name, messages=msgs, max_tokens=60, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=default_converted.name, messages=msgs, max_tokens=60, temperature=0.8, seed=3, response_format=fmt,
        stream=True))
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def chat_copy(default_converted, tmp_path_factory) -> Path:
    """The converted default model with a chat template that lists tools and can open a think block."""
    d = Path(shutil.copytree(default_converted, tmp_path_factory.mktemp("chat_copy") / "default-chat"))
    (d / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return d


def test_tools_and_reasoning_on_the_real_model(chat_copy, engine):
    from transformers import AutoTokenizer

    s = ServerProcess([str(BIN / "ktrun"), "serve", str(chat_copy), "--port", "0", "--ctx", str(CTX)], timeout=180)
    try:
        assert "tool calls: hermes, reasoning split: on" in s.stderr    # detected from the template
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        hf = AutoTokenizer.from_pretrained(chat_copy)
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        want = hf.apply_chat_template(msgs, tools=[WEATHER], add_generation_prompt=True, tokenize=True,
                                      enable_thinking=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        got = request(s, "POST", "/tokenize", {"messages": msgs, "tools": [WEATHER],
                                               "chat_template_kwargs": {"enable_thinking": True}})[1]["tokens"]
        assert got == want
        # the template opened <think>: the model's (junk) text is reasoning until it writes </think>
        toks = solo(engine, want, max_tokens=12, ignore_eos=True)[0]
        text = engine.tokenizer.decode(toks, skip_special_tokens=False)
        kw = {"model": chat_copy.name, "messages": msgs, "tools": [WEATHER], "max_tokens": 12, "temperature": 0,
              "extra_body": {"chat_template_kwargs": {"enable_thinking": True}, "ignore_eos": True}}
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        assert r.usage.prompt_tokens == len(want) and r.choices[0].finish_reason == "length"
        if "</think>" not in text:
            assert (m.reasoning_content, m.content) == (text, None)
        streamed = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                           for ch in c.chat.completions.create(stream=True, **kw) if ch.choices)
        assert streamed == (m.reasoning_content or "")
        # without thinking: the text is content, and it holds no tool call
        r = c.chat.completions.create(model=chat_copy.name, messages=msgs, tools=[WEATHER], max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
        ids = hf.apply_chat_template(msgs, tools=[WEATHER], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        plain = engine.tokenizer.decode(solo(engine, ids, max_tokens=12, ignore_eos=True)[0],
                                        skip_special_tokens=False)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == plain
    finally:
        assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr, s.stderr
