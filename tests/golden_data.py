"""The reference golden vectors the tests compare against, read from tests/golden/ (shipped in the repository).

tests/golden/ holds byte-identical copies of every file of ../shared/golden/ (the read-only reference data beside
developers' and CI checkouts), so a clone on its own passes its tests; tests/golden/PROVENANCE.md says which
independent implementation wrote each file and tests/golden/SHA256SUMS pins their bytes. tests/test_golden_copy.py
checks the copy against SHA256SUMS everywhere and against ../shared/golden/ byte for byte where that exists.
"""
from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"                 # what every golden test reads
SHARED_GOLDEN = REPO.parent / "shared" / "golden"  # the reference it was copied from (absent in a user's clone)
# files of tests/golden/ that are not copies of ../shared/golden/
OWN_FILES = ("PROVENANCE.md", "SHA256SUMS")


def golden_index() -> list[dict]:
    """tests/golden/index.json: one entry per golden file."""
    return json.loads((GOLDEN / "index.json").read_text())


def linear_entries() -> list[dict]:
    """The quantized-Linear goldens (w{bits}_k{K}_n{N}_g{G}.npz), as index.json lists them."""
    return [e for e in golden_index() if e["file"].startswith("w")]
