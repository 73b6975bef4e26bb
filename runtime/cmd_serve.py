"""`ktrun serve`: an OpenAI-compatible HTTP server for a converted directory."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import click
from ktrun.serve import DEFAULT_MAX_BODY_BYTES, run_server

from .gpu_weights_option import gpu_weights_option

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


class ByteSize(click.ParamType):
    """'4GiB', '512MB', '16G', '0' -> bytes. (ktconvert has its own parser; ktrun never imports ktconvert.)"""

    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*", str(value), re.IGNORECASE)
        if not m:
            self.fail(f"{value!r} is not a size like 4GiB, 512MB, 16G or 0", param, ctx)
        return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


@click.command("serve")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Loopback by default; use 0.0.0.0 only behind a firewall and with --api-key.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port (0: pick a free one; the chosen address is printed on stderr).")
@click.option("--api-key", default=None, envvar="KTRUN_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (env: KTRUN_API_KEY).")
@click.option("--ctx", default=4096, show_default=True, type=click.IntRange(1),
              help="Context length per request in tokens (prompt + generated).")
@click.option("--max-batch", default=16, show_default=True, type=click.IntRange(1, 4096),
              help="Requests decoded together; more wait in line for a free slot.")
@click.option("--device", default=None, help="torch device for the GPU layers (default: cuda if present, else cpu).")
@click.option("--verify", is_flag=True, help="Check every file's sha256 against the manifest before serving.")
@click.option("--max-body-bytes", default=DEFAULT_MAX_BODY_BYTES, show_default=True, type=click.IntRange(1),
              help="Largest request body accepted (larger: 413).")
@click.option("--log-requests", is_flag=True, help="Print an access log line per HTTP request on stderr.")
@click.option("--no-prefix-cache", is_flag=True,
              help="Prefill every prompt in full (no KV blocks are kept between requests).")
@click.option("--prefix-cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of the disk tier of the prefix cache (kept across restarts; one server per folder).")
@click.option("--prefix-cache-disk", type=ByteSize(), default="16GiB", show_default=True,
              help="Byte budget of the disk tier.")
@click.option("--prefix-cache-ram", type=ByteSize(), default="4GiB", show_default=True,
              help="Byte budget of the CPU RAM tier (blocks evicted from the device; 0: none).")
@click.option("--prefix-cache-device", type=ByteSize(), default=None,
              help="Bytes of cached blocks no request uses kept on the compute device (default: what the KV pool "
                   "has room for; it never grows for them).")
@gpu_weights_option
def serve(model_dir, host, port, api_key, ctx, max_batch, device, verify, max_body_bytes, log_requests,
          no_prefix_cache, prefix_cache_dir, prefix_cache_disk, prefix_cache_ram, prefix_cache_device, gpu_weights):
    """Serve MODEL_DIR (a `ktconvert quantize` output) over the OpenAI API.

    Endpoints: GET /health (503 while loading, 200 when ready), GET /v1/models, POST /v1/completions,
    POST /v1/chat/completions (both with "stream": true for server-sent events), POST /tokenize,
    POST /detokenize, GET /metrics (Prometheus text).

    Prefix cache (on unless --no-prefix-cache): the KV blocks of earlier prompts are reused by later requests
    with the same prefix (system prompt, conversation so far), from the device, the RAM tier or the disk tier;
    usage.prompt_tokens_details.cached_tokens says how many prompt tokens were not prefilled.

    \b
    Examples:
      ktrun serve converted/ --port 8000
      ktrun serve converted/ --ctx 8192 --max-batch 32 --api-key "$(cat key.txt)"
      ktrun serve converted/ --prefix-cache-dir /nvme/ktrun-cache --prefix-cache-disk 200GB --prefix-cache-ram 32GiB
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "converted", "messages": [{"role": "user", "content": "Hi"}], "stream": true}'
    """
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        click.echo(f"ktrun serve: warning: listening on {host} without --api-key: anyone who can reach this port "
                   "can use the model", err=True)

    def load_engine():  # runs after the socket is bound, so /health answers 503 during the (torch) import too
        from ktrun.engine import Engine, PrefixCacheConfig

        prefix = False if no_prefix_cache else PrefixCacheConfig(
            device_bytes=prefix_cache_device, ram_bytes=prefix_cache_ram, disk_dir=prefix_cache_dir,
            disk_bytes=prefix_cache_disk)
        return Engine(str(model_dir), ctx=ctx, max_batch=max_batch, device=device, verify=verify,
                      gpu_weights=gpu_weights, prefix_cache=prefix)

    def sampling_params(**kw):
        from ktrun.engine import SamplingParams

        return SamplingParams(**kw)

    sys.exit(run_server(load_engine, sampling_params, host=host, port=port, api_key=api_key, max_batch=max_batch,
                        max_body_bytes=max_body_bytes, log_requests=log_requests))
