"""`ktrun serve`: the OpenAI-compatible HTTP server around an Engine (torch-free until the engine loads).

    app.py            the HTTP server: state, request plumbing (body limits, API key, errors), run_server
    routes.py         the endpoints: /health, /v1/models, /metrics, /tokenize, /detokenize, the generation routes
    protocol.py       the OpenAI wire format: request validation, responses, SSE chunks, the error envelope
    engine_thread.py  EngineThread: the one thread that drives engine.step() for every request
    metrics.py        Prometheus text for /metrics

The CLI entry is ktrun.cmd_serve; text and stop strings come from ktrun.text_stream (the rule generate() and the
Engine use too).
"""
from .app import DEFAULT_MAX_BODY_BYTES, run_server

__all__ = ["DEFAULT_MAX_BODY_BYTES", "run_server"]
