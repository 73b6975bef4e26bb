"""`ktrun serve`: an OpenAI-compatible HTTP server for a converted directory."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from ..byte_sizes import parse_bytes
from ..defaults import DEFAULT_CTX, DEFAULT_MAX_BATCH
from ..serve import DEFAULT_MAX_BODY_BYTES, run_server
from ..serve.server import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
)
from .expert_ram_option import expert_ram_from, expert_ram_options
from .gpu_weights_option import gpu_weights_option
from .hot_experts_option import hot_experts_from, hot_experts_options
from .speculative_option import speculative_from, speculative_options


def _size(ctx, param, value):
    """A byte-size option ('4GiB', '512MB', '16G', '0') -> bytes, or None when not given."""
    return None if value is None else parse_bytes(str(value), param.opts[0])


@click.command("serve")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Loopback by default; use 0.0.0.0 only behind a firewall and with --api-key.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port (0: pick a free one; the chosen address is printed on stderr).")
@click.option("--api-key", default=None, envvar="KTRUN_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (env: KTRUN_API_KEY).")
@click.option("--ctx", default=DEFAULT_CTX, show_default=True, type=click.IntRange(1),
              help="Context length per request in tokens (prompt + generated).")
@click.option("--max-batch", default=DEFAULT_MAX_BATCH, show_default=True, type=click.IntRange(1, 4096),
              help="Requests decoded together; more wait in line for a free slot.")
@click.option("--device", default=None, help="torch device for the GPU layers (default: cuda if present, else cpu).")
@click.option("--verify", is_flag=True, help="Check every file's sha256 against the manifest before serving.")
@click.option("--max-body-bytes", default=DEFAULT_MAX_BODY_BYTES, show_default=True, type=click.IntRange(1),
              help="Largest request body accepted (larger: 413).")
@click.option("--max-header-bytes", default=DEFAULT_MAX_HEADER_BYTES, show_default=True, type=click.IntRange(1024),
              help="Largest request head (request line and headers) accepted (larger: 431).")
@click.option("--header-timeout", default=DEFAULT_HEADER_TIMEOUT, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds a client has to send a request's headers, from connecting or its first byte on a "
                   "kept-alive connection (then: 408 and closed), as nginx's client_header_timeout.")
@click.option("--body-timeout", default=DEFAULT_BODY_TIMEOUT, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds a request body may pause between two reads before the connection is closed, as nginx's "
                   "client_body_timeout.")
@click.option("--keep-alive-timeout", default=DEFAULT_KEEP_ALIVE_TIMEOUT, show_default=True,
              type=click.FloatRange(min=0.1),
              help="Seconds an idle keep-alive connection stays open (uvicorn's timeout_keep_alive).")
@click.option("--max-connections", default=DEFAULT_MAX_CONNECTIONS, show_default=True, type=click.IntRange(0),
              help="Open connections (or running requests) beyond which requests get 503 (uvicorn's "
                   "limit_concurrency; 0: no limit).")
@click.option("--drain-timeout", default=DEFAULT_DRAIN_TIMEOUT, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM/SIGINT: stop accepting, let running requests finish for up to this many seconds, "
                   "then end the rest with an error (streams: an error event and [DONE]; others: 503) and exit 0. "
                   "A second signal exits at once.")
@click.option("--log-requests", is_flag=True, help="Print an access log line per HTTP request on stderr.")
@click.option("--tool-call-parser", default="auto", show_default=True,
              type=click.Choice(["auto", "none", "deepseek_v3", "deepseek_v31", "hermes", "glm45", "kimi_k2"]),
              help="How tool calls are found in the generated text (auto: from the model's vocabulary and chat "
                   "template; hermes is Qwen2.5/Qwen3's <tool_call> JSON).")
@click.option("--reasoning-parser", default="auto", show_default=True, type=click.Choice(["auto", "think", "none"]),
              help="Split <think>...</think> text into reasoning_content (auto: when the model has think tokens or "
                   "its template writes them).")
@click.option("--reasoning-inline", is_flag=True,
              help="Keep reasoning text inline in content by default (a request's separate_reasoning overrides).")
@click.option("--no-timings-log", is_flag=True, help="No per-request timing line on stderr.")
@click.option("--no-prefix-cache", is_flag=True,
              help="Prefill every prompt in full (no KV blocks are kept between requests).")
@click.option("--prefix-cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of the disk tier of the prefix cache (kept across restarts; one server per folder).")
@click.option("--prefix-cache-disk", metavar="SIZE", callback=_size, default="16GiB", show_default=True,
              help="Byte budget of the disk tier.")
@click.option("--prefix-cache-ram", metavar="SIZE", callback=_size, default="4GiB", show_default=True,
              help="Byte budget of the CPU RAM tier (blocks evicted from the device; 0: none).")
@click.option("--prefix-cache-device", metavar="SIZE", callback=_size, default=None,
              help="Bytes of cached blocks no request uses, and of recurrent-state snapshots (linear-attention "
                   "models), kept on the compute device (default: blocks as the KV pool has room for, it never grows "
                   "for them; up to --max-batch snapshots).")
@click.option("--prefix-cache-state-every", metavar="TOKENS", type=click.IntRange(0), default=0, show_default=True,
              help="Linear-attention models: also keep a state snapshot every TOKENS prompt tokens (0: only at the "
                   "prompt's end, where prompts part from cached ones, and where a request stops).")
@gpu_weights_option
@hot_experts_options()
@expert_ram_options
@speculative_options
def serve(model_dir, host, port, api_key, ctx, max_batch, device, verify, max_body_bytes, max_header_bytes,
          header_timeout, body_timeout, keep_alive_timeout, max_connections, drain_timeout, log_requests,
          tool_call_parser, reasoning_parser, reasoning_inline, no_timings_log, no_prefix_cache, prefix_cache_dir,
          prefix_cache_disk, prefix_cache_ram, prefix_cache_device, prefix_cache_state_every, gpu_weights, **hot):
    """Serve MODEL_DIR (a `ktconvert quantize` output) over the OpenAI API.

    Endpoints: GET /health (503 while loading, 200 when ready), GET /v1/models, POST /v1/completions,
    POST /v1/chat/completions (both with "stream": true for server-sent events), POST /tokenize,
    POST /detokenize, GET /tokenizer_info, GET /metrics (Prometheus text), GET /docs (OpenAPI).

    Prefix cache (on unless --no-prefix-cache): the KV blocks of earlier prompts are reused by later requests
    with the same prefix (system prompt, conversation so far), from the device, the RAM tier or the disk tier;
    usage.prompt_tokens_details.cached_tokens says how many prompt tokens were not prefilled. Linear-attention
    models (Qwen3-Next, Qwen3.5-MoE) resume where a snapshot of their recurrent state was kept.

    \b
    Examples:
      ktrun serve converted/ --port 8000
      ktrun serve converted/ --ctx 8192 --max-batch 32 --api-key "$(cat key.txt)"
      ktrun serve converted/ --profile profile.json --gpu-mem 24GB --dynamic-experts   # hot experts, kept fresh
      ktrun serve converted/ --expert-ram 200GB          # experts beyond 200 GB of RAM read from disk
      ktrun serve converted/ --speculative ngram --draft-tokens 4   # drafts from each request's own context
      ktrun serve converted/ --speculative mtp --draft-tokens 1     # drafts from the checkpoint's MTP layer
      ktrun serve qwen3-converted/ --tool-call-parser hermes --reasoning-inline
      ktrun serve converted/ --prefix-cache-dir /nvme/ktrun-cache --prefix-cache-disk 200GB --prefix-cache-ram 32GiB
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "converted", "messages": [{"role": "user", "content": "Hi"}], "stream": true}'

    Requests take OpenAI's fields plus vLLM's extras (top_k, min_p, repetition_penalty, stop_token_ids,
    ignore_eos, chat_template_kwargs): logprobs, n, penalties, logit_bias, tools (parsed per model family),
    reasoning_content, response_format json_object / json_schema (grammar-enforced). runtime/serve/README.md: what is refused.
    """
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        click.echo(f"ktrun serve: warning: listening on {host} without --api-key: anyone who can reach this port "
                   "can use the model", err=True)

    spec = speculative_from(hot)
    ram_opts = expert_ram_from(hot)
    hot_opts = hot_experts_from(hot)

    def load_engine():  # runs after the socket is bound, so /health answers 503 during the (torch) import too
        from ..engine import Engine, PrefixCacheConfig

        prefix = False if no_prefix_cache else PrefixCacheConfig(
            device_bytes=prefix_cache_device, ram_bytes=prefix_cache_ram, disk_dir=prefix_cache_dir,
            disk_bytes=prefix_cache_disk, state_every=prefix_cache_state_every)
        return Engine(str(model_dir), ctx=ctx, max_batch=max_batch, device=device, verify=verify,
                      gpu_weights=gpu_weights, hot_experts=hot_opts, prefix_cache=prefix, expert_ram=ram_opts,
                      speculative=spec)

    def sampling_params(**kw):
        from ..engine import SamplingParams

        return SamplingParams(**kw)

    code = run_server(load_engine, sampling_params, host=host, port=port, api_key=api_key, max_batch=max_batch,
                        max_body_bytes=max_body_bytes, log_requests=log_requests, tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser, separate_reasoning=not reasoning_inline,
                        log_timings=not no_timings_log, header_timeout=header_timeout, body_timeout=body_timeout,
                        keep_alive_timeout=keep_alive_timeout, max_header_bytes=max_header_bytes,
                        max_connections=max_connections, drain_timeout=drain_timeout)
    # The server has shut down (engine stopped, prefix cache written): exit without the interpreter's teardown of
    # torch and the model's memory (0.7-1.5 s of CPU), so a drained server is gone within --drain-timeout + 2 s.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
