"""`kvstore analyze`: how much of each stage's captured prompts a prefix cache can serve
(kvstore.analyze)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from kvstore.cli.options import home_option
from kvstore.errors import KVStoreError


@click.command(name="analyze", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("captured", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option(
    "--model",
    "-m",
    default=None,
    help="Render with this model's chat template and count tokens (else bytes only).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@home_option
def analyze_cmd(captured: Path, model: str | None, as_json: bool, home: Path) -> None:
    """Show how much of each stage's prompts a prefix cache can serve.

    CAPTURED is JSONL: one {"stage": ..., "messages": [...], "tools"?} or {"stage", "text"} per
    call. Per stage: the share of the prompt common to every call, where the first dynamic
    block starts (with a snippet), and the share a static-first reordering would make cacheable.

    \b
    kvstore analyze captured.jsonl --model ./Qwen3.5-9B-8bit
    """
    from kvstore.analyze import analyze, format_table, load_capture

    try:
        captures = load_capture(captured)
        tokenizer = None
        if model is not None:
            from mlx_lm.utils import load_tokenizer

            from kvstore.identity.fingerprint import resolve_model_path

            tokenizer = load_tokenizer(resolve_model_path(model))
        reports = analyze(captures, tokenizer=tokenizer)
    except KVStoreError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps([asdict(r) | {"snippet": r.snippet} for r in reports], indent=2))
    else:
        click.echo(format_table(reports))
