"""`ktrun serve`: the OpenAI-compatible HTTP server around an Engine, on FastAPI + uvicorn (torch-free until the
engine loads).

    app.py            the FastAPI app and run_server: state, API key, error envelope, bind-then-load, uvicorn
    server.py         uvicorn as run: h11 connections with read deadlines and a head size limit (HTTP/1.0 streams
                      unchunked), and the graceful drain on SIGTERM/SIGINT
    routes.py         the endpoints: /health, /v1/models, /metrics, /tokenize, /detokenize, /tokenizer_info, and the
                      generation routes (request body limits and strict JSON in KtrunRequest)
    protocol.py       request models (pydantic), the strict JSON reader, ApiError and the error envelope
    responses.py      response and stream-chunk models (pydantic), SSE framing
    generation.py     one request: engine tokens -> text -> reasoning / content / tool calls, logprobs, timings
    engine_loop.py    EngineLoop: engine.step() for every request, on the event loop (prefills in a worker thread)
    tool_parsers.py   tool calls in generated text, per model family (DeepSeek-V3/V3.1, Hermes/Qwen3, GLM-4.5, Kimi-K2)
    reasoning.py      <think> ... </think> split into reasoning_content
    structured.py     response_format json_object / json_schema enforced by xgrammar
    responses_request.py, responses_api.py   /v1/responses (OpenAI's Responses API) as a chat request; its answer
    response_store.py the bounded store of responses for previous_response_id
    messages_request.py, messages_api.py     /v1/messages (Anthropic's Messages API) as a chat request; its answer
    anthropic_errors.py  errors under /v1/messages in Anthropic's envelope
    output_blocks.py  a choice's reasoning / text / tool calls as a sequence of blocks (both APIs above)
    metrics.py        /metrics with prometheus_client (vLLM's metric names under ktrun_)

The CLI entry is ktrun.cli.cmd_serve; text and stop strings come from ktrun.text.text_stream (the rule generate() and the
Engine use too).
"""
from .app import DEFAULT_MAX_BODY_BYTES, run_server

__all__ = ["DEFAULT_MAX_BODY_BYTES", "run_server"]
