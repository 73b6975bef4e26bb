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
    engine_thread.py  EngineThread: the one thread that drives engine.step() for every request
    tool_parsers.py   tool calls in generated text, per model family (DeepSeek-V3/V3.1, Hermes/Qwen3, GLM-4.5, Kimi-K2)
    reasoning.py      <think> ... </think> split into reasoning_content
    structured.py     response_format json_object / json_schema enforced by xgrammar
    metrics.py        /metrics with prometheus_client (vLLM's metric names under ktrun_)

The CLI entry is ktrun.cli.cmd_serve; text and stop strings come from ktrun.text.text_stream (the rule generate() and the
Engine use too).
"""
from .app import DEFAULT_MAX_BODY_BYTES, run_server

__all__ = ["DEFAULT_MAX_BODY_BYTES", "run_server"]
