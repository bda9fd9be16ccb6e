"""Warm a manifest: render each pin, and prefill + encode + put the ones missing from the store.

The model is loaded only when some pin is missing, and released afterwards: a 9B model must not
stay resident in a long-lived process.
"""

from __future__ import annotations

import datetime as dt
import errno
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvstore.codec import codec
from kvstore.errors import (
    DISK_FULL_ERRNOS,
    CorruptEntryError,
    KVStoreError,
    ModelError,
    counted,
    os_errno,
)
from kvstore.identity.codehash import runtime_versions
from kvstore.identity.fingerprint import (
    FileHashCache,
    describe_cache,
    model_fingerprint,
    resolve_model_path,
    template_hash,
)
from kvstore.pins.clock import local_now
from kvstore.pins.manifest import Manifest, ModelSpec
from kvstore.pins.render import pin_extra, render_prefix
from kvstore.settings import FILEHASH_NAME
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.ownership import adopted, manifest_owner, owners, released, renamed
from kvstore.store.store import Store
from kvstore.warm.plan import ModelPlan, PlannedPin
from kvstore.warm.purge import Purged, moved_pins, stale_pins

log = logging.getLogger("kvstore")


@dataclass
class PinResult:
    model: str
    name: str
    key: str
    tokens: int
    # "present" | "warmed" (prefilled) | "fetched" (from the fleet tier) | "failed" | "deferred"
    # (not enough memory to load the model now: `error` says why; the daemon retries)
    status: str
    seconds: float = 0.0
    nbytes: int = 0
    warning: str | None = None
    error: str | None = None
    valid_date: str | None = None  # clock-bound pin: the local date it holds for
    multi_turn: bool | None = None  # also prefixes 2nd and later turns
    remote: str | None = None  # why the fleet tier was or was not used for this pin


@dataclass
class WarmReport:
    pins: list[PinResult] = field(default_factory=list)
    purged: list[Purged] = field(default_factory=list)
    released: list[Purged] = field(default_factory=list)  # kept for their other owners
    adopted: int = 0  # present pins this manifest became an owner of
    models_loaded: int = 0
    seconds: float = 0.0
    stopped: str | None = None  # why warming stopped early (a full disk): the rest is unwarmed

    @property
    def warmed(self) -> int:
        return sum(p.status == "warmed" for p in self.pins)

    @property
    def fetched(self) -> int:
        return sum(p.status == "fetched" for p in self.pins)

    @property
    def failed(self) -> list[PinResult]:
        return [p for p in self.pins if p.status == "failed"]

    @property
    def deferred(self) -> list[PinResult]:
        return [p for p in self.pins if p.status == "deferred"]


def plan_model(
    spec: ModelSpec, store: Store | None, *, home: Path, now: dt.datetime | None = None
) -> ModelPlan:
    """Render every pin of one model (as requests on the day of `now` render it) and find which
    are missing. Loads the tokenizer only. A pin whose rendering fails fails alone."""
    from kvstore.identity.modelconfig import load_tokenizer

    model_dir = resolve_model_path(spec.path)
    fp = model_fingerprint(
        replace(spec.identity, path=str(model_dir)), hash_cache=FileHashCache(home / FILEHASH_NAME)
    )
    tokenizer = load_tokenizer(model_dir, spec.path)
    now = now or local_now()
    plan = ModelPlan(spec, model_dir, fp, template_hash(model_dir), day=now.date())
    for prefix in spec.prefixes:
        try:
            pin = render_prefix(tokenizer, prefix, now=now)
        except KVStoreError as e:
            plan.failed.append((prefix.name, f"model {spec.path!r}: {e}"))
            continue
        key = entry_key(fp.digest, pin.tokens)
        present = False
        if store is not None:
            try:
                meta = store.get_meta(key)
            except CorruptEntryError:
                meta = None  # re-warmed: the put replaces it
            # a present pin whose blob went bad is warmed again, not skipped by every hydrate
            present = (
                meta is not None and meta.tokens == pack_tokens(pin.tokens) and store.blob_ok(meta)
            )
        plan.pins.append(PlannedPin(spec, pin, key, present, prefix))
    return plan


