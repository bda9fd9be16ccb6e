"""`kvstore remote status | ls | push | pull | gc`: the fleet tier from the command line.

Each works with or without a daemon: reads and uploads go to the object store from this process
(conditional creates make a race with the daemon's uploader harmless), and local writes of `pull`
go through the daemon when one runs (it is the one writer).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvstore.cli.options import home_option, human_size, open_store, user_errors
from kvstore.errors import RemoteError, counted
from kvstore.fleet.remote_settings import REMOTE_SAMPLE
from kvstore.store.keys import fingerprint_of, short_hex

if TYPE_CHECKING:
    from kvstore.store.entry import PutFields

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.I)
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
STALE_UPLOAD_SECONDS = 86400  # multipart uploads older than this are a crash's: gc aborts them

manifest_option = click.option(
    "--manifest",
    "-m",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Manifest naming the models (default: manifest.toml in the home).",
)


def parse_duration(text: str) -> float:
    m = _DURATION.match(text)
    if not m:
        raise click.BadParameter(f"{text!r} is not a duration (e.g. 30d, 12h, 90m, 3600)")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def _settings(home: Path):
    from kvstore.fleet.remote_settings import remote_settings
    from kvstore.home.settings import load_settings

    rs = remote_settings(load_settings(home), home)
    if rs is None:
        raise click.ClickException(
            f"{home / 'settings.toml'}: no [remote] table, so the fleet tier is off; add one with "
            "endpoint and bucket (`kvstore remote --help` shows a sample; README: Fleet)"
        )
    return rs


def _remote(home: Path):
    from kvstore.fleet.objects import Remote

    return Remote(_settings(home))


def _plans(home: Path, manifest: Path | None, model: str | None, store):
    """The manifest's model plans (fingerprint and rendered pins), only `model`'s if given."""
    from kvstore.home.settings import MANIFEST_NAME
    from kvstore.pins.manifest import load_manifest
    from kvstore.warm.warm import plan_model

    path = manifest or home / MANIFEST_NAME
    if not path.is_file():
        raise click.ClickException(f"{path}: no manifest; name the models with --manifest")
    specs = [s for s in load_manifest(path).models if model is None or s.path == model]
    if not specs:
        raise click.ClickException(f"{path}: no model {model!r} in this manifest")
    return [plan_model(s, store, home=home) for s in specs]


def _model_fingerprints(home: Path, model: str | None, manifest: Path | None) -> list[bytes]:
    """A 32-hex-digit fingerprint as given, else the fingerprints of the manifest's models."""
    if model is not None and re.fullmatch(r"[0-9a-fA-F]{32}", model):
        return [bytes.fromhex(model)]
    return [p.fingerprint.digest for p in _plans(home, manifest, model, None)]


_REMOTE_HELP = f"""The fleet tier: share KV with boxes that serve the same model files, through S3.

\b
kvstore remote status          # settings, reachability, what is where
kvstore remote push            # upload every local entry; returns when done
kvstore remote pull            # fill this box from the remote before it serves
kvstore remote gc --older-than 30d

\b
It needs a [remote] table (all its keys: README, Fleet), at least:
{REMOTE_SAMPLE}"""


@click.group(name="remote", help=_REMOTE_HELP)
def remote_group() -> None:
    pass


