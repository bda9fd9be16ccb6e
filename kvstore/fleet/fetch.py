"""Read-through when warming: fetch a missing pin from the fleet tier when that is expected to
beat prefilling it, verified in full before it is stored.

The cost rule: expected prefill = pin tokens / the model's measured prefill rate (the ledger's
per-call figures, else this box's own warm prefills); expected fetch = object bytes / measured
bandwidth to the remote. Fetch when the fetch is expected to be faster; with no measurement yet
fetch (and measure), since a box that never prefilled has nothing to compare against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import RemoteError
from kvstore.fleet.objects import Remote, verify_object
from kvstore.fleet.queue import UploadQueue
from kvstore.pins.ownership import APP, PINNED_BEFORE, owners
from kvstore.store.entry import PutFields, pack_tokens

if TYPE_CHECKING:
    from kvstore.fleet.check import Checked
    from kvstore.fleet.remote_settings import RemoteSettings
    from kvstore.home.ledger import Ledger
    from kvstore.pins.plan import ModelPlan, PlannedPin
    from kvstore.store.entry import EntryMeta

log = logging.getLogger("kvstore")

_OUTAGES = (
    "unreachable",
    "credentials",
    "bucket",
    "tls",
    "error",
)  # the remote is off for this warm


REFUSALS = ("corrupt", "unauthentic", "version")  # the object, not the remote, is at fault
UNAUTHENTICATED = (
    "no fleet_key in the credentials file: what this box pulls is unauthenticated (anyone who "
    "can write to the bucket can make it serve their KV); `kvstore remote key new` makes one"
)
UNSIGNED_REFUSED = (
    "no fleet_key in the credentials file: every object on the remote is refused, as this box "
    "cannot authenticate it (`kvstore remote key new` makes a key; `allow_unsigned = true` in "
    "the home's settings.toml takes objects unauthenticated)"
)


def unauthenticated(rs: RemoteSettings) -> str | None:
    """What a box without a fleet key should hear (once): that it takes objects unauthenticated
    (allow_unsigned) or refuses them all; None with a key."""
    if rs.fleet_keys:
        return None
    return UNAUTHENTICATED if rs.allow_unsigned else UNSIGNED_REFUSED


@dataclass
class Choice:
    fetch: bool
    reason: str


def choose(
    *, nbytes: int, tokens: int, prefill_tps: float | None, fetch_bps: float | None, deadline: float
) -> Choice:
    """The cost rule, as data in and a verdict with its reason out."""
    fetch_s = nbytes / fetch_bps if fetch_bps else None
    if fetch_s is not None and fetch_s > deadline:
        return Choice(False, f"expected fetch {fetch_s:.2f}s is past fetch_deadline={deadline:g}s")
    if prefill_tps is None:
        return Choice(True, "no measured prefill rate for this model")
    prefill_s = tokens / prefill_tps
    if fetch_s is None:
        return Choice(True, f"no measured bandwidth yet (prefill ~{prefill_s:.2f}s)")
    if fetch_s < prefill_s:
        return Choice(True, f"expected fetch {fetch_s:.3f}s < prefill {prefill_s:.3f}s")
    return Choice(
        False, f"remote slower: expected fetch {fetch_s:.3f}s >= prefill {prefill_s:.3f}s"
    )


def ledger_rate(ledger: Ledger | None, model: str) -> float | None:
    """Tokens per second the ledger measured prefilling `model` (all labels), or None."""
    if ledger is None:
        return None
    rows = [s for (m, _), s in ledger.summary.items() if m == model]
    tokens, seconds = sum(s["prefilled_tokens"] for s in rows), sum(s["prefill_s"] for s in rows)
    return tokens / seconds if tokens and seconds > 0 else None


class WarmFetcher:
    """The `fetch` callable kvstore.warm.warm.warm takes: (plan, pin) -> (blob, cache classes,
    note, uploader) where a None blob means "prefill it", the note says why either way, and the
    uploader is the box that computed a fetched blob."""

    def __init__(
        self,
        remote: Remote,
        queue: UploadQueue,
        *,
        ledger: Ledger | None = None,
        always: bool = False,
        record_checks: Callable[[list[Checked]], object] | None = None,
    ):
        self.remote, self.queue, self.ledger = remote, queue, ledger
        self.always = always  # `remote pull`: fetch whatever the cost
        self.record_checks = record_checks  # check_loaded's verdicts, recorded (kvstore.ops.fleet)
        self._down: str | None = None  # an outage seen in this warm: prefill the rest
        if why := unauthenticated(remote.settings):
            log.warning("remote: %s", why)
        # no key and no allow_unsigned: nothing fetched could be used, so nothing is fetched
        self._refuse = bool(why) and not remote.settings.allow_unsigned

    def start(self) -> None:
        """A new warm: an outage seen in the last one is asked about again."""
        self._down = None

    def prefill_rate(self, model: str) -> float | None:
        return ledger_rate(self.ledger, model) or self.queue.rate(f"prefill_tps:{model}")

    def __call__(
        self, plan: ModelPlan, pp: PlannedPin
    ) -> tuple[bytes | memoryview | None, list, str, str | None]:
        if self._down:
            return None, [], f"remote unavailable ({self._down})", None
        if self._refuse:
            return None, [], "remote objects refused: no fleet_key, allow_unsigned is false", None
        try:
            nbytes = self.remote.head(pp.key)
            if nbytes is None:
                return None, [], "not on the remote", None
            choice = self.choose(plan, pp, nbytes)
            if not choice.fetch:
                log.info(
                    "remote: pin %r of %s: prefill, %s", pp.pin.name, plan.spec.path, choice.reason
                )
                return None, [], choice.reason, None
            data, seconds = self.remote.fetch(pp.key)
            meta, blob, prov = verify_object(
                pp.key,
                data,
                tokens=pack_tokens(pp.pin.tokens),
                keys=self.remote.settings.fleet_keys,
                unsigned=self.remote.settings.allow_unsigned,
            )
            if why := self.quarantined(prov.box):
                log.error("remote: pin %r of %s: prefill, %s", pp.pin.name, plan.spec.path, why)
                return None, [], why, None
            if other := other_runtime(meta):
                log.info("remote: pin %r of %s: prefill, %s", pp.pin.name, plan.spec.path, other)
                return None, [], other, None
        except RemoteError as e:
            if e.cause in _OUTAGES:
                self._down = e.cause
            elif e.cause in REFUSALS:
                self.queue.refused(e)
            log.error(
                "remote: pin %r of %s: %s; prefilling instead", pp.pin.name, plan.spec.path, e
            )
            why = f": {e}" if e.cause == "unauthentic" else ""  # names the object and its uploader
            return None, [], f"remote failed ({e.cause}){why}", None
        self.queue.measured("fetch_bps", len(data) / max(seconds, 1e-6))
        self.queue.done(pp.key, "fetched")  # the remote has it: never queued for upload
        note = f"{len(data) / 2**20:.1f} MiB in {seconds:.2f}s ({choice.reason})"
        log.info("remote: pin %r of %s: fetched %s from %s", pp.pin.name, plan.spec.path, note,
                 prov.box)  # fmt: skip
        return blob, meta.classes, note, prov.box

    def check_loaded(
        self, model: Any, plan: ModelPlan, fetched: list[tuple[PlannedPin, Any, str | None]]
    ) -> list[Checked]:
        """The warm loaded `plan`'s model anyway: check with it what this warm fetched (stored
        pending), and record the verdicts (`record_checks`)."""
        from kvstore.codec import codec
        from kvstore.fleet.check import Checked, check_cache

        out = []
        for pp, blob, uploader in fetched:
            stored, _ = codec.decode(blob, name="fetched object")
            v = check_cache(model, plan.spec.identity, list(pp.pin.tokens), stored, copy=False)
            out.append(Checked(pp.key, v.ok, v.what, uploader, pp.pin.name))
            log.info("remote: pin %r of %s: checked against this box's model in %.3fs: %s",
                     pp.pin.name, plan.spec.path, v.seconds, v.what)  # fmt: skip
        if self.record_checks is not None:
            self.record_checks(out)
        return out

    def quarantined(self, box: str) -> str | None:
        """Why objects `box` uploaded are not used here (quarantined after a semantic check
        failed: `kvstore remote status`), or None."""
        why = self.queue.quarantined().get(box)
        return None if why is None else f"uploader {box} is quarantined ({why})"

    def choose(self, plan: ModelPlan, pp: PlannedPin, nbytes: int) -> Choice:
        if self.always:
            return Choice(True, "pull")
        return choose(
            nbytes=nbytes,
            tokens=len(pp.pin.tokens),
            prefill_tps=self.prefill_rate(plan.spec.path),
            fetch_bps=self.queue.rate("fetch_bps") or self.queue.rate("upload_bps"),
            deadline=self.remote.settings.fetch_deadline,
        )

    def record(self, prefilled: list[tuple[str, int, float]]) -> None:
        """This box's own prefill rate per model, from the pins the warm prefilled: (model,
        tokens, seconds) each."""
        for model, tokens, seconds in prefilled:
            self.queue.measured(f"prefill_tps:{model}", tokens / seconds)


def other_runtime(meta: EntryMeta) -> str | None:
    """Why an object is not used here: it records other mlx / mlx-lm versions than this process
    runs. The fingerprint leaves those out (the upgrade canary checks them), so such KV would be
    filed as this runtime's, and would bring back what the canary dropped after an upgrade."""
    from kvstore.identity.codehash import runtime_versions

    theirs, ours = meta.extra.runtime, runtime_versions()
    if not isinstance(theirs, dict) or theirs == ours:
        return None  # not recorded: nothing to judge by
    said = ", ".join(f"{k} {theirs.get(k)}" for k in sorted(ours))
    mine = ", ".join(f"{k} {v}" for k, v in sorted(ours.items()))
    return f"made with {said}; this box runs {mine}"


