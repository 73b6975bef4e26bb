"""Plan and run a pull of a checkpoint from the Hugging Face hub (or a mirror at HF_ENDPOINT).

`plan_pull` resolves the revision to a commit, lists the repo tree (sizes, LFS sha256) and selects the files
conversion needs; `pull` checks free space, downloads what is missing (resuming partial files), verifies every file
and writes `<local_dir>/.ktconvert-source.json` (format: see `ktconvert.hub.record`). `resolve_source` turns the
SRC argument of `ktconvert quantize` into a local directory. Environment: HF_TOKEN (gated/private repos), HF_ENDPOINT
(mirrors), HF_HUB_OFFLINE=1 (use the local copy only), KTCONVERT_HOME (default local root, ~/.cache/ktconvert).
"""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import click
import httpx2
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from ktrun.byte_sizes import human

from ktconvert.hub.fetch import PARTIAL_DIR, RemoteFile, partial_path
from ktconvert.hub.record import SOURCE_RECORD, entry_still_valid, ktconvert_home, read_source_record

# Files conversion needs: weights as safetensors, their index, configs, tokenizer files, chat template.
DEFAULT_INCLUDE = (
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "*.tiktoken",
    "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
    "chat_template.json", "chat_template.jinja",
)
# Pickle-based weight formats: pulled only when an --include pattern ending in the suffix matches them.
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".pkl", ".pickle")
RESERVED_NAMES = (SOURCE_RECORD, PARTIAL_DIR, ".cache")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
FREE_BYTES_ENV = "KTCONVERT_TEST_FREE_BYTES"  # test hook: pretend the target disk has this many free bytes


class PullError(click.ClickException):
    """A pull cannot go on; the message says why and what to do."""


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text


def default_local_dir(repo_id: str) -> Path:
    return ktconvert_home() / "models" / repo_id


def safe_relpath(name: str) -> str:
    """`name` (from the server) if it is a plain relative path inside the repo; PullError otherwise."""
    parts = PurePosixPath(name).parts
    if (not name or "\\" in name or "\0" in name or name.startswith("/") or any(p in ("..", ".") for p in parts)
            or name != "/".join(parts) or parts[0] in RESERVED_NAMES):
        raise PullError(f"refusing file name {name!r} from the server: it is not a plain path inside the repository")
    return name


def _is_pickle(path: str) -> bool:
    return path.lower().endswith(PICKLE_SUFFIXES)


def select_files(paths: list[str], include: list[str] | None, exclude: list[str] | None) -> tuple[list[str], list[str]]:
    """(selected, skipped pickle files). `include` replaces DEFAULT_INCLUDE; `exclude` removes matches."""
    patterns = list(include) if include else list(DEFAULT_INCLUDE)
    selected, skipped = [], []
    for p in paths:
        hits = [g for g in patterns if fnmatch.fnmatchcase(p, g)]
        if not hits or any(fnmatch.fnmatchcase(p, g) for g in exclude or ()):
            continue
        if _is_pickle(p) and not any(g.lower().endswith(PICKLE_SUFFIXES) for g in hits):
            skipped.append(p)
            continue
        selected.append(p)
    return selected, skipped


def free_bytes(directory: Path) -> int:
    """Free bytes on the filesystem that will hold `directory` (its nearest existing ancestor)."""
    if os.environ.get(FREE_BYTES_ENV):
        return int(os.environ[FREE_BYTES_ENV])
    probe = Path(directory).resolve()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


@dataclass
class PlannedFile:
    remote: RemoteFile
    state: str  # present (verified earlier, unchanged) | check (exists, will be hashed) | partial | missing
    have: int = 0  # bytes already in the partial file