@remote_group.command(name="status")
@click.option("--json", "as_json", is_flag=True)
@home_option
@user_errors
def status_cmd(as_json: bool, home: Path) -> None:
    """Settings (never the secret), whether the remote answers, objects there, the local queue."""
    from kvstore.fleet.objects import Remote
    from kvstore.fleet.queue import UploadQueue

    rs = _settings(home)
    remote = Remote(rs)
    data: dict = {"settings": rs.shown(), "reachable": False}
    try:
        remote.check()
        objs = list(remote.objects())
        data.update(reachable=True, objects=len(objs), bytes=sum(o.size for o in objs))
        data["models"] = len({fingerprint_of(o.key) for o in objs})
        recs = list(remote.records())
        data.update(records=len(recs), records_bytes=sum(o.size for o in recs))
        data["other_format_versions"] = remote.other_versions()
    except RemoteError as e:
        data["error"] = str(e)
    from kvstore.fleet.fetch import unauthenticated

    data["authenticated"] = bool(rs.fleet_keys)
    with UploadQueue(home) as queue:
        data["queue"] = queue.counts()
        data["rates"] = {n: queue.rate(n) for n in ("fetch_bps", "upload_bps")}
        data["refused"] = queue.refusals()
        data["quarantined"] = queue.quarantined()
    from kvstore.fleet.readthrough import read_totals, shown_totals

    data["read_through"] = read_totals(home)
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    click.echo(f"remote         {remote.where()}")
    click.echo(f"box            {rs.box_id}")
    if why := unauthenticated(rs):
        click.echo(f"warning: {why}", err=True)
    refused = ", ".join(f"{n} {c}" for c, n in sorted(data["refused"].items())) or "none"
    click.echo(f"refused        {refused}")
    for box, why in sorted(data["quarantined"].items()):
        click.echo(f"quarantined    {box}: {why} (`kvstore remote release {box}`)")
    click.echo(f"reachable      {'yes' if data['reachable'] else 'no: ' + data.get('error', '')}")
    click.echo(f"read-through   {shown_totals(data['read_through'])}")
    if data["reachable"]:
        click.echo(f"objects        {data['objects']} ({human_size(data['bytes'])}), "
                   f"{counted(data['models'], 'model')}")  # fmt: skip
        click.echo(f"learned        {counted(data['records'], 'record')} "
                   f"({human_size(data['records_bytes'])})")  # fmt: skip
        for v in data["other_format_versions"]:
            click.echo(f"warning: objects of another format version ({v}) are ignored", err=True)
    q = data["queue"]
    click.echo(
        f"queue          {q['queued']} waiting, {q['uploaded']} known uploaded; learned "
        f"records {q['records_queued']} waiting, {q['records_uploaded']} known uploaded"
    )
    for k, v in data["settings"].items():
        click.echo(f"  {k:22} {v}")


@remote_group.command(name="ls")
@click.option("--json", "as_json", is_flag=True)
@click.option("--model", default=None, help="A model path of the manifest, or a fingerprint.")
@manifest_option
@home_option
@user_errors
def ls_cmd(as_json: bool, model: str | None, manifest: Path | None, home: Path) -> None:
    """Objects on the remote, with the local label when this box holds the entry too."""
    remote = _remote(home)
    fps = _model_fingerprints(home, model, manifest) if model else [b""]
    objs = [o for fp in fps for o in remote.objects(fp)]
    local = {}
    if (home / "store" / "data.mdb").is_file():
        with open_store(home) as store:
            local = {m.key: m for m in store.metas(errors=[])}
    rows = [
        {"key": o.key.hex(), "fingerprint": fingerprint_of(o.key).hex(), "object": o.name,
         "nbytes": o.size, "modified": o.modified, "local": o.key in local,
         "label": local[o.key].label if o.key in local else None,
         "uploader": remote.uploader(o.name)}  # as its S3 metadata says (the MAC covers the copy
        for o in objs                          # in the object, checked when it is fetched)
    ]  # fmt: skip
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    click.echo(f"{'KEY':14} {'FINGERPRINT':14} {'SIZE':>10} {'MODIFIED':19}  {'UPLOADER':16} LOCAL")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["modified"]))
        click.echo(f"{short_hex(r['key']):14} {r['fingerprint'][:12]:14} "
                   f"{human_size(r['nbytes']):>10} {when:19}  {r['uploader'] or '-':16} "
                   f"{r['label'] or '-'}")  # fmt: skip
    click.echo(f"{counted(len(rows), 'object')}, {human_size(sum(r['nbytes'] for r in rows))}")


