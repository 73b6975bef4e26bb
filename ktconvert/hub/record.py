"""What a pull leaves behind: the source record in the local directory and the 'last pull' state file.

`<local_dir>/.ktconvert-source.json` (written atomically; `complete` is false until every file is verified):

    {
      "format": "ktconvert-source/1",
      "repo_id": "deepseek-ai/DeepSeek-V3",          # hub repo id
      "revision": "main",                            # revision as requested (branch, tag or commit)
      "commit": "<40 hex>",                          # the commit it resolved to; every file is from this commit
      "endpoint": "https://huggingface.co",          # HF_ENDPOINT at pull time
      "include": [...], "exclude": [...],            # glob patterns used to select files
      "complete": true,
      "pulled_at": "2026-11-29T20:00:00Z",
      "files": {"model-00001-of-000163.safetensors":
                  {"size": 5234, "sha256": "<hex>", "git_oid": "<hex>", "lfs": true, "mtime_ns": 1700000000000000000}}
    }

`sha256` is the hub's LFS sha256 for LFS files and the locally computed (git-blob-id-verified) sha256 otherwise.
`ktconvert quantize` copies `repo_id`, `revision` and `commit` into its manifest.

`$KTCONVERT_HOME/last_pull.json` (KTCONVERT_HOME defaults to ~/.cache/ktconvert) names the directory of the most
recent complete pull: {"repo_id", "revision", "commit", "local_dir", "pulled_at"}.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

SOURCE_RECORD = ".ktconvert-source.json"
RECORD_FORMAT = "ktconvert-source/1"
LAST_PULL = "last_pull.json"


def ktconvert_home() -> Path:
    return Path(os.environ.get("KTCONVERT_HOME") or Path.home() / ".cache" / "ktconvert").expanduser()


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_source_record(local_dir: Path) -> dict | None:
    rec = read_json(Path(local_dir) / SOURCE_RECORD)
    if rec is None or rec.get("format") != RECORD_FORMAT or not isinstance(rec.get("files"), dict):
        return None
    return rec


def write_last_pull(rec: dict, local_dir: Path) -> None:
    state = {k: rec[k] for k in ("repo_id", "revision", "commit")}
    state.update(local_dir=str(Path(local_dir).resolve()), pulled_at=utc_now())
    write_json_atomic(ktconvert_home() / LAST_PULL, state)


def read_last_pull() -> dict | None:
    return read_json(ktconvert_home() / LAST_PULL)


def file_entry(size: int, sha256: str, git_oid: str, lfs: bool, path: Path) -> dict:
    return {"size": size, "sha256": sha256, "git_oid": git_oid, "lfs": lfs, "mtime_ns": path.stat().st_mtime_ns}


def entry_still_valid(entry: dict | None, path: Path) -> bool:
    """True when `path` is unchanged since `entry` was recorded (same size and mtime), so it need not be re-hashed."""
    if not entry:
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_size == entry.get("size") and st.st_mtime_ns == entry.get("mtime_ns")
