"""Warm a manifest: render each pin, and prefill + encode + put the ones missing from the store.

The model is loaded only when some pin is missing, and released afterwards: a 9B model must not
stay resident in a long-lived process.
"""

from __future__ import annotations

import datetime as dt
import errno
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvstore.codec import codec
from kvstore.errors import (
    DISK_FULL_ERRNOS,
    CorruptEntryError,
    KVStoreError,
    StoreDamaged,
    counted,
    os_errno,
)
from kvstore.home.settings import DEFAULT, FILEHASH_NAME, Settings, load_settings
from kvstore.identity.codehash import runtime_versions
from kvstore.identity.fingerprint import (
    FileHashCache,
    model_fingerprint,
    resolve_model,
)
from kvstore.kvcheck.prefill import load_model, release_model
from kvstore.pins.clock import local_now
from kvstore.pins.manifest import Manifest, ModelSpec
from kvstore.pins.ownership import adopted, manifest_owner, owners, released, renamed
from kvstore.pins.plan import ModelPlan, PlannedPin
from kvstore.pins.render import pin_extra, render_prefix
from kvstore.store.entry import (
    CHECK_PENDING,
    FLEET_CHECK,
    PutFields,
    entry_fields,
    entry_key,
    pack_tokens,
)
from kvstore.store.keys import short_hex
from kvstore.store.store import Store
from kvstore.warm import memory
from kvstore.warm.purge import moved_pins, stale_pins
from kvstore.wire.messages import PinResult, PinStatus, WarmReport

log = logging.getLogger("kvstore")


STORED = (PinStatus.PRESENT, PinStatus.WARMED, PinStatus.FETCHED)  # the pin is in the store


def plan_model(
    spec: ModelSpec,
    store: Store | None,
    *,
    home: Path,
    now: dt.datetime | None = None,
    max_tokens: int | None = None,
) -> ModelPlan:
    """Render every pin of one model (as requests on the day of `now` render it) and find which
    are missing. Loads the tokenizer only. A pin whose rendering fails fails alone, as one whose
    content is too big for `max_tokens` does, unrendered. The model's directory, config and
    template hash are read here, once, onto the plan's `model`."""
    from kvstore.identity.modelconfig import load_tokenizer

    located = resolve_model(spec.identity)
    fp = model_fingerprint(located, hash_cache=FileHashCache(home / FILEHASH_NAME))
    tokenizer = load_tokenizer(located.directory, spec.path)
    now = now or local_now()
    plan = ModelPlan(spec, located, fp, day=now.date())
    _ = located.template_hash  # read now, as the pins it describes are rendered
    plan.context = model_context(located.config, tokenizer)
    for prefix in spec.prefixes:
        try:
            pin = render_prefix(tokenizer, prefix, now=now, max_tokens=max_tokens)
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


# A tokenizer's model_max_length above this is transformers' "not set" (int(1e30)), not a limit.
SANE_MODEL_MAX_LENGTH = 2**24


def model_context(config: dict, tokenizer) -> tuple[int, str] | None:
    """The longest prefix the model takes and where that is said: `max_position_embeddings` of
    its effective config (or its text_config), or the tokenizer's `model_max_length` where that
    is set and sane, whichever is smaller; None when neither says."""
    found = []
    for c, where in ((config, ""), (config.get("text_config"), "text_config.")):
        n = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            found.append(
                (n, f"the model's context ({where}max_position_embeddings in config.json)")
            )
            break
    n = getattr(tokenizer, "model_max_length", None)
    if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= SANE_MODEL_MAX_LENGTH:
        found.append((n, "the tokenizer's model_max_length (tokenizer_config.json)"))
    return min(found) if found else None


@dataclass(frozen=True)
class PrefillBounds:
    """What bounds each pin's prefill in one warm: its length (`max_pin_tokens`, and the model's
    context), the memory available for it (`available_memory`, read before each prefill), and
    how often a long prefill says how far it is (`progress_every`, seconds)."""

    max_pin_tokens: int = DEFAULT.max_pin_tokens
    available_memory: Callable[[], int | None] | None = None  # None: kvstore.warm.memory's reader
    progress_every: float = 2.0  # a terminal; the daemon's log takes one every 10 s

    def available(self) -> int | None:
        return (self.available_memory or memory.available_memory_bytes)()