@remote_group.command(name="push")
@click.option(
    "--model",
    default=None,
    help="Only entries of this model: a path (relative: from here), a hub id.",
)
@click.option(
    "--reseal",
    is_flag=True,
    help="After a key rotation: re-upload this box's objects still sealed under "
    "fleet_key_previous, under the current fleet_key.",
)
@home_option
@user_errors
def push_cmd(model: str | None, reseal: bool, home: Path) -> None:
    """Upload every local entry and learned block record the remote lacks; returns once all are
    up (or one failed). With --reseal, re-seal this box's own objects under the new key instead
    (each box runs it; then the fleet_key_previous line can go)."""
    from kvstore.fleet.learned import push_records
    from kvstore.fleet.queue import UploadQueue, upload_one
    from kvstore.identity.model import entry_model_name, model_name

    remote = _remote(home)
    if not (home / "store" / "data.mdb").is_file():
        click.echo("no store: nothing to push")
        return
    if reseal:
        from kvstore.fleet.queue import reseal as reseal_objects

        with open_store(home) as store:
            try:
                n = reseal_objects(remote, store, say=lambda t: click.echo(t, err=True))
            except RemoteError as e:
                raise click.ClickException(f"{e} (run it again)") from None
        click.echo(f"{n['resealed']} re-sealed under the current key, {n['current']} already "
                   f"under it, {n['other']} other boxes', {n['gone']} not held here, "
                   f"{n['refused']} refused")  # fmt: skip
        return
    counts = {"uploaded": 0, "exists": 0, "gone": 0}
    name = None if model is None else model_name(model)  # as `ls --model` reads it
    with open_store(home) as store:
        queue = UploadQueue(home)
        try:
            keys = [
                m.key
                for m in store.metas(errors=[])
                if name is None or entry_model_name(m.model, m.model_dir) == name
            ]
            queue.forget(keys)  # re-checked against the remote, not trusted from memory
            queue.add(keys)
            for key in keys:
                counts[upload_one(remote, store, queue, key)] += 1
        except RemoteError as e:
            raise click.ClickException(f"{e} (the rest stays queued for the daemon)") from None
        finally:
            queue.close()
        try:
            learned = push_records(remote, store, model=name, say=lambda t: click.echo(t, err=True))
        except RemoteError as e:
            raise click.ClickException(f"{e} (learned records: push again)") from None
    gone = f", {counts['gone']} gone or corrupt locally" if counts["gone"] else ""
    click.echo(f"{counts['uploaded']} uploaded, {counts['exists']} already there{gone}")
    if any(learned.values()):
        gone = f", {learned['gone']} gone or corrupt locally" if learned["gone"] else ""
        click.echo(f"learned records: {learned['uploaded']} uploaded, {learned['exists']} "
                   f"already there{gone}")  # fmt: skip


@remote_group.command(name="pull")
@click.option("--model", default=None, help="Only this model of the manifest.")
@manifest_option
@home_option
@user_errors
def pull_cmd(model: str | None, manifest: Path | None, home: Path) -> None:
    """Fetch every entry and learned block record of the manifest's models that this box lacks
    (pins and the rest), verified in full before it is stored. Nothing is prefilled."""
    from kvstore.fleet.fetch import WarmFetcher
    from kvstore.fleet.learned import pull_records
    from kvstore.fleet.queue import UploadQueue
    from kvstore.home.settings import MANIFEST_NAME

    remote = _remote(home)
    if not remote.settings.fleet_keys and not remote.settings.allow_unsigned:
        from kvstore.fleet.fetch import UNSIGNED_REFUSED

        raise click.ClickException(UNSIGNED_REFUSED)
    manifest = (manifest or home / MANIFEST_NAME).resolve()
    from kvstore.wire.daemon_client import connect_writer

    client = connect_writer(home)
    queue = UploadQueue(home)
    fetched = failed = absent = learned = 0
    try:
        with open_store(home, write=client is None) as store:
            put, put_records, checked = _writers(client, store, home)
            fetcher = WarmFetcher(remote, queue, always=True)
            for plan in _plans(home, manifest, model, store):
                have = set(store.keys())
                check = _Checked(plan, queue, remote.settings.box_id, checked)
                got, no, bad = _pull_pins(plan, manifest, fetcher, put, have, check)
                fetched, absent, failed = fetched + got, absent + no, failed + bad
                got, bad = _pull_objects(plan, remote, queue, put, have, check)
                fetched, failed = fetched + got, failed + bad
                if said := check.said():
                    click.echo(said)
                got, bad = pull_records(
                    remote, store, plan.fingerprint.digest, model=plan.spec.path,
                    extra=plan.spec.identity.state, put=put_records, say=click.echo,
                    refused=queue.refused, quarantined=queue.quarantined,
                    check=check.refused_record,
                )  # fmt: skip
                if said := check.said(records=True):
                    click.echo(said)
                check.check.close()
                learned += got
                failed += bad
    finally:
        queue.close()
        if client is not None:
            client.close()
    more = f" and {counted(learned, 'learned record')}" if learned else ""
    click.echo(f"{fetched} fetched{more}, {absent} not on the remote, {failed} failed")
    if failed:
        raise click.ClickException(f"{failed} entr(ies) could not be fetched (see above)")


