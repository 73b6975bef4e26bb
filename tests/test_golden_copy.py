"""tests/golden/ (what the golden tests read) is the reference data of ../shared/golden/, unchanged.

- Everywhere (a user's clone included): every file of tests/golden/ has the SHA-256 recorded in
  tests/golden/SHA256SUMS when it was copied, SHA256SUMS lists every file (nothing unlisted, nothing missing), and
  index.json lists exactly the .npz files present.
- Where ../shared/golden/ exists (developers' and CI checkouts): tests/golden/ holds a byte-identical copy of every
  file in it and nothing else but its own PROVENANCE.md and SHA256SUMS. Skipped, visibly with the reason, where it
  does not exist.
"""
from __future__ import annotations

import hashlib

import pytest
from golden_data import GOLDEN, OWN_FILES, SHARED_GOLDEN, golden_index


def recorded_sums() -> dict[str, str]:
    """tests/golden/SHA256SUMS (`sha256sum` format: '<hex>  <name>'): name -> hex digest."""
    sums = {}
    for line in (GOLDEN / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.lstrip("*")] = digest
    return sums


def files_in(folder) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def test_every_golden_file_has_its_recorded_sha256():
    sums = recorded_sums()
    assert set(sums) == files_in(GOLDEN) - set(OWN_FILES), "SHA256SUMS and tests/golden/ list different files"
    for name, digest in sorted(sums.items()):
        assert hashlib.sha256((GOLDEN / name).read_bytes()).hexdigest() == digest, f"tests/golden/{name} changed"


def test_index_lists_exactly_the_npz_files():
    listed = [e["file"] for e in golden_index()]
    assert len(listed) == len(set(listed))
    assert set(listed) == {p.name for p in GOLDEN.glob("*.npz")}


@pytest.mark.skipif(not SHARED_GOLDEN.is_dir(), reason=f"no {SHARED_GOLDEN} beside this checkout to compare with")
def test_golden_copy_equals_shared_golden_byte_for_byte():
    shared = files_in(SHARED_GOLDEN)
    assert files_in(GOLDEN) - set(OWN_FILES) == shared, (
        f"tests/golden/ and {SHARED_GOLDEN} hold different files: copy them again (tests/golden/PROVENANCE.md)")
    differ = [n for n in sorted(shared) if (GOLDEN / n).read_bytes() != (SHARED_GOLDEN / n).read_bytes()]
    assert differ == [], f"tests/golden/ differs from {SHARED_GOLDEN} in {differ}"