def progress_clock() -> float:
    """The clock a long prefill's progress lines are timed by (tests move it)."""
    return time.monotonic()


class PrefillProgress:
    """A long prefill's progress as lines for `say`: tokens done of the total and the rate since
    the last line (attention makes later chunks slower, so an average would flatter it), every
    `every` seconds once it has run that long (a short pin says nothing); PrefillBounds sets
    `every`. Called after each chunk (kvstore.kvcheck.prefill.prefill's on_chunk)."""

    def __init__(self, say: Callable[[str], None], name: str, every: float):
        self.say, self.name, self.every = say, name, every
        self.last = progress_clock()
        self.last_done = 0

    def __call__(self, done: int, total: int) -> None:
        now = progress_clock()
        if done >= total or now - self.last < self.every:
            return
        rate = (done - self.last_done) / (now - self.last)
        self.last, self.last_done = now, done
        self.say(
            f"pin {self.name}: {done:,} of {total:,} tokens ({100 * done / total:.0f}%), "
            f"{rate:,.0f} tokens/s"
        )


def over_limit(
    model: str, name: str, ntokens: int, max_pin_tokens: int, context: tuple[int, str] | None
) -> str | None:
    """Why pin `name` of `model`, `ntokens` long, is too long to prefill (one line naming it, its
    length and the limit), or None: the max_pin_tokens setting, and the model's `context`
    (`model_context`), bound it. The one length check of every way a pin is made: a warm, the
    daemon's, and `PersistentPromptCache.pin`."""
    limits = [(max_pin_tokens, "max_pin_tokens (settings.toml)")]
    if context is not None:
        limits.append(context)
    limit, what = min(limits)
    if ntokens <= limit:
        return None
    fix = (
        "raise max_pin_tokens in settings.toml"
        if "max_pin_tokens" in what
        else "use a model with a longer context"
    )
    return (
        f"model {model!r}: pin {name!r} is {ntokens:,} tokens, over {what} of "
        f"{limit:,} tokens; not prefilled: shorten the pin or {fix}"
    )


def max_pin_tokens(settings: Settings) -> int:
    """The max_pin_tokens setting, checked: a positive integer."""
    n = settings.max_pin_tokens
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise KVStoreError(f"settings.toml: max_pin_tokens must be a positive integer, got {n!r}")
    return n


def prefill_pin(model, plan: ModelPlan, tokens, *, on_chunk=None) -> list:
    """The KV of `tokens` as this plan's model runs it (its KV quantization included)."""
    from kvstore.kvcheck.prefill import prefill

    return prefill(model, tokens, identity=plan.spec.identity, on_chunk=on_chunk)


def encode_pin(
    model, plan: ModelPlan, pp: PlannedPin, *, manifest: Path | None = None, on_chunk=None
) -> tuple[bytes, PutFields]:
    """Prefill one pin and encode it; returns the blob and its put fields."""
    cache = prefill_pin(model, plan, pp.pin.tokens, on_chunk=on_chunk)
    blob = codec.encode(cache, {"model": plan.spec.path, "tokenizer_config": "{}"})
    return blob, pin_fields(plan, pp, classes=codec.cache_classes(cache), manifest=manifest)


def pin_fields(
    plan: ModelPlan, pp: PlannedPin, *, classes: list[str], manifest: Path | None = None
) -> PutFields:
    """The put fields of a manifest pin (prefilled here or fetched). Where the
    model resolved comes from the plan (the put does not resolve it again), first in `extra` as
    kvstore.identity.fingerprint.with_model_location puts it."""
    return entry_fields(
        pp.pin.tokens,
        label=pp.pin.name,
        pinned=True,
        model=plan.spec.path,
        template_hash=plan.template_hash,
        classes=classes,
        state={**plan.model.location, **plan.spec.identity.state},
        source="manifest",
        manifest=str(manifest) if manifest else None,
        owners=[manifest_owner(manifest)] if manifest else [],
        runtime=runtime_versions(),
        fingerprint_parts=plan.fingerprint.parts,  # what a later `model_changed` names
        extra=_pin_extra(pp),
    )


