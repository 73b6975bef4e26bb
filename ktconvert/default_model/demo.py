"""The README's main job (`make demo`): convert the embedded default model and generate text with it.

It runs the two real commands a user would type, and prints them first:

    ktconvert quantize <ktconvert>/data/default_model -o converted/default-model --method int4-amx ...
    ktrun generate converted/default-model --prompt "..." --max-tokens 96

The default model is a small DeepSeek-V3-architecture model trained by this project on the Python standard
library's source (see its model card, data/default_model/README.md), so the continuation is Python-like code.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import click

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "data" / "default_model"
PROMPT = "import os\n\n\ndef read_lines(path):"   # no trailing newline: a lone newline token is answered with EOS


def _run(args: list[str]) -> None:
    click.echo(f"$ {shlex.join(args)}", err=True)
    code = subprocess.call([sys.executable, "-m", *args])
    if code:
        raise SystemExit(code)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-o", "--output", default="converted/default-model", show_default=True, help="Where to convert to.")
@click.option("--prompt", default=PROMPT, show_default=True, help="Text to continue.")
@click.option("--max-tokens", default=96, show_default=True, help="Tokens to generate.")
def main(output: str, prompt: str, max_tokens: int) -> None:
    """Convert the embedded default model (int4 experts, int4 GPU layers) and generate with it.

    \b
    Example:
      python -m ktconvert.default_model.demo
      python -m ktconvert.default_model.demo --prompt "import os" --max-tokens 40
    """
    _run(["ktconvert", "quantize", str(DEFAULT_MODEL), "-o", output, "--method", "int4-amx",
          "--gpu-method", "gptq-int4", "--force"])
    _run(["ktrun", "generate", output, "--prompt", prompt, "--max-tokens", str(max_tokens)])


if __name__ == "__main__":
    main()