@remote_group.group(name="key")
def key_group() -> None:
    """The fleet key: every object this box uploads carries an HMAC-SHA256 under it, and every
    object it pulls must carry one under it (or under fleet_key_previous during a rotation)."""


@key_group.command(name="new")
@home_option
@user_errors
def key_new_cmd(home: Path) -> None:
    """Make a fleet key in the [remote] credentials file (0600); a key already there becomes
    fleet_key_previous (a rotation: its objects stay accepted until that line is removed).
    Then copy the two lines it prints into the credentials file of every other box."""
    import secrets

    from kvstore.fleet.remote_settings import FLEET_KEY_BYTES, credentials_path, read_credentials

    rs = _settings(home)
    if not rs.credentials:
        raise click.ClickException(
            f"{home / 'settings.toml'}: [remote] names no credentials file to keep the key in"
        )
    path = credentials_path(rs.credentials, home / "settings.toml")
    old = read_credentials(path)
    lines = [ln for ln in path.read_text().splitlines()
             if not ln.strip().startswith(("fleet_key", "fleet_key_previous"))]  # fmt: skip
    new = secrets.token_hex(FLEET_KEY_BYTES)
    keep = [f'fleet_key = "{new}"']
    if old.fleet_keys:
        keep.append(f'fleet_key_previous = "{old.fleet_keys[0].hex()}"')
    tmp = path.with_name(path.name + ".tmp")
    tmp.touch(mode=0o600)
    tmp.chmod(0o600)
    tmp.write_text("\n".join([*lines, *keep]) + "\n")
    tmp.replace(path)
    click.echo(f"fleet key written to {path}" + (" (the old one kept as fleet_key_previous)"
                                                if old.fleet_keys else ""))  # fmt: skip
    click.echo("copy these lines into the credentials file of every other box of the fleet:")
    for line in keep:
        click.echo(f"  {line}")


@remote_group.command(name="release")
@click.argument("box")
@home_option
@user_errors
def release_cmd(box: str, home: Path) -> None:
    """Use a quarantined uploader's objects again (after a look at why: `remote status`)."""
    from kvstore.fleet.queue import UploadQueue

    with UploadQueue(home) as queue:
        if not queue.release(box):
            raise click.ClickException(f"{box} is not quarantined (see `kvstore remote status`)")
    click.echo(f"released {box}: its objects are used again")