def load_model(plan: ModelPlan):
    """Load the model for prefill (with the manifest's overrides) and check it is the one the
    fingerprint describes: same files (none changed while loading), same cache layout."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    identity = plan.spec.identity
    try:
        model, _ = load(
            str(plan.model_dir),
            adapter_path=identity.adapter,
            model_config=dict(identity.model_config or {}),
        )
    except Exception as e:
        raise ModelError(f"model {plan.spec.path!r}: cannot load: {e}") from None
    try:
        plan.fingerprint.check_unchanged(f"the daemon loaded model {plan.spec.path!r}")
    except ModelError as e:
        log.error("%s", e)
        raise
    layout = tuple(describe_cache(c) for c in make_prompt_cache(model))
    if layout != plan.fingerprint.layout:
        raise ModelError(f"model {plan.spec.path!r}: cache layout differs from its config's")
    return model


def release_model() -> None:
    gc.collect()
    import mlx.core as mx

    mx.clear_cache()


def prefill_pin(model, plan: ModelPlan, tokens) -> list:
    """The KV of `tokens` as this plan's model runs it (its KV quantization included)."""
    from kvstore.warm.prefill import prefill

    return prefill(model, tokens, identity=plan.spec.identity)


def encode_pin(
    model, plan: ModelPlan, pp: PlannedPin, *, manifest: Path | None = None
) -> tuple[bytes, dict]:
    """Prefill one pin and encode it; returns the blob and the meta fields for Store.put."""
    cache = prefill_pin(model, plan, pp.pin.tokens)
    blob = codec.encode(cache, {"model": plan.spec.path, "tokenizer_config": "{}"})
    return blob, pin_fields(plan, pp, classes=codec.cache_classes(cache), manifest=manifest)


def pin_fields(
    plan: ModelPlan, pp: PlannedPin, *, classes: list[str], manifest: Path | None = None
) -> dict:
    """The meta fields Store.put takes for a manifest pin (prefilled here or fetched)."""
    return dict(
        tokens=pack_tokens(pp.pin.tokens),
        label=pp.pin.name,
        pinned=True,
        model=plan.spec.path,
        template_hash=plan.template_hash,
        classes=classes,
        extra={
            **plan.spec.identity.state,
            "source": "manifest",
            "manifest": str(manifest) if manifest else None,
            "owners": [manifest_owner(manifest)] if manifest else [],
            "runtime": runtime_versions(),
            **_pin_extra(pp),
        },
    )


def _pin_extra(pp: PlannedPin) -> dict:
    if pp.prefix is None:
        return pin_extra(pp.pin, None, chat=False)
    chat = pp.prefix.messages is not None
    return pin_extra(pp.pin, pp.prefix.chat_template_kwargs, chat=chat)


def _result(pp: PlannedPin, status: str, **kw) -> PinResult:
    return PinResult(
        pp.model.path,
        pp.pin.name,
        pp.key.hex(),
        len(pp.pin.tokens),
        status,
        valid_date=pp.pin.valid_date,
        multi_turn=pp.pin.multi_turn,
        **kw,
    )


def _fail(report: WarmReport, pp: PlannedPin, msg: str) -> None:
    report.pins.append(_result(pp, "failed", error=msg))
    log.error("%s", msg)


def _stop(report: WarmReport, pp: PlannedPin, msg: str, e: KVStoreError) -> bool:
    """Record a failed store of `pp`; True when the disk is full (ENOSPC, EDQUOT) or failing
    (EIO: LMDB reports a short write on a full disk so), which stops the warm: every later pin
    would be prefilled (minutes for a long one) and then fail the same way. LMDB's map being
    full is not this: Store grows the map, up to max_map_size."""
    _fail(report, pp, msg)
    code = os_errno(e)
    if code not in DISK_FULL_ERRNOS and code != errno.EIO:
        return False
    what = "the disk is full" if code in DISK_FULL_ERRNOS else "the store's disk is full or failing"
    report.stopped = f"{what}, so warming stopped at pin {pp.pin.name!r}: {e}"
    log.error("%s", report.stopped)
    return True


