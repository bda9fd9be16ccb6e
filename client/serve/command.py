"""`kvstore serve`: mlx-lm's own OpenAI-compatible server, with the persistent prompt cache.

The server runs in-process, unchanged, under the hooks of kvstore.client.serve.hooks (hydrate at
model load, and with --persist-system-prompts the stable system segment and its persister,
kvstore.client.serve.persist). This module is the command and its argv hand-off to mlx_lm.server's
main(); it imports the hooks (and mlx-lm with them) only when the server runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import click

from kvstore.cli.options import home_option, parse_json_object
from kvstore.errors import KVStoreError

__all__ = ["serve", "serve_cmd"]


def serve(
    model: str,
    *,
    home: Path,
    port: int | None = None,
    persist: bool = False,
    model_config: dict | None = None,
    server_args: Sequence[str] = (),
) -> None:
    """Run mlx_lm.server's main() with `--model model` and `server_args`, hydrated from `home`."""
    # here, not at the top: `kvstore --help` loads this module, the hooks load mlx-lm
    from kvstore.client.serve.hooks import patched_server

    argv = ["mlx_lm.server", "--model", model]
    if port is not None:
        argv += ["--port", str(port)]
    argv += list(server_args)
    with patched_server(home, persist=persist, model_config=model_config) as server:
        saved_argv = sys.argv
        sys.argv = argv  # main() parses sys.argv: every mlx_lm.server option passes through
        try:
            server.main()
        finally:
            sys.argv = saved_argv


@click.command(
    name="serve",
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": ["-h", "--help"],
    },
)
@home_option
@click.option("--model", "-m", required=True, help="Model directory or hub id, as mlx_lm.server.")
@click.option("--port", type=int, default=None, help="HTTP port (mlx_lm.server's default: 8080).")
@click.option(
    "--persist-system-prompts",
    is_flag=True,
    help="Send new system-prompt prefixes to the daemon, so later starts hydrate them.",
)
@click.option(
    "--model-config",
    "model_config",
    default=None,
    metavar="JSON",
    help="config.json overrides for the model, as mlx_lm.load(model_config=...), e.g. "
    "'{\"rope_theta\": 1000000}'. Part of the entries' identity.",
)
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def serve_cmd(
    home: Path | None,
    model: str,
    port: int | None,
    persist_system_prompts: bool,
    model_config: str | None,
    server_args: tuple[str, ...],
) -> None:
    """Run mlx_lm.server with the persistent prompt cache.

    Stored entries of the model are hydrated into the server's prompt cache when it loads the
    model, so the first request after a start reports them in
    usage.prompt_tokens_details.cached_tokens. Other options go to mlx_lm.server as they are.

    \b
    kvstore serve --model ./Qwen3.5-9B-8bit --port 8080 --prompt-cache-size 20
    """
    from kvstore.settings import resolve_home

    overrides = parse_json_object(model_config, "--model-config")
    try:
        serve(
            model,
            home=resolve_home(home),
            port=port,
            persist=persist_system_prompts,
            model_config=overrides,
            server_args=server_args,
        )
    except KVStoreError as e:
        raise click.ClickException(str(e)) from None
