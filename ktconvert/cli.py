"""`ktconvert` command line. Each subcommand lives in its own module and is imported only when used."""
from __future__ import annotations

import importlib

import click

# command name -> "module:attribute" (a click.Command)
COMMANDS = {
    "pull": "ktconvert.cmd_pull:pull",
    "quantize": "ktconvert.cmd_quantize:quantize",
    "inspect": "ktconvert.cmd_inspect:inspect",
    "verify": "ktconvert.cmd_verify:verify",
    "export": "ktconvert.cmd_export:export",
}


class LazyGroup(click.Group):
    def __init__(self, *args, lazy: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx, name):
        if name in self.lazy:
            module, attr = self.lazy[name].split(":")
            try:
                return getattr(importlib.import_module(module), attr)
            except ModuleNotFoundError as e:
                if e.name != module:
                    raise
                return None
        return super().get_command(ctx, name)


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
    """