def _unwarmed(report: WarmReport, pps: list[PlannedPin]) -> None:
    """The pins a stopped warm leaves unwarmed, as failures naming why."""
    for pp in pps:
        report.pins.append(_result(pp, "failed", error="not warmed: " + str(report.stopped)))


def _warm_model(
    plan: ModelPlan,
    manifest: Manifest,
    report: WarmReport,
    *,
    put: Callable[[bytes, bytes, dict], None],
    say: Callable[[str], None],
    fetch: Callable | None = None,
    may_load: Callable[[ModelPlan], str | None] | None = None,
) -> None:
    """Prefill and put one model's missing pins; the model is loaded once and released. `fetch`
    (the fleet tier, kvstore.fleet.fetch) is tried for each missing pin before the model loads;
    `may_load` gives why the model may not load now (its pins are then deferred), or None."""
    spec = plan.spec
    for name, error in plan.failed:
        report.pins.append(PinResult(spec.path, name, "", 0, "failed", error=error))
        log.error("%s", error)
    for pp in plan.pins:
        if pp.pin.warning:
            log.warning("%s", pp.pin.warning)
        if pp.present:
            report.pins.append(_result(pp, "present", warning=pp.pin.warning))
    missing = [pp for pp in plan.pins if not pp.present]
    if report.stopped:
        _unwarmed(report, missing)
        return
    notes: dict[bytes, str] = {}
    if fetch is not None:
        fetching, missing = missing, []
        for pp in fetching:
            if report.stopped:
                _unwarmed(report, [pp])
            elif not _fetched(plan, pp, report, put, fetch, notes, manifest.path):
                missing.append(pp)
    if not missing or report.stopped:
        _unwarmed(report, missing)
        return
    if may_load is not None and (why := may_load(plan)):
        report.pins.extend(_result(pp, "deferred", error=why) for pp in missing)
        return
    say(f"loading {spec.path} to warm {counted(len(missing), 'pin')}")
    try:
        model = load_model(plan)
    except KVStoreError as e:
        for pp in missing:
            _fail(report, pp, str(e))
        return
    report.models_loaded += 1
    try:
        for i, pp in enumerate(missing, 1):
            t = time.perf_counter()
            try:
                blob, fields = encode_pin(model, plan, pp, manifest=manifest.path)
            except (ValueError, RuntimeError) as e:  # mlx rejects e.g. a bad kv_group_size
                _fail(
                    report, pp, f"model {spec.path!r}: prefill of pin {pp.pin.name!r} failed: {e}"
                )
                continue
            try:
                put(pp.key, blob, fields)
            except KVStoreError as e:  # the map cap: say so, go on; a full disk: stop
                msg = f"model {spec.path!r}: storing pin {pp.pin.name!r} failed: {e}"
                if _stop(report, pp, msg, e):
                    _unwarmed(report, missing[i:])
                    return
                continue
            dt = time.perf_counter() - t
            report.pins.append(_result(pp, "warmed", seconds=dt, nbytes=len(blob),
                                       warning=pp.pin.warning,
                                       remote=notes.get(pp.key)))  # fmt: skip
            say(
                f"[{i}/{len(missing)}] {spec.path} :: {pp.pin.name}: "
                f"{len(pp.pin.tokens)} tokens, {len(blob) / 2**20:.1f} MiB in {dt:.2f}s"
            )
    finally:
        del model
        release_model()


def _adopt(store: Store, plans: dict[tuple, ModelPlan], me: str, edit: Callable) -> int:
    """Become an owner of the present pins another owner (an app) stored first."""
    keys = [pp.key for plan in plans.values() for pp in plan.pins if pp.present]
    todo = [k for k in keys if (m := store.get_meta(k)) is not None and me not in owners(m)]
    return edit({k: lambda m: adopted(m, me) for k in todo}) if todo else 0


