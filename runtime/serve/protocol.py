"""OpenAI API requests of `ktrun serve` as pydantic models (FastAPI validates bodies with them and shows them at
/docs), the strict JSON body reader, and the error envelope `{"error": {"message", "type", "param", "code"}}`.

Models are strict (a JSON "10" is not an integer, `true` is not a number) and finite (no inf/NaN); unknown fields
are ignored, as OpenAI clients send many. Checks that need the engine (context length, token ids in the vocabulary,
n <= --max-batch, the grammar of a json_schema) are made by the routes. Responses are in responses.py.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..defaults import API_TEMPERATURE

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1


class ApiError(HTTPException):
    """An error answered to the client: HTTP status + OpenAI-style envelope. An HTTPException, so FastAPI passes it
    through its body reading untouched (routes.KtrunRequest raises it for bad JSON and oversized bodies)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, close: bool = False):
        super().__init__(status, message, {"Connection": "close"} if close else None)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", "invalid_parameter", param)


def parse_json_body(raw: bytes) -> dict:
    """A request body as a JSON object. Stricter than json.loads: the text must be UTF-8 and every string valid
    Unicode (a lone surrogate escape like "\\ud800" is not)."""
    try:
        body = json.loads(raw.decode("utf-8"))
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as e:  # bad UTF-8 / JSON, a 5000-digit integer, nesting too deep
        raise ApiError(400, f"request body is not valid JSON: {type(e).__name__}: {str(e)[:200]}",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function"}


def error_param(loc) -> str | None:
    """pydantic's error location (('body', 'messages', 0, 'content', 'str'), ...) -> 'messages[0].content'
    (union member tags such as 'str' or 'list[int]' dropped)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or not str(part).replace("_", "").isalnum():
            break
        else:
            out += ("." if out else "") + str(part)
    return out or None


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


# -- pieces -----------------------------------------------------------------------------------------------------
class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """`json_object`: any JSON object; `json_schema`: JSON valid under json_schema.schema. Both are enforced by a
    grammar on the logits of every step (xgrammar), not just asked for in the prompt."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format type 'json_schema' needs a 'json_schema' object with a 'schema'")
        return self


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(Strict):
    type: str
    text: str = ""

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"only text content parts are supported, got a {v!r} part")
        return v


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_given(self):
        """As OpenAI: every message has content; an assistant's may be left out when it carries tool_calls."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"'content' is required in a {self.role} message"
                             + (" (or 'tool_calls')" if self.role == "assistant" else ""))
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it: content as text, 'developer' as 'system', tool-call arguments as
        an object (templates write them with tojson) when they are valid JSON."""
        m: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for k in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, k) is not None:
                m[k] = getattr(self, k)
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass
                calls.append({"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": args}})
            m["tool_calls"] = calls
        return m


# -- the two generation requests --------------------------------------------------------------------------------
class SamplingFields(Strict):
    """Fields /v1/completions and /v1/chat/completions share (vLLM's extra sampling fields included)."""

    model: str = Field(min_length=1, description="the served model's id (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX,
                                   description="default: 16 for completions, the rest of the context for chat")
    temperature: float | None = Field(None, ge=0, le=2, description=f"default {API_TEMPERATURE}; 0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="0 or -1 = off")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (as a string) -> bias added to its logit")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: list[str] | None = Field(None, description="a string or up to 16; the text ends before the first one")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=128, description="choices generated from the prompt (one shared prefill)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
            raise ValueError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty "
                             f"strings of at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        if v is not None and not all(k.isdigit() for k in v):
            raise ValueError("'logit_bias' keys must be token ids (as strings)")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _completion_prompt(v):
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        if min(v) < 0:
            raise ValueError("token ids in 'prompt' must be non-negative")
        return v
    if isinstance(v, str):
        return v
    raise ValueError("'prompt' must be a string, a list of token ids, or a list of one of those (batched prompts "
                     "are not supported: send one request per prompt)")


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(description="a string, token ids, or a list of one of those")
    echo: bool = Field(False, description="return the prompt before the completion (and its logprobs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="log-probability of each token and this many top alternatives")
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        return _completion_prompt(v)

    @model_validator(mode="after")
    def _refused(self):
        if self.echo and self.stream:
            raise ValueError("'echo' is not supported with 'stream'")
        if self.suffix:
            raise ValueError("'suffix' (insertion) is not supported")
        if self.best_of not in (None, 1, self.n):
            raise ValueError("'best_of' must equal 'n' (ranking choices by likelihood is not supported)")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (e.g. enable_thinking)")
    separate_reasoning: bool | None = Field(
        None, description="reasoning text as message.reasoning_content (default) or inline in content")

    @model_validator(mode="after")
    def _checks(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("'tool_choice' needs 'tools'")
        return self


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if self.prompt is None and self.messages is None:
            raise ValueError("send 'prompt' (a string) or 'messages'")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
