"""A click group whose subcommands are imported only when run (`ktconvert` and `ktrun` both use it), so `--help`
and light commands never pay for torch."""
from __future__ import annotations

import importlib

import click


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
