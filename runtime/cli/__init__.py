"""`ktrun` command line (the entry point `ktrun = ktrun.cli:main`). Each subcommand lives in its own module and is
imported only when used, so `ktrun --help` never loads torch. The top wing of ktrun: nothing else imports it.

    cmd_generate.py        `ktrun generate`: one prompt, streamed
    cmd_bench.py           `ktrun bench`: ppN / tgN like llama-bench, and the decode step against its roofline
    decode_bytes.py        bytes of weights one decoded token reads (the roofline of `ktrun bench`)
    cmd_serve.py           `ktrun serve`: the OpenAI-compatible server (ktrun.serve) around an Engine
    cmd_perplexity.py      `ktrun perplexity`: llama-perplexity's protocol, KL divergence against a base
    hot_experts_option.py  --profile / --gpu-experts / --gpu-mem ...: the one parser, shared with `ktconvert quantize`
    expert_ram_option.py   --expert-ram and its knobs (the RAM tier)
    gpu_weights_option.py  --gpu-weights
    lazy_group.py          the click group that imports a subcommand only when it runs (ktconvert uses it too)
"""
from __future__ import annotations

import os

import click

# Before any subcommand loads torch: idle OpenMP threads sleep instead of spinning on the CPUs the expert kernels
# run on (measured on bench_decode: decode step 379 ms -> 128 ms on 2 cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .lazy_group import LazyGroup

COMMANDS = {
    "generate": "ktrun.cli.cmd_generate:generate",
    "bench": "ktrun.cli.cmd_bench:bench",
    "serve": "ktrun.cli.cmd_serve:serve",
    "perplexity": "ktrun.cli.cmd_perplexity:perplexity",
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ktconvert")
def main():
    """Run converted MoE checkpoints: routed experts on the CPU kernels, the rest on the GPU (or CPU).

    \b
    Examples:
      ktrun generate converted/ --prompt "def fibonacci(n):" --max-tokens 64
      ktrun bench converted/
      ktrun serve converted/ --port 8000
      ktrun perplexity converted/ --text heldout.txt --kl-divergence bf16.logprobs
    """
    from ..malloc_policy import keep_warm_heap

    keep_warm_heap()      # before the model loads: a prompt's large arrays reused warm from the heap (malloc_policy)
