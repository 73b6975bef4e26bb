"""The Hugging Face hub wing: plan a pull (plan), fetch one file resumably (fetch), run the pull (download), and
remember what was pulled (record). `resolve_source` turns a `ktconvert quantize` SRC argument into a local path."""
from __future__ import annotations

from pathlib import Path

from ktconvert.hub.download import pull
from ktconvert.hub.plan import PullError, is_repo_id, safe_relpath, select_files
from ktconvert.hub.record import ktconvert_home, read_last_pull, read_source_record

__all__ = ["PullError", "pull", "resolve_source", "safe_relpath", "select_files"]


def resolve_source(src: str | None) -> Path:
    """The local checkpoint directory for a `ktconvert quantize` SRC argument.

    An existing directory (or .gguf file) is used as is (refused if it is an unfinished pull); a hub repo id
    (ORG/NAME that is not an existing path) is pulled first into its default directory; None means the most recent
    complete pull.
    """
    if src is None:
        state = read_last_pull()
        if not state or not state.get("local_dir"):
            raise PullError(f"no SRC given and nothing pulled yet (no {ktconvert_home() / 'last_pull.json'}): "
                            "run `ktconvert pull ORG/NAME` first or pass a checkpoint directory")
        path = Path(state["local_dir"])
        if not path.is_dir():
            raise PullError(f"the most recent pull ({state.get('repo_id')}) was into {path}, which no longer exists")
    else:
        path = Path(src).expanduser()
        if not path.exists():
            if is_repo_id(src):
                return pull(src)
            raise PullError(f"SRC {src!r} is neither an existing directory nor a hub repo id (ORG/NAME)")
        if path.is_file() and path.suffix == ".gguf":
            return path                      # a GGUF file or the first part of a split set
        if not path.is_dir():
            raise PullError(f"SRC {src} is neither a directory nor a .gguf file")
    rec = read_source_record(path)
    if rec is not None and not rec.get("complete"):
        raise PullError(f"{path} holds an unfinished pull of {rec.get('repo_id')}: re-run `ktconvert pull "
                        f"{rec.get('repo_id')} --revision {rec.get('revision')} --local-dir {path}` to complete it")
    return path