def _fetched(plan, pp, report, put, fetch, notes, manifest: Path) -> bool:
    """Whether `fetch` brought this pin from the fleet tier (and it was stored). `fetch` gives
    the verified blob (or None: prefill), its cache classes, and why."""
    t = time.perf_counter()
    blob, classes, note = fetch(plan, pp)
    notes[pp.key] = note
    if blob is None:
        return False
    fields = pin_fields(plan, pp, classes=classes, manifest=manifest)
    fields["extra"]["origin"] = "remote"
    try:
        put(pp.key, blob, fields)
    except KVStoreError as e:
        _stop(report, pp, f"model {plan.spec.path!r}: storing fetched pin {pp.pin.name!r}: {e}", e)
        return True
    report.pins.append(_result(pp, "fetched", seconds=time.perf_counter() - t,
                               nbytes=len(blob), warning=pp.pin.warning, remote=note))  # fmt: skip
    return True


def warm(
    manifest: Manifest,
    store: Store,
    *,
    home: Path,
    progress: Callable[[str], None] | None = None,
    put: Callable[[bytes, bytes, dict], None] | None = None,
    delete: Callable[[list[bytes]], None] | None = None,
    edit: Callable[[dict], int] | None = None,
    purge: bool = True,
    now: dt.datetime | None = None,
    fetch: Callable | None = None,
    may_load: Callable[[ModelPlan], str | None] | None = None,
) -> WarmReport:
    """Make the store hold exactly the manifest's current pins: purge stale ones (when `purge`),
    own the present ones, then fetch (with `fetch`, the fleet tier) or prefill the missing.
    `put`, `delete` and `edit` (Store.edit_meta) override where writes go (e.g. the daemon).
    Pins render as requests on the local day of `now` do (default: the real clock). `may_load`
    (the daemon's memory check) may defer a model's load: its missing pins are reported
    "deferred"."""
    t0 = time.perf_counter()
    report = WarmReport()
    say = progress or (lambda msg: None)
    put = put or (lambda key, blob, fields: store.put(key, blob, **fields))
    delete = delete or store.delete
    edit = edit or store.edit_meta
    plans: dict[tuple, ModelPlan] = {}
    for spec in manifest.models:
        try:
            plans[spec.identity.same_model()] = plan_model(spec, store, home=home, now=now)
        except KVStoreError as e:
            for prefix in spec.prefixes:
                report.pins.append(PinResult(spec.path, prefix.name, "", 0, "failed", error=str(e)))
            log.error("%s", e)
    me = manifest_owner(manifest.path)
    if purge:
        moved = moved_pins(manifest, store, plans)
        if moved:  # same KV, new model name: re-owned, not purged and prefilled again
            edit({k: lambda m, spec=spec: renamed(m, spec) for k, spec in moved.items()})
            for k, spec in moved.items():
                log.info("kept %s under the model's new name %s: same fingerprint and tokens",
                         k.hex()[32:44], spec.path)  # fmt: skip
        stale = stale_pins(manifest, store, plans)
        report.purged = [p for p in stale if not p.released]
        report.released = [p for p in stale if p.released]
        if report.released:
            edit({bytes.fromhex(p.key): lambda m: released(m, me) for p in report.released})
        for p in report.released:
            log.info("released pin %r of %s (its other owners keep it): %s", p.label, p.model,
                     p.cause)  # fmt: skip
        if report.purged:
            delete([bytes.fromhex(p.key) for p in report.purged])
            gone = {p.key for p in report.purged}
            for plan in plans.values():
                for pp in plan.pins:
                    pp.present = pp.present and pp.key.hex() not in gone
        for p in report.purged:
            log.info("purged %s pin %r of %s: %s", p.shown_key, p.label, p.model, p.cause)
            say(f"purged pin {p.label!r} of {p.model}: {p.cause}")
    report.adopted = _adopt(store, plans, me, edit)
    for plan in plans.values():
        _warm_model(plan, manifest, report, put=put, say=say, fetch=fetch, may_load=may_load)
    report.seconds = time.perf_counter() - t0
    return report
