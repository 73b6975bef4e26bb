"""`ktconvert profile`: measure which routed experts a workload calls (the input of hot-expert placement)."""
from __future__ import annotations

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", type=click.Path(exists=True))
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Text of the workload: a plain text file, or .jsonl with one prompt per line (a string or "
                   "{\"prompt\": ...} / {\"text\": ...}).")
@click.option("--calib", is_flag=True, help="Use the calibration text shipped with ktconvert instead of --prompts.")
@click.option("--max-tokens", type=click.IntRange(1), default=None, help="Stop after this many tokens.")
@click.option("--chunk-tokens", type=click.IntRange(1), default=256, show_default=True,
              help="Tokens per forward; chunks are the unit of the held-out split.")
@click.option("--heldout-every", type=click.IntRange(0), default=5, show_default=True,
              help="Every N-th chunk goes to the held-out split (0: none).")
@click.option("--reference-experts", is_flag=True, help="Converted MODEL: the torch reference experts, not the kernels.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="profile.json to write.")
@click.option("--quiet", is_flag=True, help="No progress bar, no summary.")
def profile(model, prompts, calib, max_tokens, chunk_tokens, heldout_every, reference_experts, output, quiet):
    """Run MODEL (a converted directory, or a source checkpoint directory / GGUF file) over a text with ktrun and
    write, per MoE layer and routed expert, how often tokens were routed there and their routing weight mass, with
    the token count and a held-out split. `ktconvert inspect --profile`, `ktrun bench --profile` and placement
    (`--profile P --gpu-experts N`) read it.

    \b
    Examples:
      ktconvert profile converted/ --prompts my_domain.txt -o profile.json
      ktconvert profile converted/ --calib --max-tokens 4096 -o calib-profile.json
      ktconvert profile ./DeepSeek-V3 --prompts prompts.jsonl -o profile.json   # source: experts read on use
      ktrun generate converted/ --profile profile.json --gpu-experts 8 --prompt "..."
    """
    from ktlayouts.expert_profile import summary_lines

    from ktconvert.profile import ProfileInputError, open_model, read_documents, run_profile

    if calib == (prompts is not None):
        raise click.UsageError("give exactly one of --prompts FILE and --calib")
    try:
        docs, name, sha = read_documents(None if calib else prompts)
        with open_model(model, use_kernels=False if reference_experts else None) as (m, tok, what):
            if not quiet:
                click.echo(f"profiling {what} on {name}", err=True)
            prof = run_profile(m, tok, docs, chunk_tokens, heldout_every, max_tokens, progress=not quiet,
                               text_info={"source": name, "sha256": sha}, model_path=str(model))
    except (ProfileInputError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    prof.save(output)
    if not quiet:
        click.echo("\n".join(summary_lines(prof)))
    click.echo(f"wrote {output}", err=True)
