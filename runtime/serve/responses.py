"""OpenAI API responses of `ktrun serve` as pydantic models: what /docs shows and what goes on the wire.

Responses are serialized with exclude_unset, where a field with a non-null default (object, role, index, ...) counts
as set: a field whose default is null appears only when the server set it (to a value or to null), so a chat delta
carries only what changed, and `usage: null` rides on stream chunks only with include_usage, as OpenAI sends them. `timings` (per request, like llama-server's) is an extension the openai client keeps as an extra field.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Out(BaseModel):
    model_config = ConfigDict(extra="allow")

    def model_post_init(self, context) -> None:
        fields = type(self).model_fields
        self.__pydantic_fields_set__.update(
            k for k, f in fields.items() if f.default is not None or f.default_factory is not None)

    def dump(self) -> dict:
        return self.model_dump(exclude_unset=True, by_alias=True)

    def sse(self) -> bytes:
        return b"data: " + self.model_dump_json(exclude_unset=True, by_alias=True).encode() + b"\n\n"


def sse(obj: Out | dict | str) -> bytes:
    """One server-sent event: `data: {json}` (or `data: [DONE]`) and a blank line."""
    if isinstance(obj, Out):
        return obj.sse()
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


# -- shared ------------------------------------------------------------------------------------------------------
class ErrorInfo(Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Out):
    error: ErrorInfo


class PromptTokensDetails(Out):
    cached_tokens: int = 0


class Usage(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class Timings(Out):
    """Per request, measured by the server (ms): waiting for a slot, prompt (admission to first token), generation
    (first to last token); rates per second."""
    queue_ms: float
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int | None = None                # speculative decoding: tokens drafted, and accepted (when any drafted)
    draft_n_accepted: int | None = None


class ModelCard(Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ktrun"
    max_model_len: int


class ModelList(Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(Out):
    status: Literal["ok"] = "ok"


class TokenizeResponse(Out):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(Out):
    prompt: str


class TokenizerInfo(Out):
    """vLLM's /tokenizer_info (lm-evaluation-harness's remote tokenizer reads it)."""
    tokenizer_class: str = "PreTrainedTokenizerFast"
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    model_max_length: int


# -- logprobs ----------------------------------------------------------------------------------------------------
class CompletionLogprobs(Out):
    """Legacy completions format: per token its text, log-probability (null for the first prompt token), the top
    alternatives {text: logprob}, and the character offset of the token in the returned text."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(Out):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(Out):
    content: list[ChatTokenLogprob] | None = None


# -- completions -------------------------------------------------------------------------------------------------
class CompletionChoice(Out):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None


# -- chat --------------------------------------------------------------------------------------------------------
class FunctionCallOut(Out):
    name: str
    arguments: str


class ToolCallOut(Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Out):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class DeltaFunction(Out):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Out):
    """A streamed piece of tool call `index`: the first carries id, type and name; later ones argument text."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Out):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timings: Timings | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> Usage:
    u = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
              total_tokens=prompt_tokens + completion_tokens)
    if cached is not None:
        u.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
    return u


def error_body(status_message: str, type_: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": status_message, "type": type_, "param": param, "code": code}}
