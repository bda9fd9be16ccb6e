"""`kvstore explain`: why prompt tokens were prefilled, from the ledger (kvstore.explain)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvstore.cli.options import home_option, user_errors


@click.command(name="explain")
@click.option("--since", default=None, help="Only requests this recent: 30m, 1h, 1d, 1w.")
@click.option("--label", default=None, help="Only this stage (the ledger's label).")
@click.option("--model", default=None, help="Only this model: a path (from here) or a hub id.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: stages, divergences.")
@home_option
@user_errors
def explain_cmd(
    since: str | None, label: str | None, model: str | None, as_json: bool, home: Path
) -> None:
    """Why prompt tokens were prefilled, per model and stage: requests, prompt tokens, served
    tokens, prefilled tokens by reason, and the divergences that cost the most (entry, token
    position, stored and request text), with a static-first suggestion.

    \b
    kvstore explain --since 1d
    kvstore explain --label serve --json | jq '.stages[].divergences[0]'
    """
    from kvstore.explain import explain, parse_since, render

    try:
        seconds = parse_since(since) if since is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--since") from None
    result = explain(home, since=seconds, label=label, model=model)
    click.echo(json.dumps(result, indent=1) if as_json else render(result))
