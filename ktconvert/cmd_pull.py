"""`ktconvert pull`: download a checkpoint from the Hugging Face hub, verified and resumable."""
from __future__ import annotations

from pathlib import Path

import click


@click.command("pull")
@click.argument("repo_id")
@click.option("--revision", default=None, metavar="REV",
              help="Branch, tag or commit to pull (default: main). Resolved to a commit and recorded.")
@click.option("--local-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to put the files (default: $KTCONVERT_HOME/models/ORG/NAME, "
                   "KTCONVERT_HOME defaulting to ~/.cache/ktconvert).")
@click.option("--include", "include", multiple=True, metavar="GLOB",
              help="Pull the files matching GLOB instead of the default set (repeatable). Pickle files "
                   "(.bin/.pth/.pt/.ckpt) need a pattern ending in their suffix, e.g. --include '*.bin'.")
@click.option("--exclude", "exclude", multiple=True, metavar="GLOB", help="Skip files matching GLOB (repeatable).")
@click.option("--dry-run", is_flag=True, help="Print the plan (files, sizes, bytes to download, free space); "
                                               "download nothing.")
@click.option("--workers", default=4, show_default=True, type=click.IntRange(1, 32),
              help="Files downloaded in parallel.")
def pull(repo_id, revision, local_dir, include, exclude, dry_run, workers):
    """Download REPO_ID (ORG/NAME) from the Hugging Face hub for conversion.

    By default only what conversion needs is pulled: *.safetensors shards and their index, config.json,
    generation_config.json, tokenizer files and the chat template; never pickled weights (.bin/.pth/.pt/.ckpt)
    unless an --include pattern names them. Every file is checked against the hub (sha256 for LFS files, git blob
    id otherwise); a bad file is downloaded once more, then the pull fails naming it. An interrupted pull resumes
    where it stopped (HTTP range requests). The commit is recorded in LOCAL_DIR/.ktconvert-source.json; the last
    complete pull is what `ktconvert quantize` converts when given no SRC.

    Environment: HF_TOKEN (gated or private repos), HF_ENDPOINT (mirror), HF_HUB_OFFLINE=1 (no network: succeed
    only if LOCAL_DIR already holds a complete pull), KTCONVERT_HOME.

    \b
    Examples:
      ktconvert pull deepseek-ai/DeepSeek-V3
      ktconvert pull deepseek-ai/DeepSeek-V3 --dry-run
      ktconvert pull Qwen/Qwen3-30B-A3B --revision main --local-dir /data/Qwen3-30B-A3B
      ktconvert pull moonshotai/Kimi-K2-Instruct --include config.json --include '*.index.json'  # metadata only
      HF_HUB_OFFLINE=1 ktconvert pull deepseek-ai/DeepSeek-V3
    """
    from ktconvert.hub import pull as run_pull

    path = run_pull(repo_id, revision=revision, local_dir=local_dir, include=list(include) or None,
                    exclude=list(exclude) or None, dry_run=dry_run, workers=workers)
    if not dry_run:
        click.echo(str(path))  # stdout: the local directory, for scripts
