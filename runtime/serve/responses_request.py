"""The Responses API's request (`POST /v1/responses`) and its translation into the internal chat request, so it is
generated exactly as /v1/chat/completions would generate the same conversation (chat template, tool-call parser,
reasoning split, grammar).

`input` is a string (one user message) or a list of items: messages (role + text content parts), `function_call`
(the model's earlier call: an assistant tool call), `function_call_output` (a tool message) and `reasoning` (the
reasoning of the next assistant message). `previous_response_id` puts the stored conversation before the new input;
`instructions` become the system message (not carried over from the previous response, as in OpenAI's API).
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from .protocol import INT32_MAX, ApiError, ChatCompletionRequest, Strict, bad_param
from .response_store import ResponseStore

TEXT_PARTS = ("input_text", "output_text", "text")
EFFORTS = ("low", "medium", "high")          # what templates with a reasoning_effort variable (gpt-oss) accept


class TextConfig(Strict):
    format: dict[str, Any] | None = None


class ResponsesRequest(Strict):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM-style extras (the openai client's extra_body), checked by the chat request
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


def _text(content, param: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text); anything else is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(param, "content must be a string or a list of input_text parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_param(f"{param}[{j}]", f"only text content parts ({', '.join(TEXT_PARTS[:2])}) are supported, "
                                             f"got {kind!r}: this server serves text models")
        out.append(part["text"])
    return "".join(out)


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` -> chat messages (as ChatMessage reads them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning = None                                   # a reasoning item waits for its assistant message
    for i, it in enumerate(items):
        param = f"input[{i}]"
        kind = it.get("type") or ("message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_param(f"{param}.role", f"role must be user, system, developer or assistant, got {role!r}")
            msg = {"role": role, "content": _text(it.get("content"), f"{param}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(it.get(k), str):
                    raise bad_param(f"{param}.{k}", f"a function_call item needs '{k}' (a string)")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)      # calls after the text are the same turn
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise bad_param(f"{param}.call_id", "a function_call_output item needs 'call_id' (a string)")
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": _text(it.get("output", ""), f"{param}.output")})
        elif kind == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise bad_param(f"{param}.type", f"input items of type {kind!r} are not supported (message, "
                                             "function_call, function_call_output, reasoning are)")
    return out


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise bad_param(f"tools[{i}].type", f"only function tools are supported, got {t.get('type')!r} (built-in "
                                                "tools such as web_search run on OpenAI's servers)")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    """OpenAI's named choice {"type": "function", "name"} in the chat shape (which then refuses it with the reason)."""
    if isinstance(choice, dict) and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _format(text: TextConfig | None) -> dict | None:
    fmt = (text.format if text is not None else None) or {"type": "text"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


def _template_kwargs(body: ResponsesRequest) -> dict | None:
    kw: dict[str, Any] = {}
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:             # asked for (or against) reasoning: what the templates read
        kw["enable_thinking"] = effort != "none"
        if effort in EFFORTS:
            kw["reasoning_effort"] = effort
    kw.update(body.chat_template_kwargs or {})
    return kw or None


def to_chat(body: ResponsesRequest, store: ResponseStore) -> tuple[ChatCompletionRequest, list[dict]]:
    """-> (the chat request, the conversation without instructions: what the store keeps for the next turn)."""
    if body.background:
        raise bad_param("background", "background responses are not supported: send the request and wait (or "
                                      "stream it)")
    history: list[dict] = []
    if body.previous_response_id is not None:
        prev = store.get(body.previous_response_id)
        if prev is None:
            raise ApiError(404, f"Previous response with id {body.previous_response_id!r} not found (responses are "
                                f"kept in memory, {store.max_entries} at most, and not with store: false)",
                           "invalid_request_error", "previous_response_not_found", "previous_response_id")
        history = list(prev.messages)
    conversation = history + input_messages(body.input)
    if not conversation:
        raise bad_param("input", "input is empty: send a string or at least one item")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    tools = _tools(body.tools)
    fields = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "tools": tools,
              "tool_choice": _tool_choice(body.tool_choice) if tools else None,
              "parallel_tool_calls": body.parallel_tool_calls, "response_format": _format(body.text),
              "chat_template_kwargs": _template_kwargs(body), "ignore_eos": body.ignore_eos,
              **{k: getattr(body, k) for k in ("top_k", "min_p", "repetition_penalty", "seed", "user")}}
    try:
        return ChatCompletionRequest(**fields), conversation
    except ValidationError as e:
        err = e.errors()[0]
        raise ApiError(400, f"{err.get('msg', 'invalid request')} (at {'.'.join(map(str, err.get('loc', ())))})",
                       code="invalid_parameter") from None


