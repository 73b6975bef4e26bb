"""Resume journal of a conversion: `.ktconvert-progress.json` in the output directory.

It records the conversion parameters and every completed file with size and sha256, and is replaced atomically
after each file is renamed into place. A run killed at any moment leaves (a) complete files listed in the journal,
(b) perhaps one complete file not yet listed (rewritten on resume: output is deterministic) and (c) `*.partial`
files (deleted on resume). manifest.json is written last, so a directory without it never looks complete.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ktlayouts.converted_dir import DENSE_DIR, EXPERT_DIR, MANIFEST_NAME, PARTIAL_SUFFIX, PROGRESS_NAME, safe_relpath
from ktlayouts.files import sha256_file

from ktconvert.writer import atomic_write_bytes

JOURNAL_VERSION = 1


class OutputDirError(ValueError):
    """The output directory holds something that this run must not overwrite (the message names the flag)."""


class Journal:
    def __init__(self, out_dir: Path, params: dict, files: dict[str, dict] | None = None):
        self.out_dir = Path(out_dir)
        self.params = params
        self.files = dict(files or {})          # relpath -> {"size": int, "sha256": str}

    @property
    def path(self) -> Path:
        return self.out_dir / PROGRESS_NAME

    def save(self) -> None:
        body = {"version": JOURNAL_VERSION, "params": self.params, "files": dict(sorted(self.files.items()))}
        atomic_write_bytes(self.path, json.dumps(body, indent=1, sort_keys=True).encode())

    def record(self, rel: str, size: int, sha256: str) -> None:
        self.files[rel] = {"size": size, "sha256": sha256}
        self.save()

    def is_done(self, rel: str) -> bool:
        return rel in self.files

    @classmethod
    def load(cls, out_dir: Path) -> Journal | None:
        path = Path(out_dir) / PROGRESS_NAME
        if not path.exists():
            return None
        try:
            body = json.loads(path.read_text())
            if body.get("version") != JOURNAL_VERSION:
                raise ValueError(f"journal version {body.get('version')!r}")
            return cls(out_dir, body["params"], body["files"])
        except (ValueError, KeyError, TypeError) as e:
            raise OutputDirError(f"{path} is unreadable ({e}); use --force to start over") from None

    def verify_completed(self) -> list[str]:
        """Drop completed files whose size or sha256 changed (they are redone); returns the dropped paths."""
        dropped = []
        for rel, rec in sorted(self.files.items()):
            p = safe_relpath(self.out_dir, rel)
            if not p.is_file() or p.stat().st_size != rec["size"] or sha256_file(p) != rec["sha256"]:
                dropped.append(rel)
                del self.files[rel]
        if dropped:
            self.save()
        return dropped


def _describe_difference(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)


def remove_previous_output(out_dir: Path) -> None:
    """--force: delete what a ktconvert run writes (never unknown files)."""
    listed: set[str] = set()
    for name in (MANIFEST_NAME, PROGRESS_NAME):
        p = out_dir / name
        try:
            listed |= set(json.loads(p.read_text()).get("files", {})) if p.exists() else set()
        except (ValueError, AttributeError, UnicodeDecodeError):
            pass
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for rel in listed:
        try:
            safe_relpath(out_dir, rel).unlink(missing_ok=True)
        except (ValueError, IsADirectoryError):
            pass
    for d in (EXPERT_DIR, DENSE_DIR):
        shutil.rmtree(out_dir / d, ignore_errors=True)
    (out_dir / PROGRESS_NAME).unlink(missing_ok=True)


def remove_partials(out_dir: Path) -> None:
    for p in out_dir.rglob(f"*{PARTIAL_SUFFIX}"):
        p.unlink(missing_ok=True)


def prepare_output(out_dir: Path, params: dict, resume: bool, force: bool) -> Journal:
    """Decide what to do with out_dir; returns the journal to continue (empty for a fresh start).

    fresh/empty dir -> new journal; --force -> wipe previous ktconvert output and start over; --resume with the
    same parameters -> continue after verifying completed files; anything else -> OutputDirError naming the flags.
    """
    if resume and force:
        raise OutputDirError("--resume and --force exclude each other: --resume continues, --force starts over")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputDirError(f"output path {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    if force:
        remove_previous_output(out_dir)
    remove_partials(out_dir)
    journal = Journal.load(out_dir)
    has_manifest = (out_dir / MANIFEST_NAME).exists()
    if journal is None:
        if has_manifest:
            hint = f"nothing to resume (check it with: ktconvert verify {out_dir}); " if resume else ""
            raise OutputDirError(f"{out_dir} already holds a complete conversion ({MANIFEST_NAME}); {hint}"
                                 f"use --force to overwrite it or choose another -o")
        others = sorted(p.name for p in out_dir.iterdir())
        if others and not force:
            raise OutputDirError(f"{out_dir} is not empty and holds no ktconvert progress ({', '.join(others[:5])}); "
                                 f"use --force to convert into it anyway or choose another -o")
        journal = Journal(out_dir, params)
        journal.save()
        return journal
    if journal.params != params:
        raise OutputDirError(f"{out_dir} holds {'a' if has_manifest else 'an unfinished'} conversion with different "
                             f"parameters ({_describe_difference(journal.params, params)}); use --force to start over "
                             f"or choose another -o")
    if not resume:
        what = "a complete conversion" if has_manifest else "an unfinished conversion"
        raise OutputDirError(f"{out_dir} holds {what} of the same source; use --resume to continue it "
                             f"or --force to start over")
    journal.verify_completed()
    return journal
