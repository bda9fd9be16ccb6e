"""`kvstore ls | evict | stats | verify`: what is stored, and keeping it within bounds."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import click

from kvstore.cli.options import (
    MIN_KEY_DIGITS,
    existing_home,
    home_option,
    human_size,
    open_store,
    parse_size,
    progress,
    resolve_keys,
    tty,
    user_errors,
    wait_option,
)
from kvstore.degrade import cli_command
from kvstore.errors import counted
from kvstore.store.keys import fingerprint_of, short_hex

if TYPE_CHECKING:  # the wire loads when a command talks to the daemon (`ls` starts without it)
    from kvstore.wire.daemon_client import DaemonNotAnswering
    from kvstore.wire.messages import Owned, Unknown


def _age(ts: float) -> str:
    s = max(0.0, time.time() - ts)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def _named(model: str | None) -> str | None:
    """A --model filter as the model's one name (kvstore.identity.model.model_name): read here,
    in the user's current directory, before it reaches the store or the daemon."""
    from kvstore.identity.model import model_name

    return None if model is None else model_name(model)


def _named_record(r):
    """A learned record with its model's name as extra's `model` (as `ls` names entries')."""
    from dataclasses import replace

    from kvstore.identity.model import entry_model_name

    name = entry_model_name(r.extra.model or "", r.extra.model_dir)
    return r if name == r.extra.model else replace(r, extra=r.extra.updated(model=name))


class _Decoder(Protocol):  # what _previews uses of an mlx-lm tokenizer
    def decode(self, ids: Sequence[int]) -> str: ...


def _previews(metas) -> dict[bytes, str]:
    """First tokens of each entry, decoded with its model's tokenizer when that loads."""
    tokenizers: dict[str, _Decoder | None] = {}
    out = {}
    for m in metas:
        if m.model not in tokenizers:
            tokenizers[m.model] = None  # no tokenizer: the preview shows token ids
            with cli_command(f"kvstore: no tokenizer for {m.model}"):
                from mlx_lm.utils import load_tokenizer

                from kvstore.identity.fingerprint import resolve_model_path

                tokenizers[m.model] = load_tokenizer(resolve_model_path(m.model))
        tok = tokenizers[m.model]
        ids = m.token_ids()[:24]
        text = tok.decode(ids) if tok is not None else " ".join(map(str, ids))
        out[m.key] = text.replace("\n", "\\n")[:48]
    return out


@click.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry, as a list.")
@click.option(
    "--model",
    default=None,
    help="Only entries of this model: a path (from here) or a hub id.",
)
@click.option("--label", default=None, help="Only entries with this label.")
@click.option(
    "--learned",
    is_flag=True,
    help="List learned block records instead (their keys are what `kvstore export` takes).",
)
@home_option
@user_errors
def ls_cmd(as_json: bool, model: str | None, label: str | None, learned: bool, home: Path) -> None:
    """List stored entries (or, with --learned, learned block records).

    \b
    kvstore ls
    kvstore ls --json | jq '.[] | select(.pinned)'
    kvstore ls --learned
    """
    if learned:
        _ls_learned(as_json, model, label, home)
        return
    errors: list = []
    metas = []
    if (home / "store" / "data.mdb").is_file():
        from kvstore.ops import entries
        from kvstore.wire.messages import LsRequest

        with open_store(home) as store:
            metas = entries.ls(store, LsRequest(model=_named(model), label=label), errors)
    if as_json:
        click.echo(json.dumps([m.to_json() for m in metas], indent=1))
    else:
        previews = _previews(metas)
        click.echo(
            f"{'KEY':14} {'LABEL':16} {'TOKENS':>6} {'SIZE':>10} PIN {'HITS':>4} "
            f"{'LAST USED':>10}  MODEL / FIRST TOKENS"
        )
        for m in sorted(metas, key=lambda m: (m.model, m.label)):
            click.echo(
                f"{short_hex(m.key):14} {m.label[:16]:16} {m.ntokens:6d} "
                f"{human_size(m.nbytes):>10} {'yes' if m.pinned else 'no ':3} {m.hits:4d} "
                f'{_age(m.last_used):>10}  {m.model}: "{previews[m.key]}"'
                # a clock-bound pin (its template prints the date) holds for one local day
                + (f"  valid {m.valid_date}" if m.valid_date else "")
                # imported with --trust: never compared with a re-prefill
                + ("  trusted, unchecked" if m.trusted else "")
                # fetched from the fleet: the box that computed it
                + (f"  from {m.extra.uploader}" if m.extra.uploader else "")
                # not yet checked against this box's model (kvstore.fleet.check)
                + (", check pending" if m.extra.fleet_check == "pending" else "")
            )
        click.echo(f"{counted(len(metas), 'entry')}, {human_size(sum(m.nbytes for m in metas))}")
    for e in errors:
        click.echo(f"warning: {e}", err=True)