@dataclass
class PullPlan:
    repo_id: str
    revision: str
    commit: str
    local_dir: Path
    include: list[str]
    exclude: list[str]
    files: list[PlannedFile]
    skipped: list[str] = field(default_factory=list)
    gated: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(f.remote.size for f in self.files)

    @property
    def bytes_to_fetch(self) -> int:
        return sum(f.remote.size - f.have for f in self.files if f.state in ("partial", "missing"))

    def describe(self, free: int) -> str:
        count = {s: sum(f.state == s for f in self.files) for s in ("present", "check", "partial", "missing")}
        lines = [
            f"repo       {self.repo_id}",
            f"revision   {self.revision} -> commit {self.commit}",
            f"local dir  {self.local_dir}",
            (f"files      {len(self.files)} selected, {self.total_bytes:,} bytes ({human(self.total_bytes)}): "
             f"{count['present']} present, {count['check']} to check, {count['partial']} partial, "
             f"{count['missing']} missing"),
            (f"download   {self.bytes_to_fetch:,} bytes ({human(self.bytes_to_fetch)}); "
             f"free space {free:,} bytes ({human(free)})"),
        ]
        lines += [f"skipped    {p} (pickle format; pull it with --include '*{PurePosixPath(p).suffix}')"
                  for p in self.skipped]
        lines += [f"  {f.state:8s} {f.remote.size:>16,}  {f.remote.path}" for f in self.files]
        return "\n".join(lines)


@contextmanager
def hub_errors(repo_id: str, revision: str | None):
    """Turn huggingface_hub's exceptions into PullError messages that say what to do."""
    from huggingface_hub import constants
    try:
        yield
    except GatedRepoError:
        raise PullError(f"{repo_id} is a gated repository: accept its terms on {constants.ENDPOINT}/{repo_id} and "
                        "set HF_TOKEN to a token of an account that has access") from None
    except RepositoryNotFoundError:
        raise PullError(f"repository {repo_id} not found on {constants.ENDPOINT} (if it is private, set HF_TOKEN)") \
            from None
    except RevisionNotFoundError:
        raise PullError(f"revision {revision!r} not found in {repo_id}") from None
    except HfHubHTTPError as e:
        raise PullError(f"hub request failed for {repo_id}: {str(e).splitlines()[0]}") from None
    except (httpx2.HTTPError, ConnectionError) as e:  # transport errors; OfflineModeIsEnabled is a ConnectionError
        raise PullError(f"cannot reach {constants.ENDPOINT} for {repo_id}: {e} "
                        "(set HF_HUB_OFFLINE=1 to use a local copy)") from None


def _check_source_dir(local_dir: Path, repo_id: str) -> dict | None:
    rec = read_source_record(local_dir)
    if rec is not None and rec.get("repo_id") != repo_id:
        raise PullError(f"{local_dir} already holds a pull of {rec.get('repo_id')}; choose another --local-dir")
    return rec


def plan_pull(repo_id: str, revision: str | None = None, local_dir: Path | None = None,
              include: list[str] | None = None, exclude: list[str] | None = None) -> PullPlan:
    """Ask the hub what `repo_id`@`revision` holds and compare it with what `local_dir` already has."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    if not is_repo_id(repo_id):
        raise PullError(f"{repo_id!r} is not a hub repo id (expected ORG/NAME)")
    local_dir = Path(local_dir) if local_dir else default_local_dir(repo_id)
    old = _check_source_dir(local_dir, repo_id)
    revision = revision or "main"
    api = HfApi(library_name="ktconvert")
    with hub_errors(repo_id, revision):
        info = api.model_info(repo_id, revision=revision)
        commit = info.sha
        entries = [e for e in api.list_repo_tree(repo_id, recursive=True, revision=commit) if isinstance(e, RepoFile)]
    remote = {}
    for e in entries:
        path = safe_relpath(e.path)
        remote[path] = RemoteFile(path, e.lfs.size if e.lfs else e.size, e.blob_id, e.lfs.sha256 if e.lfs else None)
    chosen, skipped = select_files(sorted(remote), include, exclude)
    if not chosen:
        raise PullError(f"no file of {repo_id}@{revision} matches the include/exclude patterns")
    old_files = (old or {}).get("files", {})
    files = []
    for path in chosen:
        rf, dest = remote[path], local_dir / path
        entry = old_files.get(path)
        if entry_still_valid(entry, dest) and entry.get("sha256" if rf.sha256 else "git_oid") == rf.key:
            files.append(PlannedFile(rf, "present"))
        elif dest.exists():
            files.append(PlannedFile(rf, "check"))
        elif (part := partial_path(local_dir, rf)).exists() and part.stat().st_size <= rf.size:
            files.append(PlannedFile(rf, "partial", part.stat().st_size))
        else:
            files.append(PlannedFile(rf, "missing"))
    return PullPlan(repo_id, revision, commit, local_dir.resolve(), list(include or DEFAULT_INCLUDE),
                    list(exclude or ()), files, skipped, gated=bool(info.gated))
