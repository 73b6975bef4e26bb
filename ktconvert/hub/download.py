"""Run a pull: free-space check, parallel resumable downloads with one byte progress bar, verification, record.

Offline (HF_HUB_OFFLINE=1) a pull makes no request: it succeeds only when the local directory holds a complete,
unchanged pull of the repo (checked against its `.ktconvert-source.json`).
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path

import click
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
from ktlayouts.files import sha256_file
from ktrun.byte_sizes import human
from tqdm.auto import tqdm

from ktconvert.hub import record as rec_io
from ktconvert.hub.fetch import PARTIAL_DIR, Cancelled, VerifyError, check_content, fetch_file
from ktconvert.hub.plan import (
    PullError,
    PullPlan,
    default_local_dir,
    free_bytes,
    hub_errors,
    is_repo_id,
    plan_pull,
)


def say(msg: str) -> None:
    click.echo(msg, err=True)


def pull(repo_id: str, revision: str | None = None, local_dir: Path | str | None = None,
         include: list[str] | None = None, exclude: list[str] | None = None, dry_run: bool = False,
         workers: int = 4) -> Path:
    """Make `local_dir` (default: $KTCONVERT_HOME/models/ORG/NAME) hold `repo_id`@`revision`, verified."""
    if constants.is_offline_mode():
        return pull_offline(repo_id, revision, Path(local_dir) if local_dir else default_local_dir(repo_id))
    plan = plan_pull(repo_id, revision, Path(local_dir) if local_dir else None, include, exclude)
    free = free_bytes(plan.local_dir)
    if dry_run:
        click.echo(plan.describe(free))
        return plan.local_dir
    say(f"pull {plan.repo_id}@{plan.revision} (commit {plan.commit}) into {plan.local_dir}: {len(plan.files)} files, "
        f"{plan.bytes_to_fetch:,} bytes to download ({human(plan.bytes_to_fetch)})")
    if plan.bytes_to_fetch > free:
        raise PullError(f"not enough free disk space in {plan.local_dir}: the pull needs {plan.bytes_to_fetch:,} bytes "
                        f"({human(plan.bytes_to_fetch)}) more, only {free:,} bytes ({human(free)}) are free; "
                        "free some space or choose another --local-dir (or KTCONVERT_HOME)")
    if plan.gated and plan.bytes_to_fetch:  # fail before any transfer when the token cannot read the files
        with hub_errors(repo_id, plan.revision):
            get_hf_file_metadata(hf_hub_url(repo_id, plan.files[0].remote.path, revision=plan.commit))
    _run(plan, workers)
    return plan.local_dir


def _run(plan: PullPlan, workers: int) -> None:
    old = rec_io.read_source_record(plan.local_dir) or {}
    record = {"format": rec_io.RECORD_FORMAT, "repo_id": plan.repo_id, "revision": plan.revision,
              "commit": plan.commit, "endpoint": constants.ENDPOINT, "include": plan.include, "exclude": plan.exclude,
              "complete": False, "pulled_at": rec_io.utc_now(), "files": {}}
    lock = threading.Lock()
    record_path = plan.local_dir / rec_io.SOURCE_RECORD

    def done(rf, sha256: str) -> None:
        with lock:
            record["files"][rf.path] = rec_io.file_entry(rf.size, sha256, rf.git_oid, rf.sha256 is not None,
                                                         plan.local_dir / rf.path)
            rec_io.write_json_atomic(record_path, record)

    todo, checks = [], [pf for pf in plan.files if pf.state == "check"]
    with tqdm(total=sum(pf.remote.size for pf in checks), unit="B", unit_scale=True, unit_divisor=1024,
              desc="check local files", file=sys.stderr,
              disable=not checks or bool(constants.HF_HUB_DISABLE_PROGRESS_BARS)) as check_bar:
        for pf in plan.files:
            rf, dest = pf.remote, plan.local_dir / pf.remote.path
            if pf.state == "present":
                record["files"][rf.path] = old["files"][rf.path]
                continue
            if pf.state == "check":
                try:
                    done(rf, check_content(dest, rf))
                    continue
                except VerifyError as e:
                    check_bar.write(f"local copy differs from the hub: {e}; downloading it again", file=sys.stderr)
                    dest.unlink()
                finally:
                    check_bar.update(rf.size)
            todo.append(pf)
    rec_io.write_json_atomic(record_path, record)

    stop = threading.Event()
    total = sum(pf.remote.size for pf in todo)
    with tqdm(total=total, initial=sum(pf.have for pf in todo), unit="B", unit_scale=True, unit_divisor=1024,
              desc=f"pull {plan.repo_id}", file=sys.stderr, mininterval=0.5, dynamic_ncols=True,
              disable=bool(constants.HF_HUB_DISABLE_PROGRESS_BARS)) as bar:
        def warn(msg: str) -> None:
            bar.write(msg, file=sys.stderr)

        def one(pf) -> None:
            done(pf.remote, fetch_file(plan.repo_id, plan.commit, pf.remote, plan.local_dir, bar, warn, stop))

        try:
            errors = run_parallel(one, todo, workers, stop)
        except KeyboardInterrupt:
            say(f"\ninterrupted: partial files stay in {plan.local_dir / PARTIAL_DIR}; re-run the pull to resume")
            raise
        if errors:
            if isinstance(errors[0], VerifyError):
                raise PullError(f"verification failed: {errors[0]}")
            with hub_errors(plan.repo_id, plan.revision):
                raise errors[0]
    try:
        (plan.local_dir / PARTIAL_DIR).rmdir()  # only when empty: partials of other revisions stay resumable
    except OSError:
        pass
    record.update(complete=True, pulled_at=rec_io.utc_now())
    rec_io.write_json_atomic(record_path, record)
    rec_io.write_last_pull(record, plan.local_dir)
    say(f"pulled {plan.repo_id}@{plan.revision} (commit {plan.commit}): {len(plan.files)} files verified, "
        f"{plan.total_bytes:,} bytes in {plan.local_dir}")


def pull_offline(repo_id: str, revision: str | None, local_dir: Path) -> Path:
    """HF_HUB_OFFLINE=1: accept `local_dir` only when it holds a complete, unchanged pull of `repo_id`."""
    if not is_repo_id(repo_id):
        raise PullError(f"{repo_id!r} is not a hub repo id (expected ORG/NAME)")
    rec = rec_io.read_source_record(local_dir)
    where = f"HF_HUB_OFFLINE=1 and {local_dir}"
    if rec is None:
        raise PullError(f"{where} holds no pull of {repo_id} (no {rec_io.SOURCE_RECORD}): run the pull online first")
    if rec.get("repo_id") != repo_id:
        raise PullError(f"{where} holds a pull of {rec.get('repo_id')}, not {repo_id}")
    if revision and revision not in (rec.get("revision"), rec.get("commit")):
        raise PullError(f"{where} holds {repo_id}@{rec.get('revision')} (commit {rec.get('commit')}), "
                        f"not revision {revision!r}")
    bad = []
    for path, entry in sorted(rec["files"].items()):
        dest = local_dir / path
        if rec_io.entry_still_valid(entry, dest):
            continue
        if not dest.is_file() or dest.stat().st_size != entry.get("size"):
            bad.append(f"{path} (missing or incomplete)")
        elif sha256_file(dest) != entry.get("sha256"):
            bad.append(f"{path} (content changed)")
    if not rec.get("complete"):
        bad.insert(0, "the pull was interrupted before every file was downloaded")
    if bad:
        raise PullError(f"{where} has no complete copy of {repo_id}: " + "; ".join(bad[:5])
                        + (f"; ... {len(bad) - 5} more" if len(bad) > 5 else "") + ". Re-run the pull online.")
    rec_io.write_last_pull(rec, local_dir)
    say(f"offline: {local_dir} holds a complete pull of {repo_id}@{rec['revision']} (commit {rec['commit']})")
    return local_dir.resolve()


def run_parallel(fn, items: list, workers: int, stop: threading.Event) -> list[BaseException]:
    """Run `fn` over `items` in daemon threads; return the errors (empty when all succeeded).

    The first error sets `stop` (transfers in flight raise Cancelled at their next chunk) and returns at once.
    Daemon threads and a polling main thread keep Ctrl-C immediate even while a transfer is blocked in a read.
    """
    pending: queue.SimpleQueue = queue.SimpleQueue()
    for item in items:
        pending.put(item)
    errors: list[BaseException] = []

    def worker() -> None:
        while not stop.is_set():
            try:
                item = pending.get_nowait()
            except queue.Empty:
                return
            try:
                fn(item)
            except Cancelled:
                return
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors.append(e)
                stop.set()
                return

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(workers, len(items))))]
    for t in threads:
        t.start()
    try:
        while not errors and any(t.is_alive() for t in threads):
            time.sleep(0.05)
    except BaseException:
        stop.set()
        raise
    return errors