def _pin_extra(pp: PlannedPin) -> dict:
    if pp.prefix is None:
        return pin_extra(pp.pin, None, chat=False)
    chat = pp.prefix.messages is not None
    return pin_extra(pp.pin, pp.prefix.chat_template_kwargs, chat=chat)


def _result(pp: PlannedPin, status: PinStatus, **kw) -> PinResult:
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
    report.pins.append(_result(pp, PinStatus.FAILED, error=msg))
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
        report.pins.append(
            _result(pp, PinStatus.FAILED, error="not warmed: " + str(report.stopped))
        )


def _warm_model(
    plan: ModelPlan,
    manifest: Manifest,
    report: WarmReport,
    *,
    put: Callable[[bytes, bytes, PutFields], object],
    say: Callable[[str], None],
    fetch: Callable | None = None,
    may_load: Callable[[ModelPlan], str | None] | None = None,
    bounds: PrefillBounds = PrefillBounds(),
) -> None:
    """Prefill and put one model's missing pins; the model is loaded once and released. `fetch`
    (the fleet tier, kvstore.fleet.fetch) is tried for each missing pin before the model loads;
    `may_load` gives why the model may not load now (its pins are then deferred), or None.
    A pin longer than `bounds` allow fails before anything loads; one whose prefill needs more
    memory than is available fails before its prefill; the others warm."""
    spec = plan.spec
    missing = _missing_pins(plan, report, bounds)
    if report.stopped:
        _unwarmed(report, missing)
        return
    notes: dict[bytes, str] = {}
    fetched: list[tuple[PlannedPin, bytes, str | None]] = []  # stored, not yet checked
    if fetch is not None:
        fetching, missing = missing, []
        for pp in fetching:
            if report.stopped:
                _unwarmed(report, [pp])
            elif not _fetched(plan, pp, report, put, fetch, notes, manifest.path, fetched):
                missing.append(pp)
    if not missing or report.stopped:
        _unwarmed(report, missing)
        return
    if may_load is not None and (why := may_load(plan)):
        report.pins.extend(_result(pp, PinStatus.DEFERRED, error=why) for pp in missing)
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
        _prefill_pins(model, plan, manifest, missing, report, put=put, say=say, bounds=bounds,
                      notes=notes)  # fmt: skip
        # the model is loaded anyway: what this warm fetched is checked with it before it goes
        if fetched and (check := getattr(fetch, "check_loaded", None)) is not None:
            refused = {v.key for v in check(model, plan, fetched) if not v.ok}
            if refused:  # refused and deleted: prefilled now, with the model still loaded
                report.pins = [
                    p
                    for p in report.pins
                    if not (p.status is PinStatus.FETCHED and bytes.fromhex(p.key) in refused)
                ]
                again = [pp for pp, _, _ in fetched if pp.key in refused]
                notes.update((pp.key, "fetched, refused by the semantic check") for pp in again)
                _prefill_pins(
                    model,
                    plan,
                    manifest,
                    again,
                    report,
                    put=put,
                    say=say,
                    bounds=bounds,
                    notes=notes,
                )
    finally:
        del model
        release_model()


def _missing_pins(plan: ModelPlan, report: WarmReport, bounds: PrefillBounds) -> list[PlannedPin]:
    """The pins of `plan` to fetch or prefill; the others (failed to render, present, over the
    length bounds) go into the report as they are."""
    for name, error in plan.failed:
        report.pins.append(PinResult(plan.spec.path, name, "", 0, PinStatus.FAILED, error=error))
        log.error("%s", error)
    missing = []
    for pp in plan.pins:
        if pp.pin.warning:
            log.warning("%s", pp.pin.warning)
        if pp.present:
            report.pins.append(_result(pp, PinStatus.PRESENT, warning=pp.pin.warning))
        elif why := over_limit(
            plan.spec.path, pp.pin.name, len(pp.pin.tokens), bounds.max_pin_tokens, plan.context
        ):
            _fail(report, pp, why)  # before any fetch, load or prefill
        else:
            missing.append(pp)
    return missing