@remote_group.command(name="gc")
@click.option("--older-than", default=None, help="Delete objects created longer ago (30d, 12h).")
@click.option("--model", default=None, help="Delete this model's objects (path or fingerprint).")
@manifest_option
@click.option(
    "--quarantined",
    is_flag=True,
    help="Delete the objects of quarantined uploaders, and release them.",
)
@click.option("--dry-run", is_flag=True, help="Say what would go; delete nothing.")
@home_option
@user_errors
def gc_cmd(older_than, model, manifest, quarantined: bool, dry_run: bool, home: Path) -> None:
    """The janitor, the only thing that deletes from the remote: objects (entries and learned
    records) older than a duration, a retired model's objects, then the oldest until the bucket
    is within its [remote] max_bytes; and multipart uploads a crash left behind.

    \b
    kvstore remote gc --older-than 30d
    kvstore remote gc --model 0f3a...   # a retired model's fingerprint
    kvstore remote gc --quarantined     # what a box that failed the semantic check uploaded
    """
    from kvstore.fleet.queue import UploadQueue
    from kvstore.fleet.sightings import expire_markers

    remote = _remote(home)
    age = parse_duration(older_than) if older_than else None
    fps = set(_model_fingerprints(home, model, manifest)) if model else set()
    objs = sorted([*remote.objects(), *remote.records()], key=lambda o: o.modified)
    now = time.time()
    bad: set[str] = set()
    if quarantined:
        with UploadQueue(home) as queue:
            bad = set(queue.quarantined())
    victims = [o for o in objs if (age is not None and now - o.modified > age)
               or fingerprint_of(o.key) in fps
               or (bad and remote.uploader(o.name) in bad)]  # fmt: skip
    gone = {o.name for o in victims}
    kept = sum(o.size for o in objs if o.name not in gone)
    for o in objs:  # oldest first, until within the byte budget
        if kept <= remote.settings.max_bytes:
            break
        if o.name not in gone:
            victims.append(o)
            gone.add(o.name)
            kept -= o.size
    for o in victims:
        click.echo(f"{'would delete' if dry_run else 'deleted'} {o.name} ({human_size(o.size)})")
    if markers := expire_markers(remote, dry_run=dry_run):  # a day old: they no longer count
        click.echo(f"{'would delete' if dry_run else 'deleted'} {counted(markers, 'seen-marker')}")
    if dry_run:
        return
    n = remote.delete([o.name for o in victims])
    aborted = remote.abort_stale_uploads(STALE_UPLOAD_SECONDS)
    with UploadQueue(home) as queue:
        queue.forget([o.key for o in victims])
        for box in bad:
            queue.release(box)
    aborted_text = f", {counted(aborted, 'stale multipart upload')} aborted" if aborted else ""
    click.echo(f"{counted(n, 'object')} deleted, {human_size(kept)} kept{aborted_text}")


def _writers(client, store, home: Path):
    """`put(key, blob, fields)`, `put_records(fp, tokens, rows, label, extra)` and
    `checked(verdicts)` (kvstore.fleet.check): through the daemon when one runs (it is the
    writer), else the same operations on the store here (a blob from another box: its KV is
    decoded and checked, as the daemon checks it)."""
    from kvstore.ops import put as put_ops
    from kvstore.ops.budget import Budget
    from kvstore.wire.messages import PutBlocksRequest, Record

    budget = Budget.of(store, home) if client is None else None

    def put(key, blob, fields):
        if budget is None:
            put_ops.send(client, key, blob, fields)
        else:
            put_ops.put(
                store,
                key,
                blob,
                put_ops.located(fields),
                budget=budget,
                sent=put_ops.request(key, blob, fields),
            )

    def put_records(fp, tokens, rows, label, extra):
        req = PutBlocksRequest(
            fingerprint=fp, tokens=tokens, records=[Record(s, e, b) for s, e, b in rows],
            label=label, model=extra["model"], extra=extra,
        )  # fmt: skip
        if budget is None:
            client.send(req)
        else:
            put_ops.put_blocks(budget.blocks, req, budget=budget)

    def checked(verdicts):
        from kvstore.fleet.check import request_of
        from kvstore.ops.fleet import fleet_checked

        req = request_of(verdicts)
        if client is not None:
            client.send(req)
        else:
            fleet_checked(store, home, req)

    return put, put_records, checked


