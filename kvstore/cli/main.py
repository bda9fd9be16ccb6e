"""The `kvstore` command line (click).

User errors exit non-zero with one line naming what was wrong.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

import click

from kvstore import __version__
from kvstore.errors import KVStoreError
from kvstore.settings import ensure_home, resolve_home
from kvstore.wire.daemon_client import connect_writer, warm_report

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 500M, 8G, 1048576)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def parse_json_object(text: str | None, option: str) -> dict | None:
    """A JSON object given on the command line (e.g. --model-config), or None."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint=option) from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint=option)
    return value


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


home_option = click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="KVSTORE_HOME",
    callback=lambda _ctx, _param, value: resolve_home(value),
    help="kvstore home (default: $KVSTORE_HOME or the per-user data directory).",
)


wait_option = click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for a daemon that holds the store but does not answer (stopped, "
    "busy starting); without an answer this exits 1 and writes nothing.",
)


def user_errors(f):
    """Turn the project's own errors into one-line click errors (exit 1)."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except KVStoreError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def _tty() -> bool:
    return sys.stderr.isatty()


def _progress(msg: str) -> None:
    if _tty():
        click.echo(msg, err=True)


def open_store(home: Path, *, write: bool = False):
    from kvstore.store.store import Store

    if write:
        ensure_home(home)
    return Store(home, readonly=not write)


def resolve_keys(store, texts: tuple[str, ...]) -> list[bytes]:
    """Full keys, unique prefixes of them, or unique prefixes of the prefix-hash half (what `ls`
    shows: the first half of every key of one model is the same fingerprint)."""
    all_keys = [k.hex() for k in store.keys()]
    out = []
    for t in texts:
        t = t.lower()
        if not re.fullmatch(r"[0-9a-f]+", t):
            raise click.ClickException(f"key {t!r} is not hex")
        hits = [k for k in all_keys if k.startswith(t) or k[32:].startswith(t)]
        if len(hits) != 1:
            what = "no entry" if not hits else f"{len(hits)} entries"
            raise click.ClickException(f"key {t!r} matches {what}; give more hex digits")
        out.append(bytes.fromhex(hits[0]))
    return out


class _PluginGroup(click.Group):
    """Adds the commands the daemon and client packages register under the entry-point group
    `kvstore.commands`, loaded only when named, so this core package never imports them."""

    @staticmethod
    def _plugins() -> dict:
        return {ep.name: ep for ep in entry_points(group="kvstore.commands")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._plugins()))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is None and (ep := self._plugins().get(name)) is not None:
            try:
                cmd = ep.load()
            except Exception as e:  # a broken plugin must not take the core CLI down
                raise click.ClickException(f"command {name!r} unavailable: {e}") from None
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
    from kvstore.pins.manifest import load_manifest
    from kvstore.settings import MANIFEST_NAME
    from kvstore.warm.warm import warm as do_warm

    manifest = manifest or home / MANIFEST_NAME
    m = load_manifest(manifest)
    client = connect_writer(home, wait=wait)
    if client is not None:  # the daemon is the writer: it warms (and watches this manifest)
        _progress(f"warming through the daemon for {home}; its log shows the progress")
        with client:
            report = warm_report(client.warm(m.path))
    else:
        from kvstore.cli.remote import local_fleet

        with open_store(home, write=True) as store, local_fleet(home, store) as fetch:
            report = do_warm(m, store, home=home, progress=_progress, fetch=fetch)
            if fetch is not None:
                fetch.record(report)
    for p in report.purged:
        click.echo(f"purged   {p.label:20} {p.key[:12]}  {p.model}: {p.cause}")
    for p in report.released:
        click.echo(f"released {p.label:20} {p.key[:12]}  {p.model}: {p.cause} (kept: other owners)")
    for p in report.pins:
        # where the pin's KV came from: prefilled here, already present, or fetched (fleet tier)
        source = {"warmed": "prefilled", "present": "present"}.get(p.status, p.status)
        line = f"{source:9} {p.name:20} {p.tokens:6d} tokens  {p.model}"
        if p.status in ("warmed", "fetched"):
            line += f"  ({human_size(p.nbytes)}, {p.seconds:.2f}s)"
        if getattr(p, "valid_date", None):  # the template prints the date: re-warmed daily
            line += f"  valid {p.valid_date}"
        if p.remote:
            line += f"  [remote: {p.remote}]"
        if p.status == "deferred":  # the daemon warms it once memory allows
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


# The commands live by responsibility; importing them registers them on `main`.
from kvstore.cli import admin, manifests, remote, transfer  # noqa: E402, F401

# `python -m kvstore.cli.main`: run the module's group, the one the commands registered on.
if __name__ == "__main__":
    from kvstore.cli.main import main as registered

    registered()
