"""The `kvstore` command line (click): the group, `warm`, `explain`, and the commands registered
on it.

User errors exit non-zero with one line naming what was wrong. The group and the modules it
imports stay light (no mlx, mlx-lm, transformers or numpy) so that `ls`, `stats` and `--help`
start fast: a command imports what touches models or KV bytes when it runs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from kvstore import __version__
from kvstore.cli import admin, analyze, manifests, remote, transfer
from kvstore.cli.options import (
    home_option,
    human_size,
    open_store,
    progress,
    user_errors,
    wait_option,
)
from kvstore.degrade import foreign


class _PluginGroup(click.Group):
    """Adds the commands the daemon and client packages register under the entry-point group
    `kvstore.commands`, loaded only when named, so this core package never imports them."""

    @staticmethod
    def _plugins() -> dict:
        from importlib.metadata import entry_points  # slow to import: only for a plugin

        return {ep.name: ep for ep in entry_points(group="kvstore.commands")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._plugins()))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is None and (ep := self._plugins().get(name)) is not None:
            # a broken plugin must not take the core CLI down
            with foreign(lambda e: click.ClickException(f"command {name!r} unavailable: {e}")):
                cmd = ep.load()
        return cmd


@click.group(cls=_PluginGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvstore")
def main() -> None:
    """kvstore: persistent prefix KV caches for mlx-lm.

    \b
    kvstore warm --manifest pins.toml     # prefill and store every pin
    kvstore ls                            # what is stored
    kvstore verify                        # checksums and full decode
    """


@main.command()
@click.option(
    "--manifest",
    "-m",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Manifest TOML (default: manifest.toml in the home).",
)
@wait_option
@home_option
@user_errors
def warm(manifest: Path | None, wait: float, home: Path) -> None:
    """Prefill and store every pin of a manifest that is missing.

    \b
    kvstore warm --manifest pins.toml
    """
    from kvstore.home.settings import MANIFEST_NAME
    from kvstore.ops import warm as warm_ops
    from kvstore.pins.manifest import load_manifest
    from kvstore.store.keys import short_hex
    from kvstore.warm.warm import PinStatus

    manifest = manifest or home / MANIFEST_NAME
    m = load_manifest(manifest)
    from kvstore.wire.daemon_client import connect_writer

    client = connect_writer(home, wait=wait)
    if client is not None:  # the daemon is the writer: it warms (and watches this manifest)
        progress(f"warming through the daemon for {home}; its log shows the progress")
        with client:
            report = warm_ops.send(client, m.path)
    else:

        def warn(msg: str) -> None:
            click.echo(f"warning: {msg}", err=True)

        with _held_log() as held:
            with open_store(home, write=True) as store:
                report = warm_ops.warm(m, store, home=home, progress=progress, warn=warn)
        said = [p.error or "" for p in report.pins] + [p.warning or "" for p in report.pins]
        said.append(report.stopped or "")
        for msg in held:  # what the report below does not say already
            if not any(msg in s for s in said):
                click.echo(msg, err=True)
    for gone in report.purged:
        click.echo(f"purged   {gone.label:20} {short_hex(gone.key)}  {gone.model}: {gone.cause}")
    for gone in report.released:
        click.echo(
            f"released {gone.label:20} {short_hex(gone.key)}  {gone.model}: {gone.cause}"
            " (kept: other owners)"
        )
    for p in report.pins:
        # where the pin's KV came from: prefilled here, already present, or fetched (fleet tier)
        source = "prefilled" if p.status is PinStatus.WARMED else p.status
        line = f"{source:9} {p.name:20} {p.tokens:6d} tokens  {p.model}"
        if p.status in (PinStatus.WARMED, PinStatus.FETCHED):
            line += f"  ({human_size(p.nbytes)}, {p.seconds:.2f}s)"
        if p.valid_date:  # the template prints the date: re-warmed daily
            line += f"  valid {p.valid_date}"
        if p.remote:
            line += f"  [remote: {p.remote}]"
        if p.status is PinStatus.DEFERRED:  # the daemon warms it once memory allows
            line += f"  ({p.error})"
        click.echo(line)
        if p.warning:
            click.echo(f"warning: {p.warning}", err=True)
    deferred = len(report.deferred)
    present = len(report.pins) - report.warmed - report.fetched - len(report.failed) - deferred
    click.echo(
        f"{report.warmed} warmed, {present} present, {len(report.failed)} failed, "
        f"{report.fetched} fetched in {report.seconds:.2f}s"
        + (f", {deferred} deferred (not enough memory to load the model now)" if deferred else "")
    )
    if report.stopped:  # a full disk: one line with why, and every pin left unwarmed
        names = ", ".join(f"{p.name!r}" for p in report.failed)
        raise click.ClickException(f"{report.stopped}; left unwarmed: {names}")
    if report.failed:
        raise click.ClickException("; ".join(f"{p.name}: {p.error}" for p in report.failed))


@main.command(name="explain")
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


@contextmanager
def _held_log() -> Iterator[list[str]]:
    """Warm logs each failure and warning for the daemon's log, and its report carries them: here
    the report is printed, so the kvstore logger's warnings are held (not printed by Python's
    last-resort handler as well) and the caller prints those the report does not say."""
    held: list[str] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record.getMessage())

    logger = logging.getLogger("kvstore")
    if logger.handlers or logging.getLogger().handlers:  # logging set up by someone: theirs
        yield held
        return
    handler = Hold(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield held
    finally:
        logger.removeHandler(handler)


# The commands live by responsibility, each module's on the group here.
for command in (
    admin.ls_cmd,
    admin.evict,
    admin.stats,
    admin.verify,
    analyze.analyze_cmd,
    manifests.manifests,
    remote.remote_group,
    transfer.export_cmd,
    transfer.import_cmd,
    transfer.fingerprint,
):
    main.add_command(command)

if __name__ == "__main__":
    main()