def _ls_learned(as_json: bool, model: str | None, label: str | None, home: Path) -> None:
    """`ls --learned`: one row per record, by model and position; a chain's last record (one
    nothing extends) is marked `end`: exporting it writes the whole chain."""
    records, extended = [], set()
    if (home / "store" / "data.mdb").is_file():
        from kvstore.learned.blockstore import BlockStore

        with open_store(home) as store:
            blocks = BlockStore(store)
            records, extended = blocks.records(), blocks.extended()
    records = [_named_record(r) for r in records]
    name = _named(model)
    records = [
        r
        for r in records
        if (name is None or r.extra.model == name) and (label is None or r.label == label)
    ]
    if as_json:
        click.echo(
            json.dumps(
                [
                    {
                        **r.extra.to_map(),  # first: it can never shadow the fields below
                        "kind": "learned",
                        "key": r.key.hex(),
                        "model": r.extra.model or "",
                        "fingerprint": fingerprint_of(r.key).hex(),
                        "label": r.label,
                        "start": r.start,
                        "end": r.end,
                        "tokens": r.ntokens,
                        "nbytes": r.nbytes,
                        "pins": r.pins,
                        "created": r.created,
                        "last_used": r.last_used,
                        "hits": r.hits,
                        "classes": r.classes,
                        "codec": r.codec,
                        "chain_end": r.key not in extended,
                    }
                    for r in records
                ],
                indent=1,
            )
        )
        return
    click.echo(
        f"{'KEY':14} {'LABEL':16} {'START':>6} {'END':>6} {'SIZE':>10} {'HITS':>4} "
        f"{'LAST USED':>10}  MODEL"
    )
    for r in sorted(records, key=lambda r: (r.extra.model or "", fingerprint_of(r.key), r.end)):
        click.echo(
            f"{short_hex(r.key):14} {r.label[:16]:16} {r.start:6d} {r.end:6d} "
            f"{human_size(r.nbytes):>10} {r.hits:4d} {_age(r.last_used):>10}  "
            f"{r.extra.model or '?'}" + ("" if r.key in extended else "  end")
        )
    click.echo(
        f"{counted(len(records), 'learned record')}, {human_size(sum(r.nbytes for r in records))}"
    )


@click.command()
@click.argument("keys", nargs=-1)
@click.option("--label", default=None, help="Entries with this label.")
@click.option(
    "--model", default=None, help="Entries of this model: a path (from here) or a hub id."
)
@click.option("--unpinned", is_flag=True, help="Only unpinned entries.")
@click.option(
    "--stale",
    is_flag=True,
    help="Entries whose model changed or is gone (those it cannot judge here are kept).",
)
@click.option("--all", "everything", is_flag=True, help="Every entry.")
@click.option("--to-size", default=None, help="Evict LRU unpinned entries until the store fits.")
@click.option(
    "--yes", is_flag=True, help=f"Accept a KEY prefix shorter than {MIN_KEY_DIGITS} hex digits."
)
@wait_option
@home_option
@user_errors
def evict(keys, label, model, unpinned, stale, everything, to_size, yes, wait, home: Path) -> None:
    """Remove entries. Filters combine (AND); at least one is required.

    \b
    kvstore evict 3fa2c1          # one key (a unique hex prefix of 6 digits or more)
    kvstore evict --label classify
    kvstore evict --unpinned --to-size 2G
    """
    if not (keys or label or model or unpinned or stale or everything or to_size):
        raise click.UsageError(
            "name what to evict: KEY..., --label, --model, --unpinned, --stale, --to-size or --all"
        )
    from kvstore.ops import entries
    from kvstore.ops.route import Route
    from kvstore.wire.messages import EvictRequest

    existing_home(home, "evict")
    size = parse_size(to_size) if to_size else None
    # The daemon is the writer when one runs: it selects and deletes in one job.
    with Route(home, wait=wait) as route, open_store(home, write=route.local) as store:
        req = EvictRequest(
            keys=list(resolve_keys(store, keys, short_ok=yes)) if keys else [],
            label=label,
            model=_named(model),
            unpinned=unpinned,
            stale=stale,
            all=everything,
            to_size=size,
        )
        reply = route.run(
            req,
            lambda: entries.evict(
                store, req, home=home, watched=entries.started_manifests(home)
            ).reply(),
        )
    click.echo(f"evicted {counted(reply.evicted, 'entry')}, {human_size(reply.bytes)}")
    _report_owned(reply.owned, daemon=not route.local)
    _report_unknown(reply.unknown)


