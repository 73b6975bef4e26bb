"""`ktrun generate`: load a converted directory and continue one prompt, streaming the text."""
from __future__ import annotations

import json
import sys

import click


class _TextStreamer:
    """Prints the decoded continuation as tokens arrive; holds back an incomplete UTF-8 character (U+FFFD)."""

    def __init__(self, decode):
        self.decode, self.ids, self.sent = decode, [], 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[self.sent:])
        sys.stdout.flush()
        self.sent = len(text)


@click.command("generate")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", "-p", required=True, help="Prompt text (with --chat: the user message).")
@click.option("--chat", is_flag=True, help="Wrap the prompt with the model's chat template (as a user message).")
@click.option("--system", default=None, help="System message for --chat.")
@click.option("--max-tokens", "-n", default=128, show_default=True, type=click.IntRange(1), help="Tokens to generate.")
@click.option("--temperature", "-t", default=0.0, show_default=True, type=click.FloatRange(0), help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="0 = off.")
@click.option("--seed", default=None, type=int, help="Sampling seed (reproducible output with temperature > 0).")
@click.option("--ctx", default=4096, show_default=True, type=click.IntRange(1), help="Context limit in tokens.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (prompt/generated token ids, text).")
@click.option("--verify", is_flag=True, help="Check every file's sha256 against manifest.json before loading.")
@click.option("--dense-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="dtype of the dense layers (auto: bfloat16 on CUDA, float32 on the CPU).")
@click.option("--device", default=None, help="torch device for the dense layers (default: cuda if available, else cpu).")
@click.option("--reference-experts", is_flag=True, help="Use the torch reference for routed experts, not the kernels.")
@click.option("--numa-prefault", is_flag=True,
              help="Fault each NUMA node's expert shards in from a thread bound to that node (reads them at start).")
def generate(model_dir, prompt, chat, system, max_tokens, temperature, top_p, top_k, seed, ctx, ignore_eos, as_json,
             verify, dense_dtype, device, reference_experts, numa_prefault):
    """Generate a continuation of --prompt with the converted model in MODEL_DIR.

    \b
    Examples:
      ktrun generate converted/ --prompt "def fibonacci(n):" --max-tokens 64
      ktrun generate converted/ --chat --prompt "Why is the sky blue?" --temperature 0.7 --seed 1
      ktrun generate converted/ --prompt "Hello" --json      # {"prompt_token_ids": [...], "token_ids": [...], ...}
    """
    import torch

    from .engine import Engine
    from .generate import generate as run_generate
    from .loader import LoadError
    from .models.config import ConfigError
    from .sampling import SamplingParams
    from .tokenizer import TokenizerError

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                ignore_eos=ignore_eos)
        eng = Engine(model_dir, ctx=ctx, max_batch=1, device=device, verify=verify,
                     use_kernels=False if reference_experts else None, quiet=as_json, numa_prefault=numa_prefault,
                     dtype=None if dense_dtype == "auto" else getattr(torch, dense_dtype))
        tok = eng.tokenizer
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            prompt_ids = tok.apply_chat_template(msgs)
        else:
            prompt_ids = tok.encode(prompt)
    except (LoadError, ConfigError, TokenizerError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if len(prompt_ids) > ctx:
        raise click.ClickException(f"--prompt is {len(prompt_ids)} tokens, longer than --ctx {ctx}")
    streamer = None if as_json else _TextStreamer(tok.decode)
    out = run_generate(eng.model, prompt_ids, params, ctx, eng.eos_ids, decode_text=tok.decode, callback=streamer)
    eng.close()
    text = tok.decode(out.tokens)
    if as_json:
        click.echo(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": out.tokens, "text": text,
                               "finish_reason": out.finish_reason, "prefill_s": round(out.prefill_s, 6),
                               "decode_s": round(out.decode_s, 6)}))
    else:
        if streamer.sent < len(text):
            sys.stdout.write(text[streamer.sent:])
        sys.stdout.write("\n")
        rate = (len(out.tokens) - 1) / out.decode_s if out.decode_s > 0 and len(out.tokens) > 1 else 0.0
        click.echo(f"[{len(prompt_ids)} prompt tokens in {out.prefill_s:.2f} s, {len(out.tokens)} generated, "
                   f"{rate:.2f} tok/s decode, finish: {out.finish_reason}]", err=True)