def _prefill_pins(
    model,
    plan: ModelPlan,
    manifest: Manifest,
    missing: list[PlannedPin],
    report: WarmReport,
    *,
    put: Callable[[bytes, bytes, PutFields], object],
    say: Callable[[str], None],
    bounds: PrefillBounds,
    notes: dict[bytes, str],
) -> None:
    """Prefill and put each missing pin with the loaded model, in order; a full disk stops the
    rest (reported unwarmed)."""
    spec = plan.spec
    for i, pp in enumerate(missing, 1):
        n = len(pp.pin.tokens)
        if why := _short_of_memory(model, plan, pp, bounds):
            _fail(report, pp, why)
            continue
        say(f"[{i}/{len(missing)}] {spec.path} :: {pp.pin.name}: prefilling {n:,} tokens")
        t = time.perf_counter()
        on_chunk = PrefillProgress(say, pp.pin.name, bounds.progress_every)
        try:
            blob, fields = encode_pin(model, plan, pp, manifest=manifest.path, on_chunk=on_chunk)
        except (ValueError, RuntimeError) as e:  # mlx rejects e.g. a bad kv_group_size
            _fail(report, pp, f"model {spec.path!r}: prefill of pin {pp.pin.name!r} failed: {e}")
            continue
        try:
            put(pp.key, blob, fields)
        except StoreDamaged:  # no pin can be stored: the warm ends with that one line
            raise
        except KVStoreError as e:  # the map cap: say so, go on; a full disk: stop
            msg = f"model {spec.path!r}: storing pin {pp.pin.name!r} failed: {e}"
            if _stop(report, pp, msg, e):
                _unwarmed(report, missing[i:])
                return
            continue
        dt = time.perf_counter() - t
        report.pins.append(_result(pp, PinStatus.WARMED, seconds=dt, nbytes=len(blob),
                                   warning=pp.pin.warning, remote=notes.get(pp.key)))  # fmt: skip
        say(
            f"[{i}/{len(missing)}] {spec.path} :: {pp.pin.name}: "
            f"{n:,} tokens, {len(blob) / 2**20:.1f} MiB in {dt:.2f}s"
        )


