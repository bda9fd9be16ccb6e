"""`kvstore daemon`: registered through the `kvstore.commands` entry point, so the core CLI never
imports this package. Heavy imports wait until the command runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from kvstore.cli.options import home_option


@click.command(name="daemon")
@click.option(
    "--manifest",
    "-m",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Manifest TOML to warm and watch (default: manifest.toml in the home, if any).",
)
@home_option
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option(
    "--log-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Log to this file, rotated at 10 MiB (3 kept), instead of stderr (the LaunchAgent does).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics (off by default).",
)
def daemon_cmd(
    manifest: Path | None, home: Path, log_level: str, log_file: Path | None,
    metrics_port: int | None,
) -> None:  # fmt: skip
    """Run the store's writer in the foreground (what launchd and systemd run).

    Warms the manifest's missing pins, watches its files, serves the socket; SIGTERM stops it,
    SIGHUP re-reads the manifest. One daemon per home. Exit statuses: daemon/exits.py.

    \b
    kvstore daemon --manifest pins.toml
    """
    from kvstore.daemon import canary
    from kvstore.daemon.boot import run
    from kvstore.daemon.logs import setup_logging

    os.umask(0o077)  # its own process: what it creates (a rolled-over log too) is owner-only
    setup_logging(log_level, log_file)
    rc = run(home, manifest=manifest, metrics_port=metrics_port)
    if rc == 0 and canary.restart.is_set():  # mlx or mlx-lm was upgraded under it
        argv = ["daemon", "--home", str(home.expanduser().absolute()), "--log-level", log_level]
        if manifest is not None:
            argv += ["--manifest", str(manifest.expanduser().absolute())]
        if log_file is not None:
            argv += ["--log-file", str(Path(log_file).expanduser().absolute())]
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port)]
        canary.reexec(argv)
    sys.exit(rc)