def _report_owned(owned: list[Owned], *, daemon: bool) -> None:
    """An evicted pin that a manifest still names comes back when that manifest is reconciled:
    say which manifest, and when. Evict does not re-warm it at once: it is how space is freed or
    a suspect entry dropped, and a re-warm loads the model."""
    for o in owned:
        name, path = o.label, o.manifest
        if not o.watched:
            click.echo(
                f"pin {name!r} came from manifest {path}, which no daemon watches: it stays "
                f"evicted until `kvstore warm --manifest {path}`"
            )
            continue
        when = (
            "the daemon re-warms it at its next reconcile (a restart, a manifest edit or "
            f"`kvstore warm --manifest {path}`)"
            if daemon
            else f"the daemon re-warms it when it starts (`kvstore warm --manifest {path}` now)"
        )
        click.echo(
            f"pin {name!r} is kept by manifest {path}: {when}; "
            "remove it from the manifest to drop it for good"
        )


def _report_unknown(unknown: list[Unknown]) -> None:
    """--stale never deletes what it cannot judge: say which entries were kept, and why."""
    if not unknown:
        return
    n = len(unknown)
    click.echo(f"kept {counted(n, 'entry')} whose staleness is unknown here:")
    for u in unknown:
        click.echo(f"  {short_hex(u.key)} {u.label[:16]:16} {u.model}: {u.reason}")


@click.command()
@click.option("--json", "as_json", is_flag=True)
@wait_option
@home_option
@user_errors
def stats(as_json: bool, wait: float, home: Path) -> None:
    """Store size, entries, pins, settings; with a daemon running, its state and the prefill
    ledger (per model and label: calls, tokens from cache, tokens prefilled, seconds).

    \b
    kvstore stats
    kvstore stats --json | jq .ledger
    """
    from kvstore.wire.daemon_client import DaemonNotAnswering, connect_writer

    silent: DaemonNotAnswering | None = None  # the store is read directly: a read, so exit 0
    try:
        client = connect_writer(home, timeout=10, wait=wait)
    except DaemonNotAnswering as e:
        client, silent = None, e
    data = _stats_data(home, client)
    if silent is not None:
        data["daemon"] = {"pid": silent.pid, "answers": False}
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    for k, v in data.items():
        if not isinstance(v, dict):
            click.echo(f"{k:14} {human_size(v) if 'bytes' in k or k == 'map_size' else v}")
    _echo_daemon(data.get("daemon"), silent)
    _echo_learned(data.get("learned"))
    _echo_ledger((data.get("ledger") or {}).get("by_model_label") or [])
    click.echo("settings:")
    rows = _setting_rows(data["settings"])
    width = max((len(k) for k, _ in rows), default=0)
    for k, v in rows:
        click.echo(f"  {k:{width}}  {v}")


