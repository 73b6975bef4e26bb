"""`ktrun generate`: load a converted directory and continue one prompt, streaming the text."""
from __future__ import annotations

import json
import sys

import click

from ..defaults import DEFAULT_CTX
from .expert_ram_option import expert_ram_from, expert_ram_options
from .gpu_weights_option import gpu_weights_option
from .hot_experts_option import hot_experts_from, hot_experts_options
from .speculative_option import speculative_from, speculative_options


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
@click.option("--ctx", default=DEFAULT_CTX, show_default=True, type=click.IntRange(1), help="Context limit in tokens.")
@click.option("--stop", multiple=True, metavar="TEXT",
              help="Stop when the text contains TEXT (repeatable); the output ends before it.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (prompt/generated token ids, text).")
@click.option("--verify", is_flag=True, help="Check every file's sha256 against manifest.json before loading.")
@click.option("--dense-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="dtype of the dense layers (auto: bfloat16 on CUDA, float32 on the CPU).")
@click.option("--device", default=None, help="torch device for the dense layers (default: cuda if available, else cpu).")
@click.option("--reference-experts", is_flag=True, help="Use the torch reference for routed experts, not the kernels.")
@click.option("--numa-prefault", is_flag=True,
              help="Fault each NUMA node's expert shards in from a thread bound to that node (reads them at start).")
@gpu_weights_option
@hot_experts_options()
@expert_ram_options
@speculative_options
def generate(model_dir, prompt, chat, system, max_tokens, temperature, top_p, top_k, seed, ctx, stop, ignore_eos,
             as_json, verify, dense_dtype, device, reference_experts, numa_prefault, gpu_weights, **hot):
    """Generate a continuation of --prompt with the converted model in MODEL_DIR.

    \b
    Examples:
      ktrun generate converted/ --prompt "def fibonacci(n):" --max-tokens 64
      ktrun generate converted/ --chat --prompt "Why is the sky blue?" --temperature 0.7 --seed 1
      ktrun generate converted/ --prompt "Hello" --json      # {"prompt_token_ids": [...], "token_ids": [...], ...}
      ktrun generate converted/ --prompt "1, 2, 3," --stop "10" --ctx 2048
      ktrun generate converted/ --profile profile.json --gpu-experts 8 --prompt "def f(x):"   # hot experts on GPU
      ktrun generate converted/ --expert-ram 200GB --prompt "Hello"    # experts beyond 200 GB read from disk
      ktrun generate converted/ --prompt "$(cat edit.py)" --speculative ngram --draft-tokens 6   # prompt lookup
      ktrun generate converted/ --prompt "def f(x):" --speculative mtp --draft-tokens 2   # the model's MTP layer
    """
    import torch
    from ktlayouts.families import ConfigError

    from ..generate import generate as run_generate
    from ..loaded_model import load_model
    from ..loader import LoadError
    from ..sampling import SamplingParams
    from ..text.tokenizer import TokenizerError

    spec = speculative_from(hot)
    ram_opts = expert_ram_from(hot)
    hot_opts = hot_experts_from(hot)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=list(stop), ignore_eos=ignore_eos)
        lm = load_model(model_dir, device=device, verify=verify, use_kernels=False if reference_experts else None,
                        quiet=as_json, numa_prefault=numa_prefault, gpu_weights=gpu_weights,
                        dtype=None if dense_dtype == "auto" else getattr(torch, dense_dtype), hot_experts=hot_opts,
                        kv_tokens=ctx, expert_ram=ram_opts, mtp=spec is not None and spec.needs_mtp)
        spec = spec.with_mtp(lm.mtp) if spec is not None else None
        tok = lm.tokenizer
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            prompt_ids = tok.apply_chat_template(msgs)
        else:
            prompt_ids = tok.encode(prompt)
    except (LoadError, ConfigError, TokenizerError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    # streamed text: never an incomplete character or the start of a possible stop string (ktrun.text.text_stream)
    streamer = None if as_json else (lambda delta: (sys.stdout.write(delta), sys.stdout.flush()))
    if hot_opts is not None and not as_json:
        from ..experts.hot import describe
        click.echo(describe(lm.model.experts), err=True)
    with lm:
        if len(prompt_ids) >= ctx:
            raise click.ClickException(f"--prompt is {len(prompt_ids)} tokens, longer than --ctx {ctx} allows (the "
                                       "context holds the prompt and the generated tokens: at least 1)")
        out = run_generate(lm.model, prompt_ids, params, ctx, lm.eos_ids, decode_text=tok.decode, on_text=streamer,
                           speculative=spec)
    if as_json:
        click.echo(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": out.tokens, "text": out.text,
                               "finish_reason": out.finish_reason, "prefill_s": round(out.prefill_s, 6),
                               "decode_s": round(out.decode_s, 6),
                               **({"draft_tokens": out.drafted, "accepted_tokens": out.accepted} if spec else {})}))
    else:
        sys.stdout.write("\n")
        rate = (len(out.tokens) - 1) / out.decode_s if out.decode_s > 0 and len(out.tokens) > 1 else 0.0
        click.echo(f"[{len(prompt_ids)} prompt tokens in {out.prefill_s:.2f} s, {len(out.tokens)} generated, "
                   f"{rate:.2f} tok/s decode, finish: {out.finish_reason}"
                   + (f", {out.accepted}/{out.drafted} drafted tokens accepted" if spec else "") + "]", err=True)
