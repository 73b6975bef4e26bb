"""The config and tokenizer files beside a checkpoint's shards ("side files": config.json, tokenizer files, chat
template, ...), which a conversion reads and copies. Checked when the source opens, before any work: each resolves
(links followed) inside the source folder or its hub cache repo folder (ktlayouts.files.resolve_inside: hub
snapshots link into blobs/), and each JSON one parses; SourceError naming the file otherwise."""
from __future__ import annotations

import json
import re
from pathlib import Path

from ktlayouts.files import OutsideRootError, resolve_inside

from ktconvert.sources.roles import SourceError

# Top-level source files copied verbatim (config.json is rewritten: ktconvert.manifest).
SIDE_FILE_RE = re.compile(r"^(config\.json|generation_config\.json|tokenizer[\w.-]*|special_tokens_map\.json|"
                          r"added_tokens\.json|vocab[\w.-]*|merges\.txt|chat_template[\w.-]*|[\w.-]+\.tiktoken|"
                          r"tiktoken\.model|preprocessor_config\.json)$")


def checked_path(path: Path, roots: tuple[Path, ...]) -> Path:
    """path resolved; SourceError naming it when it links outside the source's roots (ktlayouts.files)."""
    try:
        return resolve_inside(path, roots)
    except OutsideRootError as e:
        raise SourceError(str(e)) from None


def side_files(root: Path, roots: tuple[Path, ...]) -> dict[str, Path]:
    """{name: resolved path} of the side files in `root`, each checked (inside `roots`; JSON that parses)."""
    out = {}
    for p in sorted(Path(root).iterdir(), key=lambda p: p.name):
        if not SIDE_FILE_RE.match(p.name):
            continue
        real = checked_path(p, roots)
        if not real.is_file():
            continue
        if p.suffix == ".json":
            try:
                json.loads(real.read_bytes())
            except (ValueError, RecursionError) as e:     # bad UTF-8 or JSON
                raise SourceError(f"{p}: not valid JSON ({type(e).__name__}: {str(e)[:200]}); the conversion copies "
                                  f"it for ktrun: fix or remove it") from None
        out[p.name] = real
    return out