def _short_of_memory(model, plan: ModelPlan, pp: PlannedPin, bounds: PrefillBounds) -> str | None:
    """Why this pin's prefill does not fit the memory available now (its KV and one chunk's
    attention scratch, kvstore.kvcheck.prefill.prefill_memory), or None (it fits, or memory is
    unknown)."""
    avail = bounds.available()
    if avail is None:
        return None
    from kvstore.kvcheck.prefill import prefill_memory

    need = prefill_memory(model, len(pp.pin.tokens))
    if need.total <= avail:
        return None
    return (
        f"model {plan.spec.path!r}: pin {pp.pin.name!r} ({need.tokens:,} tokens) needs about "
        f"{_mib(need.total)} to prefill ({_mib(need.kv)} of KV and {_mib(need.scratch)} of "
        f"attention scratch for a {need.chunk:,}-token chunk), {_mib(avail)} is available; "
        "not prefilled: free memory or shorten the pin"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 // 10 else f"{n / 2**10:,.1f} KiB"


def _adopt(store: Store, plans: dict[tuple, ModelPlan], me: str, edit: Callable) -> int:
    """Become an owner of the present pins another owner (an app) stored first."""
    keys = [pp.key for plan in plans.values() for pp in plan.pins if pp.present]
    todo = [k for k in keys if (m := store.get_meta(k)) is not None and me not in owners(m)]
    return edit({k: lambda m: adopted(m, me) for k in todo}) if todo else 0


def _fetched(plan, pp, report, put, fetch, notes, manifest: Path, fetched: list) -> bool:
    """Whether `fetch` brought this pin from the fleet tier (and it was stored, marked pending its
    check against this model: kvstore.fleet.check; added to `fetched`). `fetch` gives the
    verified blob (or None: prefill), its cache classes, and why."""
    t = time.perf_counter()
    blob, classes, note, uploader = fetch(plan, pp)
    notes[pp.key] = note
    if blob is None:
        return False
    fields = pin_fields(plan, pp, classes=classes, manifest=manifest)
    extra = fields.extra.updated(origin="remote", uploader=uploader, **{FLEET_CHECK: CHECK_PENDING})
    fields = replace(fields, extra=extra)
    try:
        put(pp.key, blob, fields)
    except StoreDamaged:
        raise
    except KVStoreError as e:
        _stop(report, pp, f"model {plan.spec.path!r}: storing fetched pin {pp.pin.name!r}: {e}", e)
        return True
    fetched.append((pp, blob, uploader))
    report.pins.append(_result(pp, PinStatus.FETCHED, seconds=time.perf_counter() - t,
                               nbytes=len(blob), warning=pp.pin.warning, remote=note))  # fmt: skip
    return True


def warm(
    manifest: Manifest,
    store: Store,
    *,
    home: Path,
    put: Callable[[bytes, bytes, PutFields], object],
    progress: Callable[[str], None] | None = None,
    purge: Callable[[list[bytes]], object] | None = None,
    now: dt.datetime | None = None,
    fetch: Callable | None = None,
    may_load: Callable[[ModelPlan], str | None] | None = None,
    bounds: PrefillBounds | None = None,
) -> WarmReport:
    """Make the store hold exactly the manifest's current pins: purge stale ones (with `purge`,
    the one eviction, as kvstore.ops.warm passes it), own the present ones, then fetch (with
    `fetch`, the fleet tier) or prefill the missing. Each pin is stored by `put`: the put
    operation, as kvstore.ops.warm passes it.
    Pins render as requests on the local day of `now` do (default: the real clock). `may_load`
    (the daemon's memory check) may defer a model's load: its missing pins are reported
    "deferred". `bounds` (default: max_pin_tokens from the home's settings) bound each pin's
    prefill: too long or short of memory, a pin fails alone, before its prefill."""
    t0 = time.perf_counter()
    if bounds is None:
        bounds = PrefillBounds(max_pin_tokens=max_pin_tokens(load_settings(home)))
    report = WarmReport()
    say = progress or (lambda msg: None)
    edit = store.edit_meta
    plans: dict[tuple, ModelPlan] = {}
    for spec in manifest.models:
        try:
            plans[spec.identity.same_model()] = plan_model(
                spec, store, home=home, now=now, max_tokens=bounds.max_pin_tokens
            )
        except StoreDamaged:  # the store cannot say what is present: the warm ends here
            raise
        except KVStoreError as e:
            for prefix in spec.prefixes:
                report.pins.append(
                    PinResult(spec.path, prefix.name, "", 0, PinStatus.FAILED, error=str(e))
                )
            log.error("%s", e)
    me = manifest_owner(manifest.path)
    if purge is not None:
        moved = moved_pins(manifest, store, plans)
        if moved:  # same KV, new model name: re-owned, not purged and prefilled again
            edit({k: functools.partial(renamed, model=plans[spec.identity.same_model()].model)
                  for k, spec in moved.items()})  # fmt: skip
            for k, spec in moved.items():
                log.info("kept %s under the model's new name %s: same fingerprint and tokens",
                         short_hex(k), spec.path)  # fmt: skip
        stale = stale_pins(manifest, store, plans)
        report.purged = [p for p in stale if not p.released]
        report.released = [p for p in stale if p.released]
        if report.released:
            edit({bytes.fromhex(p.key): lambda m: released(m, me) for p in report.released})
        for p in report.released:
            log.info("released pin %r of %s (its other owners keep it): %s", p.label, p.model,
                     p.cause)  # fmt: skip
        if report.purged:
            purge([bytes.fromhex(p.key) for p in report.purged])
            gone = {p.key for p in report.purged}
            for plan in plans.values():
                for pp in plan.pins:
                    pp.present = pp.present and pp.key.hex() not in gone
        for p in report.purged:
            log.info("purged %s pin %r of %s: %s", short_hex(p.key), p.label, p.model, p.cause)
            say(f"purged pin {p.label!r} of {p.model}: {p.cause}")
    report.adopted = _adopt(store, plans, me, edit)
    for plan in plans.values():
        _warm_model(plan, manifest, report, put=put, say=say, fetch=fetch, may_load=may_load,
                    bounds=bounds)  # fmt: skip
    report.seconds = time.perf_counter() - t0
    return report
