"""OpenAI API wire format for `ktrun serve`: request validation into typed requests, response and SSE chunk
builders, and the error envelope `{"error": {"message", "type", "param", "code"}}`.

Nothing here touches the engine: the server tokenizes, checks lengths against the context and runs requests.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class ApiError(Exception):
    """An error answered to the client: HTTP status + OpenAI-style envelope."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", "invalid_parameter", param)


@dataclass
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    kind: str                              # "chat" | "completion"
    model: str
    prompt: str | list[int] | None = None  # completion: text or token ids
    messages: list[dict] | None = None     # chat: [{"role", "content": str}], content already flattened to text
    max_tokens: int | None = None          # None: the server fills in its default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                         # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    echo: bool = False


def parse_json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw.decode("utf-8"))
        # strings must be valid Unicode all the way through (a lone surrogate escape like "\ud800" is not)
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as e:  # bad UTF-8 / JSON, a 5000-digit integer, nesting too deep
        raise ApiError(400, f"request body is not valid JSON: {type(e).__name__}: {str(e)[:200]}",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


# -- field validators: `bool` is an `int` in Python, so every numeric check excludes it explicitly -----------------
def _number(body: dict, name: str, default, lo: float, hi: float):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad_param(name, f"'{name}' must be a number in [{lo}, {hi}], got {json.dumps(v)}")
    return float(v)


def _integer(body: dict, name: str, default, lo: int, hi: int):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad_param(name, f"'{name}' must be an integer in [{lo}, {hi}], got {json.dumps(v)}")
    return v


def _boolean(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_param(name, f"'{name}' must be true or false, got {json.dumps(v)}")
    return v


def _top_p(body: dict) -> float:
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise bad_param("top_p", "'top_p' must be in (0, 1]")
    return top_p


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise bad_param("stop", f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                                f"non-empty strings of at most {MAX_STOP_CHARS} characters")
    return list(stops)


def _unsupported(body: dict) -> None:
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad_param("n", f"only n=1 is supported, got n={json.dumps(n)}")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise bad_param("best_of", "only best_of=1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad_param(name, f"'{name}' is not supported (only 0)")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad_param("logprobs", "logprobs are not supported")
    if body.get("tools") or body.get("functions"):
        raise bad_param("tools", "tool calls are not supported")


def _common(body: dict, kind: str) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("model", "'model' is required and must be a string")
    _unsupported(body)
    max_tokens = _integer(body, "max_tokens", None, 1, 2**31 - 1)
    if kind == "chat":
        max_tokens = _integer(body, "max_completion_tokens", max_tokens, 1, 2**31 - 1)
    top_k = _integer(body, "top_k", 0, -1, 2**31 - 1)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_param("stream_options", "'stream_options' must be an object")
    stream = _boolean(body, "stream", False)
    include_usage = _boolean(stream_options or {}, "include_usage", False)
    if stream_options is not None and not stream:
        raise bad_param("stream_options", "'stream_options' is only allowed when 'stream' is true")
    return GenerationRequest(
        kind=kind, model=model, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(body),
        top_k=max(top_k, 0), seed=_integer(body, "seed", None, -(2**63), 2**64 - 1),
        stop=_stop(body), ignore_eos=_boolean(body, "ignore_eos", False),
        stream=stream, include_usage=include_usage)


def parse_completion(body: dict) -> GenerationRequest:
    req = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if min(prompt) < 0:
            raise bad_param("prompt", "token ids in 'prompt' must be non-negative")
    elif not isinstance(prompt, str):
        raise bad_param("prompt", "'prompt' must be a string, a list of token ids, or a list of one of those "
                                  "(batched prompts are not supported: send one request per prompt)")
    req.prompt = prompt
    req.echo = _boolean(body, "echo", False)
    if req.echo and req.stream:
        raise bad_param("echo", "'echo' is not supported with 'stream'")
    if body.get("suffix"):
        raise bad_param("suffix", "'suffix' is not supported")
    return req


def _content_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_param(f"messages[{i}].content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise bad_param(f"messages[{i}].content", "message content must be a string or a list of text parts")


def parse_chat(body: dict) -> GenerationRequest:
    req = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_param(f"messages[{i}]", "each message must be an object with a string 'role'")
        if m["role"] not in ("system", "user", "assistant", "developer", "tool"):
            raise bad_param(f"messages[{i}].role", f"unknown role {m['role']!r}")
        out.append({"role": "system" if m["role"] == "developer" else m["role"],
                    "content": _content_text(m.get("content"), i)})
    req.messages = out
    return req


# -- responses ---------------------------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens served from the prefix cache (not prefilled)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def full_response(req: GenerationRequest, rid: str, created: int, text: str, finish_reason: str,
                  use: dict) -> dict:
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice], "usage": use}


def chunk(req: GenerationRequest, rid: str, created: int, *, text: str | None = None, role: bool = False,
          finish_reason: str | None = None) -> dict:
    """One streamed event. Chat: `delta` carries the role (first chunk) or content; completion: `text`."""
    if req.kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: GenerationRequest, rid: str, created: int, use: dict) -> dict:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [], "usage": use}


def sse(obj) -> bytes:
    """One server-sent event: `data: {json}` (or `data: [DONE]`) and a blank line."""
    payload = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def models_list(model_name: str, created: int, ctx: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "ktrun", "max_model_len": ctx}]}


def now() -> int:
    return int(time.time())
