"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`) and its translation into the
internal chat request, so it is generated exactly as /v1/chat/completions would generate the same conversation.

    system (string or text blocks)      -> the system message
    user text blocks                    -> a user message
    user tool_result blocks             -> tool messages (tool_call_id = tool_use_id), in their order
    assistant text / thinking / tool_use -> one assistant message: content, reasoning_content, tool_calls
    tools (name, description, input_schema) -> function tools; tool_choice auto / none (any / tool are refused by
                                           the chat request, with the reason); disable_parallel_tool_use
    stop_sequences, max_tokens, temperature, top_p, top_k -> the sampling fields
    thinking enabled / adaptive / disabled -> the template's enable_thinking (budget_tokens is not enforced)
    output_config.format json_schema    -> response_format json_schema (enforced by the grammar)
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationError

from .protocol import INT32_MAX, ApiError, ChatCompletionRequest, Strict, bad_param


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Strict):
    type: str                          # enabled, adaptive, ... or disabled
    budget_tokens: int | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: OutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(Strict):
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    # vLLM-style extras (extra_body in the clients), checked by the chat request
    ignore_eos: bool = False
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


def _block_text(block: dict, param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_param(f"{param}.text", "a text block needs 'text' (a string)")
    return block["text"]


def _result_text(content, param: str) -> str:
    """A tool_result's content: a string or text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_param(param, "tool_result content must be a string or a list of text blocks")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise bad_param(f"{param}[{j}]", "only text blocks are supported in a tool_result: this server serves "
                                             "text models")
    return "".join(_block_text(b, f"{param}[{j}]") for j, b in enumerate(content))


def _user(blocks: list[dict], param: str) -> list[dict]:
    out: list[dict] = []
    for j, b in enumerate(blocks):
        kind, p = b.get("type"), f"{param}[{j}]"
        if kind == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += _block_text(b, p)
            else:
                out.append({"role": "user", "content": _block_text(b, p)})
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad_param(f"{p}.tool_use_id", "a tool_result block needs 'tool_use_id'")
            text = _result_text(b.get("content"), f"{p}.content")
            if b.get("is_error"):             # templates have no error flag: the text says it
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        else:
            raise bad_param(f"{p}.type", f"user content blocks of type {kind!r} are not supported (text, "
                                         "tool_result are): this server serves text models")
    return out


def _assistant(blocks: list[dict], param: str) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, b in enumerate(blocks):
        kind, p = b.get("type"), f"{param}[{j}]"
        if kind == "text":
            msg["content"] += _block_text(b, p)
        elif kind == "thinking":
            msg["reasoning_content"] = msg.get("reasoning_content", "") + str(b.get("thinking") or "")
        elif kind == "redacted_thinking":
            continue                           # encrypted by Anthropic: nothing a local template can use
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad_param(p, "a tool_use block needs 'id' and 'name'")
            msg.setdefault("tool_calls", []).append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
        else:
            raise bad_param(f"{p}.type", f"assistant content blocks of type {kind!r} are not supported (text, "
                                         "thinking, tool_use are)")
    if not msg["content"] and "tool_calls" in msg:
        msg["content"] = None
    return msg


def chat_messages(body: CountTokensRequest) -> list[dict]:
    out: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(
            _block_text(b, f"system[{i}]") for i, b in enumerate(body.system))
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        param = f"messages[{i}].content"
        out += _user(blocks, param) if m.role == "user" else [_assistant(blocks, param)]
    return out


def _tools(tools: list[AnthropicTool] | None) -> list[dict] | None:
    if not tools:
        return None
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise bad_param(f"tools[{i}].type", f"only client tools (name, input_schema) are supported, got "
                                                f"{t.type!r} (Anthropic's server tools run on Anthropic's servers)")
    return [{"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                                 ("parameters", t.input_schema)) if v is not None}}
            for t in tools]


def _tool_choice(choice: AnthropicToolChoice | None):
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name or ""}}
    return {"any": "required"}.get(choice.type, choice.type)


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    tools = _tools(body.tools)
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body), "tools": tools,
                              "tool_choice": _tool_choice(body.tool_choice) if tools else None}
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences or None, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stream=body.stream, ignore_eos=body.ignore_eos,
                      seed=body.seed, min_p=body.min_p, repetition_penalty=body.repetition_penalty)
        fmt = body.output_config.format if body.output_config is not None else None
        if fmt is not None:           # structured output: the same grammar as chat's response_format
            fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.schema_}}
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err.get("loc", ())))
        raise ApiError(400, f"{str(err.get('msg', 'invalid request')).removeprefix('Value error, ')} (at {where})",
                       code="invalid_parameter") from None
