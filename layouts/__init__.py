"""ktlayouts: the single source of truth for every on-disk format ktconvert writes and ktrun reads.

Each format has its constants, size arithmetic and a numpy reference pack/unpack pair here; the converter,
runtime, kernels and tests follow it. See README.md beside this file for the specification in prose.
"""
from .constants import FORMAT_VERSION  # noqa: F401