# What another box recorded about itself: where its model resolved (evict --stale would judge
# this box's entry by that box's path) and which of its manifests own the entry.
_THAT_BOX = ("model_dir", "adapter_dir", "owners", "manifest", PINNED_BEFORE)


def foreign_fields(meta: EntryMeta, plan: ModelPlan, uploader: str) -> PutFields:
    """The put fields for an object another box stored (a runtime pin, a chain), fetched
    for `plan`'s model: its own extra without that box's locations and manifest owners, so the
    put records where the model resolves here and no manifest of this box is taken to own it;
    the model named as this box's manifest names it, so its purges find the entry."""
    extra = meta.extra.without(*_THAT_BOX)
    pinned = meta.pinned
    if any(o.startswith("manifest:") for o in owners(meta)):  # as if its manifests let go
        pinned = meta.extra.pinned_before_manifests is True
    if meta.source == "manifest":
        extra = extra.updated(source="remote")  # the manifest that stored it is another box's
    # same fingerprint: the model as this box's manifest names it
    extra = extra.updated(
        plan.spec.identity.state, owners=[APP], origin="remote", uploader=uploader
    )
    return PutFields(
        tokens=meta.tokens,
        label=meta.label,
        pinned=pinned,
        model=plan.spec.path,
        template_hash=meta.template_hash,
        classes=meta.classes,
        extra=extra,
    )