def _stats_data(home: Path, client) -> dict:
    """The `stats` operation: answered by the daemon when one does, else read here (the same
    operation, kvstore.ops.stats, without the daemon's own state)."""
    from kvstore.home.ledger import Ledger
    from kvstore.home.settings import load_settings
    from kvstore.ops import stats as stats_ops

    if client is not None:
        from kvstore.wire.messages import StatsRequest

        with client:
            return client.send(StatsRequest()).to_wire()
    if not (home / "store" / "data.mdb").is_file():
        reply = stats_ops.empty(home, settings=load_settings(home), ledger=Ledger(home).stats())
        return reply.to_local_json()
    from kvstore.learned.blockstore import BlockStore

    with open_store(home) as store:
        reply = stats_ops.stats(
            store, BlockStore(store), settings=load_settings(home), ledger=Ledger(home).stats()
        )
    return reply.to_local_json()


def _echo_daemon(daemon: dict | None, silent: DaemonNotAnswering | None) -> None:
    if silent is not None:
        click.echo(
            f"daemon         pid {silent.pid}: holds this store but does not answer (stopped, "
            "hung or still starting); these stats are read from the store itself"
        )
    elif daemon:
        click.echo(
            f"daemon         pid {daemon['pid']}, up {daemon['uptime']:.0f}s, "
            f"{human_size(daemon['rss'])} resident, watcher {daemon['watcher']}"
        )
        for manifest, d in (daemon.get("deferred") or {}).items():
            click.echo(f"deferred       warm of {manifest}: {d['reason']}")
    else:
        click.echo("daemon         not running")


def _echo_learned(learned: dict | None) -> None:
    if learned:
        click.echo(
            f"learned        {learned['records']} records ({learned['chains']} chains), "
            f"{human_size(learned['bytes'] + learned.get('snapshot_bytes', 0))} of "
            f"{human_size(learned['budget'])}; {learned['snapshots']} snapshots; written today "
            f"{human_size(learned['written_today'])} of {human_size(learned['write_budget'])}"
        )
        if learned.get("paused"):
            click.echo(f"               {learned['paused']}")


def _echo_ledger(rows: list[dict]) -> None:
    """The prefill ledger, per model and label."""
    if not rows:
        return
    click.echo(
        f"\n{'MODEL':20} {'LABEL':14} {'CALLS':>6} {'PROMPT':>8} {'CACHED':>8} "
        f"{'PREFILLED':>9} {'PREFILL S':>9} {'SAVED S~':>8}"
    )
    for r in rows:
        click.echo(
            f"{Path(r['model']).name[:20]:20} {r['label'][:14]:14} {r['calls']:6d} "
            f"{r['prompt_tokens']:8d} {r['cached_tokens']:8d} "
            f"{r['prefilled_tokens']:9d} {r['prefill_s']:9.2f} "
            f"{r['saved_s']:8.2f}"
        )


def _setting_rows(settings: dict, prefix: str = "") -> list[tuple[str, str]]:
    """Each setting as `stats` shows it: sizes and durations in their units (kvstore.home.settings
    UNITS), a table's keys under its name (remote.endpoint)."""
    from kvstore.home.settings import UNITS

    rows = []
    for k, v in settings.items():
        if isinstance(v, dict):
            rows += _setting_rows(v, f"{prefix}{k}.")
            continue
        unit = UNITS.get(k) if not prefix else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or unit is None:
            shown = str(v).lower() if isinstance(v, bool) else str(v)
        elif unit.startswith("bytes"):
            shown = human_size(v) + unit[len("bytes") :]
        else:
            shown = f"{v:g} {unit}"
        rows.append((prefix + k, shown))
    return rows


