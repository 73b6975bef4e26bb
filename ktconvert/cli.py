"""`ktconvert` command line. Each subcommand lives in its own module and is imported only when used."""
from __future__ import annotations

import click
from ktrun.cli.lazy_group import LazyGroup

# command name -> "module:attribute" (a click.Command)
COMMANDS = {
    "pull": "ktconvert.cmd_pull:pull",
    "quantize": "ktconvert.cmd_quantize:quantize",
    "inspect": "ktconvert.cmd_inspect:inspect",
    "verify": "ktconvert.cmd_verify:verify",
    "export": "ktconvert.cmd_export:export",
    "profile": "ktconvert.cmd_profile:profile",
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ktconvert")
def main():
    """Convert Mixture-of-Experts checkpoints for CPU+GPU serving with ktrun.

    \b
    Examples:
      ktconvert pull deepseek-ai/DeepSeek-V3
      ktconvert quantize ./DeepSeek-V3 --method int4-amx -o converted/
      ktconvert inspect ./DeepSeek-V3 --gpu-mem 24GB --cpu-mem 512GB
      ktconvert verify converted/ --against ./DeepSeek-V3
      ktconvert profile converted/ --prompts my_domain.txt -o profile.json
    """
    from ktrun.malloc_policy import keep_freed_memory

    keep_freed_memory()
