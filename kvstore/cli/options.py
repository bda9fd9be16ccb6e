"""What the `kvstore` commands share: the --home and --wait options, sizes and JSON arguments,
the store opened read-only or for writing, key prefixes resolved, project errors as one line.

The daemon's and client's commands import it too, so it stays light: click and the settings only.
"""

from __future__ import annotations

import errno
import functools
import re
import sys
from pathlib import Path

import click

from kvstore.errors import KVStoreError, counted
from kvstore.home.settings import ensure_home, given_home
from kvstore.identity.modelconfig import overrides_from_json
from kvstore.store.keys import digest_hex

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 500M, 8G, 1048576)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def parse_json_object(text: str | None, option: str) -> dict | None:
    """A JSON object given on the command line (e.g. --model-config), or None."""
    try:
        return overrides_from_json(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _home(ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path:
    """The home resolved, refused in one line when it cannot be one (a file, a path under a
    file, unreachable). The daemon says so itself: one log line and its configuration exit
    status (daemon/exits.py), which a supervisor acts on."""
    try:
        return given_home(value, check=ctx.command.name != "daemon")
    except KVStoreError as e:
        raise click.ClickException(str(e)) from None


home_option = click.option(
    "--home",
    type=click.Path(),  # checked by _home: a file is one line, not a usage error
    metavar="DIRECTORY",
    envvar="KVSTORE_HOME",
    callback=_home,
    help="kvstore home (default: $KVSTORE_HOME or the per-user data directory).",
)


def existing_home(home: Path, doing: str) -> None:
    """For a command that only reads or removes: a home that does not exist is a wrong path (a
    typo, an unset $KVSTORE_HOME), said in one line; such a command never creates one."""
    if not home.is_dir():
        raise click.ClickException(
            f"no kvstore home at {home}: nothing to {doing}; check --home or $KVSTORE_HOME"
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


def pin_label(_ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A --label that names a pin: refused as the manifest refuses a pin name (empty, or with a
    control character that would break the `ls` and `warm` tables)."""
    from kvstore.pins.manifest import pin_name_problem

    if value is not None and (problem := pin_name_problem(value)):
        raise click.BadParameter(problem, param=param)
    return value


def user_errors(f):
    """Turn the project's own errors into one-line click errors (exit 1)."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except KVStoreError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:  # the file system refused (permissions, flags, a vanished path)
            if e.filename is None:
                raise
            what = f"{e.filename}: {e.strerror or e}"
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                what += "; check its permissions and flags"
            raise click.ClickException(what) from None

    return wrapper


def tty() -> bool:
    return sys.stderr.isatty()


def progress(msg: str) -> None:
    if tty():
        click.echo(msg, err=True)


def open_store(home: Path, *, write: bool = False):
    from kvstore.store.store import Store

    if write:
        ensure_home(home)
    return Store(home, readonly=not write)


MIN_KEY_DIGITS = 6  # hex digits a key prefix needs to name what is removed (git refuses short ids)


def resolve_keys(
    store,
    texts: tuple[str, ...],
    *,
    keys: list[bytes] | None = None,
    what: str = "entry",
    short_ok: bool = True,
) -> list[bytes]:
    """Full keys, unique prefixes of them, or unique prefixes of the prefix-hash half (what `ls`
    shows: the first half of every key of one model is the same fingerprint). Among the store's
    entries, or among `keys` (learned records: `what` names them in errors). Unless `short_ok`
    (a command that removes: `--yes` given), a prefix shorter than MIN_KEY_DIGITS is refused:
    `evict 0` must not delete whichever entry happens to start with 0."""
    all_keys = [k.hex() for k in (store.keys() if keys is None else keys)]
    out = []
    for t in texts:
        t = t.lower()
        if not re.fullmatch(r"[0-9a-f]+", t):
            raise click.ClickException(f"key {t!r} is not hex")
        if not short_ok and len(t) < MIN_KEY_DIGITS:
            raise click.ClickException(
                f"key {t!r} is {counted(len(t), 'hex digit')}: give at least {MIN_KEY_DIGITS} "
                "(`kvstore ls` shows the keys), or pass --yes to evict what it matches"
            )
        hits = [k for k in all_keys if k.startswith(t) or digest_hex(k).startswith(t)]
        if len(hits) != 1:
            found = f"no {what}" if not hits else counted(len(hits), what)
            raise click.ClickException(f"key {t!r} matches {found}; give more hex digits")
        out.append(bytes.fromhex(hits[0]))
    return out
