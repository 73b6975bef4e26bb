"""Errors of the family registry. They are ValueErrors; ktconvert re-raises them as SourceError with the same text."""
from __future__ import annotations


class FamilyError(ValueError):
    """A checkpoint's description (config.json, tensor names, GGUF metadata) does not fit any registered family."""


class ConfigError(FamilyError):
    """config.json (or the config built from GGUF metadata) is unsupported, or a field is missing or inconsistent;
    the message names the file and the field."""


class TensorNameError(FamilyError):
    """A tensor name that plays no known role in its family (or contradicts the config); the message names it."""
