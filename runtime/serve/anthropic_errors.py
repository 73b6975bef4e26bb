"""Errors of the Messages API in Anthropic's envelope: `{"type": "error", "error": {"type", "message"}}`.

Every error of the server is first written in OpenAI's envelope (the routes, pydantic's validation, the API-key and
body-size checks all share app.py's handlers). This ASGI layer rewrites the answers under /v1/messages with an error
status into Anthropic's envelope, so no check has to know which API it answers. Errors inside a started stream are
written by messages_api.py as an `error` event.
"""
from __future__ import annotations

import json

PATH = "/v1/messages"
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    kind = TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicErrors:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            return await self.app(scope, receive, send)
        held: dict = {}

        async def rewriting_send(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held["start"], held["body"] = message, b""      # an error answer: read it whole first
                return
            if "start" not in held:
                return await send(message)
            held["body"] += message.get("body", b"")
            if message.get("more_body"):
                return
            start = held["start"]
            body = _rewrite(start["status"], held["body"])
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)


def _rewrite(status: int, body: bytes) -> bytes:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace") or f"HTTP {status}"
    return json.dumps(anthropic_error(status, message), ensure_ascii=False).encode()