class _Checked:
    """`remote pull`'s semantic check (kvstore.fleet.check) of what another box computed, before
    it is stored: a mismatch quarantines its uploader, and then every object of that box is
    refused here (and by the warm's read-through) until `kvstore remote release`."""

    def __init__(self, plan, queue, me: str, record):
        from kvstore.fleet.check import SemanticCheck

        self.check, self.queue, self.me = SemanticCheck(plan), queue, me
        self.record = record  # the verdict of a mismatch: kvstore.ops.fleet.fleet_checked
        self.count, self.seconds = 0, 0.0
        self.records, self.records_seconds = 0, 0.0

    def said(self, *, records: bool = False) -> str | None:
        n, seconds = (self.records, self.records_seconds) if records else (self.count, self.seconds)
        if not n:
            return None
        what = counted(n, "learned record") if records else counted(n, "object")
        load = "" if records else f", model loaded in {self.check.load_seconds:.2f}s"
        return f"checked {what} against this box's model: {seconds:.2f}s{load}"

    @staticmethod
    def mark(fields: PutFields) -> PutFields:
        """The put fields of a checked object: never checked again (kvstore.fleet.check)."""
        from kvstore.store.entry import CHECK_PASSED, FLEET_CHECK

        return replace(fields, extra=fields.extra.updated({FLEET_CHECK: CHECK_PASSED}))

    def refused_record(
        self, key: bytes, label: str, token_ids: list[int], blob, uploader: str | None
    ) -> bool:
        """A learned record: refused (and its uploader quarantined) as `refused`."""
        return self.refused(key, label, token_ids, blob, uploader, record=True)

    def refused(
        self,
        key: bytes,
        label: str,
        token_ids: list[int],
        blob,
        uploader: str | None,
        *,
        record: bool = False,
    ) -> bool:
        if uploader == self.me:
            return False  # this box's own KV
        if uploader and (why := self.queue.quarantined().get(uploader)):
            click.echo(f"not fetched {label}: uploader {uploader} is quarantined ({why})", err=True)
            return True
        verdict = (self.check.record if record else self.check)(token_ids, blob)
        if record:
            self.records, self.records_seconds = (
                self.records + 1,
                self.records_seconds + verdict.seconds,
            )
        else:
            self.count, self.seconds = self.count + 1, self.seconds + verdict.seconds
        if verdict.ok:
            return False
        from kvstore.fleet.check import Checked

        # counted, its uploader quarantined, and that box's entries still pending here deleted
        self.record([Checked(key, False, verdict.what, uploader, label)])
        said = f"refused {label}: its KV is not what this box's model computes ({verdict.what})"
        if not uploader:  # an older kvstore's object: no box to quarantine
            click.echo(said, err=True)
            return True
        click.echo(f"{said}; every object of {uploader} is quarantined "
                   f"(`kvstore remote release {uploader}` after a look)", err=True)  # fmt: skip
        return True


def _pull_pins(plan, manifest: Path, fetcher, put, have: set, check) -> tuple[int, int, int]:
    """The manifest's pins of this plan that this box lacks: (fetched, absent, failed)."""
    from kvstore.warm.warm import pin_fields

    fetched = absent = failed = 0
    for pp in plan.pins:
        if pp.key in have:
            continue
        blob, classes, note, uploader = fetcher(plan, pp)
        if blob is None:
            have.add(pp.key)  # tried: the model's other objects skip it (one refusal, not two)
            click.echo(f"not fetched {pp.pin.name}: {note}", err=True)
            absent += note == "not on the remote"
            failed += note != "not on the remote"
            continue
        if check.refused(pp.key, pp.pin.name, list(pp.pin.tokens), blob, uploader):
            have.add(pp.key)
            failed += 1
            continue
        fields = pin_fields(plan, pp, classes=classes, manifest=manifest)
        fields = replace(fields, extra=fields.extra.updated(origin="remote", uploader=uploader))
        put(pp.key, blob, check.mark(fields))
        have.add(pp.key)
        fetched += 1
        click.echo(f"fetched  {pp.pin.name:20} {human_size(len(blob))}")
    return fetched, absent, failed


def _pull_objects(plan, remote, queue, put, have: set, check) -> tuple[int, int]:
    """The model's other objects on the remote (runtime pins, chains): (fetched, failed)."""
    from kvstore.fleet.fetch import REFUSALS, foreign_fields, other_runtime
    from kvstore.fleet.objects import verify_object

    fetched = failed = 0
    for o in remote.objects(plan.fingerprint.digest):
        if o.key in have:
            continue
        try:
            data, _ = remote.fetch(o.key)
            rs = remote.settings
            meta, blob, prov = verify_object(o.key, data, keys=rs.fleet_keys,
                                             unsigned=rs.allow_unsigned)  # fmt: skip
        except RemoteError as e:
            if e.cause in REFUSALS:
                queue.refused(e)
            click.echo(f"warning: {e}; not stored", err=True)
            failed += 1
            continue
        if other := other_runtime(meta):
            click.echo(f"not fetched {meta.label}: {other}", err=True)
            failed += 1
            continue
        if check.refused(o.key, meta.label, meta.token_ids(), blob, prov.box):
            failed += 1
            continue
        put(o.key, blob, check.mark(foreign_fields(meta, plan, prov.box)))
        queue.done(o.key, "fetched")
        fetched += 1
        click.echo(f"fetched  {meta.label:20} {human_size(len(blob))}")
    return fetched, failed
