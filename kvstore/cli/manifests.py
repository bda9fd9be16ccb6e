"""`kvstore manifests [remove PATH]`: the manifests a daemon reconciles and watches at every start
(kvstore.home.registry). With a daemon running, removal goes through it, so it stops watching
too."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TypedDict

import click

from kvstore.cli.options import home_option, user_errors
from kvstore.errors import counted
from kvstore.home.registry import canonical, registered


class _Row(TypedDict):  # one registered manifest, as `--json` prints it
    path: str
    added: float  # time.time() when it was registered
    present: bool
    watched: bool | None  # None: no daemon to ask


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per manifest, as a list.")
@home_option
@click.pass_context
@user_errors
def manifests(ctx: click.Context, as_json: bool, home: Path) -> None:
    """List the registered manifests: those warmed through the daemon, which it reconciles and
    watches at every start. A registered manifest that is gone is listed as such.

    \b
    kvstore manifests
    kvstore manifests remove pins.toml
    """
    if ctx.invoked_subcommand is not None:
        return
    entries = registered(home)
    from kvstore.wire.daemon_client import connect
    from kvstore.wire.messages import ManifestsRequest

    client = connect(home)
    watched: set[Path] | None = None
    fixed: list[str] = []
    if client is not None:
        with client:
            res = client.send(ManifestsRequest())
        watched = {canonical(p) for p in res.watched}
        fixed = [p for p in res.fixed if Path(p) not in {r.path for r in entries}]
    rows: list[_Row] = [
        {
            "path": str(r.path),
            "added": r.added,
            "present": r.present,
            "watched": None if watched is None else r.path in watched,
        }
        for r in entries
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    if not rows:
        click.echo("no registered manifests (`kvstore warm --manifest X` with a daemon adds one)")
    for row in rows:
        state = "present" if row["present"] else "gone   "
        seen = {None: "no daemon", True: "watched", False: "not watched"}[row["watched"]]
        added = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["added"]))
        click.echo(f"{state}  {seen:11}  added {added}  {row['path']}")
    for p in fixed:
        click.echo(f"the daemon also watches {p} (the manifest it was started with)")
    gone = [row["path"] for row in rows if not row["present"]]
    if gone:
        click.echo(
            f"{counted(len(gone), 'registered manifest')} gone; "
            "`kvstore manifests remove PATH` forgets one",
            err=True,
        )


@manifests.command(name="remove")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@home_option
@user_errors
def remove(path: Path, home: Path) -> None:
    """Forget a registered manifest; a running daemon stops watching it. Its pins stay stored.

    \b
    kvstore manifests remove pins.toml
    """
    from kvstore.ops import manifests as manifest_ops
    from kvstore.ops.route import Route
    from kvstore.wire.messages import ManifestRemoveReply, ManifestRemoveRequest

    target = canonical(path)
    with Route(home) as route:
        client = route.client
        reply = route.run(
            ManifestRemoveRequest(str(target)),
            lambda: ManifestRemoveReply(removed=manifest_ops.remove(home, target)[1]),
        )
    removed, still = reply.removed, reply.still_watched
    if still:
        click.echo(
            (f"forgot {target}, but " if removed else f"{target}: ")
            + "the daemon was started with this manifest and keeps watching it; "
            "restart it without that --manifest (or move the home's manifest.toml) to stop"
        )
        return
    if not removed:
        raise click.ClickException(f"{target}: not a registered manifest (see `kvstore manifests`)")
    click.echo(
        f"forgot {target}"
        + (": the daemon no longer watches it" if client else "")
        + "; its pins stay stored (`kvstore evict --label NAME` removes them)"
    )