@click.command()
@click.option("--repair", is_flag=True, help="Delete the entries and learned records that fail.")
@click.option(
    "--deep",
    is_flag=True,
    help="Also re-prefill one short pin per manifest model and compare it with the stored KV "
    "(the upgrade canary), check every entry at positions drawn at random (one decoding step "
    "each, after its first 64 re-prefilled), and re-prefill every entry that is no manifest's "
    "pin (imports, app pins); with --repair, a model that differs is dropped and re-warmed, an "
    "entry that differs deleted.",
)
@click.option(
    "--manifest",
    "manifests",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Manifest whose models --deep checks (default: the registered manifests and the "
    "home's manifest.toml). Repeatable.",
)
@home_option
@user_errors
def verify(repair: bool, deep: bool, manifests: tuple[Path, ...], home: Path) -> None:
    """Check every entry (meta, checksum, a full decode) and learned record (meta, checksum,
    header, chain links). Exits 1 naming each bad one.

    Checking reads the store directly. With --repair the deletions are writes: with a daemon
    running it does the repair (it is the one writer), else this process does.

    \b
    kvstore verify --deep          # after upgrading mlx or mlx-lm
    """
    if not (home / "store" / "data.mdb").is_file():
        click.echo(f"no store in {home}: nothing to verify")
        return
    from kvstore.learned.blockstore import BlockStore
    from kvstore.ops import verify as verify_ops
    from kvstore.ops.route import Route
    from kvstore.wire.messages import RepairRequest

    with Route(home, connect=repair) as route:  # never write beside a daemon
        if route.client is not None:
            progress(f"repairing through the daemon for {home}; it checks every entry")
            reply = route.client.send(RepairRequest())
        else:
            with open_store(home, write=repair) as store:
                bar = (
                    (
                        lambda i, total: click.echo(
                            f"\rverified {i}/{total}", err=True, nl=i == total
                        )
                    )
                    if tty()
                    else None
                )
                reply = verify_ops.check(
                    store, BlockStore(store), home=home, repair=repair, progress=bar
                )
    n, records = reply.entries, reply.records  # an older daemon checks entries only
    problems = [(p.key.hex(), p.reason) for p in reply.problems]
    bad_records = [(p.key.hex(), p.reason) for p in reply.record_problems]
    for key, reason in problems:
        click.echo(f"bad entry {key}: {reason}")
    for key, reason in bad_records:
        click.echo(f"bad learned record {key}: {reason}")
    _report_trusted(home, deep)
    differs = _deep(home, manifests, repair=repair) if deep else 0
    entries_differ = _deep_entries(home, repair=repair) if deep else 0
    if problems or bad_records or differs or entries_differ:
        what = []
        if problems:
            failed = f"{counted(len(problems), 'entry')} of {n} failed"
            what.append(failed + (" (deleted)" * repair))
        if bad_records:
            failed = f"{counted(len(bad_records), 'learned record')} of {records} failed"
            what.append(
                failed + (" (deleted)" if repair else "; `kvstore verify --repair` drops them")
            )
        if differs:
            what.append(
                f"{counted(differs, 'model')} computed other KV than stored"
                + (" (re-warmed)" * repair)
            )
        if entries_differ:
            what.append(
                f"{counted(entries_differ, 'entry')} computed other KV than stored"
                + (" (deleted)" * repair)
            )
        raise click.ClickException("; ".join(what))
    click.echo(
        f"{counted(n, 'entry')} ok" + (f", {counted(records, 'learned record')} ok" * bool(records))
    )


def _deep(home: Path, manifests: tuple[Path, ...], *, repair: bool) -> int:
    """The upgrade canary on demand; returns how many models differ."""
    from kvstore.home.settings import MANIFEST_NAME
    from kvstore.pins.manifest import load_manifest
    from kvstore.warm.canary import check_manifest, describe

    if manifests:
        paths = list(manifests)
    else:  # the manifests a daemon keeps true: the registered ones and the home's own
        from kvstore.home.registry import canonical, registered

        known = [r.path for r in registered(home)] + [home / MANIFEST_NAME]
        paths = [p for p in dict.fromkeys(canonical(p) for p in known) if p.is_file()]
        if not paths:
            progress("no manifest registered or in the home: no manifest model to check")
    differs = []
    for path in paths:
        manifest = load_manifest(path)
        progress(f"re-prefilling one pin per model of {manifest.path}")
        with open_store(home) as store:
            results = check_manifest(manifest, store, home=home)
        for r in results:
            click.echo(("ok    " if r.ok else "error " if r.error else "DIFFERS ") + describe(r))
            if not r.ok and not r.error:
                differs.append((manifest, fingerprint_of(bytes.fromhex(r.key))))
    if repair and differs:
        _rewarm(home, differs)
    return len(differs)


def _rewarm(home: Path, differs: list) -> None:
    """Drop each differing model's entries and warm its manifest again (through the daemon when
    one runs: it is the writer)."""
    from kvstore.ops import warm as warm_ops
    from kvstore.ops.route import Route

    def warn(msg: str) -> None:
        click.echo(f"warning: {msg}", err=True)

    with open_store(home) as store:
        keys = [m.key for _, fp in differs for m in store.metas(fp, errors=[])]
    with Route(home) as route, _store_here(route, home) as store:
        _evict_keys(route, store, home, keys)
        for manifest in {m.path: m for m, _ in differs}.values():
            if route.client is not None:
                warm_ops.send(route.client, manifest.path)
            else:
                warm_ops.warm(manifest, store, home=home, progress=progress, warn=warn)
    click.echo(f"dropped {counted(len(keys), 'entry')} and re-warmed their manifests")


def _report_trusted(home: Path, deep: bool) -> None:
    """Entries imported with --trust: stored without a re-prefill to check them."""
    with open_store(home) as store:
        trusted = [m for m in store.metas(errors=[]) if m.trusted]
    for m in trusted:
        click.echo(
            f"unchecked {m.key.hex()} {m.label!r} of {m.model}: imported with --trust, its KV "
            "was never compared with the model" + ("" if deep else " (verify --deep compares it)")
        )


def _deep_entries(home: Path, *, repair: bool) -> int:
    """Check every entry against its model (kvstore.fleet.check.check_cache: its first positions
    re-prefilled, then one decoding step at each of a few positions drawn at random here), and
    re-prefill every entry that is no manifest's pin (imports, app pins, write-behind) as an
    import is checked; returns how many differ (deleted with --repair)."""
    from kvstore.pins.ownership import owners
    from kvstore.warm.canary import check_entries

    with open_store(home) as store:
        metas = store.metas(errors=[])
        if not metas:
            return 0
        pins = {m.key for m in metas if any(o.startswith("manifest:") for o in owners(m))}
        progress(
            f"checking {counted(len(metas), 'entry')} at positions drawn at random, and "
            f"re-prefilling the {counted(len(metas) - len(pins), 'entry')} that are no "
            "manifest's pins"
        )
        results = check_entries(store, metas, home=home, judge=_entry_judge(pins))
    differs = []
    for r in results:
        what = f"entry {r.label!r} ({short_hex(r.key)}, {r.tokens} tokens) of {r.model}"
        if r.error:
            click.echo(f"error   {what}: could not be checked: {r.error}")
        elif r.ok:
            click.echo(f"ok      {what}: {r.detail}")
        else:
            click.echo(f"DIFFERS {what}: {r.detail}")
            differs.append(bytes.fromhex(r.key))
    if repair and differs:
        from kvstore.ops.route import Route

        with Route(home) as route, _store_here(route, home) as store:
            _evict_keys(route, store, home, differs)
    return len(differs)


def _entry_judge(pins: set[bytes]):
    """verify --deep's check of one entry (kvstore.warm.canary.check_entries' judge)."""
    from kvstore.fleet.check import check_cache
    from kvstore.warm.importfit import ImportMismatch, kv_check

    def judge(model, identity, meta, cache) -> str:
        ids = meta.token_ids()
        full = None if meta.key in pins else kv_check(model, cache, ids, what="")
        v = check_cache(model, identity, ids, cache)  # both leave `cache` as it was
        if not v.ok:
            raise ImportMismatch(f"not the KV this model computes for these tokens: {v.what}")
        return f"checked, {v.what}" if full is None else f"re-prefilled, {full} match; {v.what}"

    return judge


def _store_here(route, home: Path):
    """The store, open for writing, when this process is the writer; else nothing (the daemon
    writes)."""
    from contextlib import nullcontext

    return open_store(home, write=True) if route.local else nullcontext()


def _evict_keys(route, store, home: Path, keys: list[bytes]) -> None:
    """Evict these entries: the `evict` operation, in the daemon when one runs, else here."""
    from kvstore.ops import entries
    from kvstore.wire.messages import EvictRequest

    if not keys:
        return
    req = EvictRequest(keys=list(keys))
    route.run(req, lambda: entries.evict(store, req, home=home, watched=set()).reply())
