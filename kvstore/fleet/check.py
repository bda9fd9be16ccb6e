"""The semantic check before first use: KV another box computed is compared with what this box's
own model computes for the same tokens before it serves a request here. The first CHECK_TOKENS
positions are re-prefilled and compared with the object's first positions (kvstore.warm.kvdiff,
the upgrade canary's comparison and tolerance); all of it when shorter, and the whole entry for
caches that cannot be cut (final-state layouts) or whose KV is quantized. A mismatch quarantines
every object of that uploader (kvstore.fleet.queue.UploadQueue.quarantine) until `kvstore remote
release`.

Where it runs: `kvstore remote pull` checks before it stores. The warm's read-through (the
daemon's warms, `kvstore warm`) runs before any model is loaded, so it stores what it fetched
marked `fleet_check: pending`; the warm checks those with the model when it loads it anyway (other
pins to prefill), and otherwise the first process that holds the model (kvstore.client: load,
PersistentPromptCache, serve) checks each pending entry before it inserts it, at start, off the
request path, and records the verdict in the store (`record_verdicts`, through the daemon's
`fleet_checked` when one runs: kvstore.ops.fleet). A pending entry is never inserted unchecked.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.codec import codec
from kvstore.store.entry import CHECK_PASSED, CHECK_PENDING, FLEET_CHECK

if TYPE_CHECKING:
    from kvstore.identity.model import ModelIdentity
    from kvstore.store.entry import EntryMeta
    from kvstore.store.store import Store
    from kvstore.warm.plan import ModelPlan
    from kvstore.wire.messages import FleetCheckedRequest

log = logging.getLogger("kvstore")

CHECK_TOKENS = 64  # positions re-prefilled per object
# an entry's extra: "pending" (fetched, not yet checked) | "passed"
CHECK_FIELD, PENDING, PASSED = FLEET_CHECK, CHECK_PENDING, CHECK_PASSED
MISMATCH = "mismatch"  # the refusal count's cause (`remote status`, /metrics)


@dataclass
class Verdict:
    ok: bool
    what: str  # "first 64 of 148 tokens: difference 1.2e-4, tolerance 7.8e-3"
    seconds: float


def pending(meta: EntryMeta) -> bool:
    """Whether this entry came from another box and was not yet checked against this model."""
    return meta.extra.get(CHECK_FIELD) == PENDING


def _first(cache: list, n: int) -> list | None:
    """A view of the first `n` positions of a cache of plain KVCache layers (the stored arrays are
    only sliced, never changed: the entry is then inserted as it is); None for other layouts."""
    from mlx_lm.models.cache import KVCache

    if not cache or any(type(c).__name__ != "KVCache" or c.keys is None for c in cache):
        return None
    out = []
    for c in cache:
        v = KVCache()
        v.keys, v.values, v.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        out.append(v)
    return out


def check_cache(
    model: Any, identity: ModelIdentity, token_ids: list[int], stored: list, *, copy: bool = True
) -> Verdict:
    """Compare `stored` (the decoded KV of `token_ids`) with this model's own prefill of its first
    CHECK_TOKENS positions; the whole of it when shorter, or when it cannot be cut or is
    quantized. `stored` is left as it was unless `copy` is False (then it may be trimmed)."""
    import copy as copying

    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    from kvstore.warm.kvdiff import kv_difference
    from kvstore.warm.prefill import prefill

    t = time.perf_counter()
    n = len(token_ids)
    if n > CHECK_TOKENS and identity.kv_bits is None and can_trim_prompt_cache(stored):
        view = _first(stored, CHECK_TOKENS)
        if view is None:
            view = copying.deepcopy(stored) if copy else stored
            trim_prompt_cache(view, n - CHECK_TOKENS)
        stored, n = view, CHECK_TOKENS
    fresh = prefill(model, token_ids[:n], identity=identity)
    diff, tol = kv_difference(stored, fresh)
    what = f"first {n} of {len(token_ids)} tokens: difference {diff:.3g}, tolerance {tol:.3g}"
    return Verdict(diff <= tol, what, time.perf_counter() - t)


def check_record(model: Any, identity: ModelIdentity, token_ids: list[int], blob) -> Verdict:
    """The check of a learned chain's first record ([0, end) of `token_ids`): its KV layers
    against those of this model's prefill of the first CHECK_TOKENS positions."""
    from kvstore.learned.records import kv_layers
    from kvstore.warm.kvdiff import kv_difference
    from kvstore.warm.prefill import prefill

    t = time.perf_counter()
    stored, _ = codec.decode(blob, name="fetched learned record")
    n = min(len(token_ids), CHECK_TOKENS)
    fresh = prefill(model, token_ids[:n], identity=identity)
    if layers := kv_layers(fresh):  # a state layout: its records hold the KV layers only
        fresh = [fresh[i] for i in layers]
    if n < len(token_ids) and (view := _first(stored, n)) is not None:
        stored = view
    diff, tol = kv_difference(stored, fresh)
    what = f"first {n} of {len(token_ids)} tokens: difference {diff:.3g}, tolerance {tol:.3g}"
    return Verdict(diff <= tol, what, time.perf_counter() - t)


class SemanticCheck:
    """One model plan's check, its model loaded at the first object (then kept for the rest), or
    given (a warm that loaded it anyway)."""

    def __init__(self, plan: ModelPlan, model: Any = None):
        self.plan = plan
        self._model: Any = model
        self.load_seconds = 0.0

    @property
    def model(self) -> Any:
        from kvstore.warm.warm import load_model

        if self._model is None:
            t = time.perf_counter()
            self._model = load_model(self.plan)
            self.load_seconds = time.perf_counter() - t
        return self._model

    def __call__(self, token_ids: list[int], blob: bytes | memoryview) -> Verdict:
        model = self.model
        stored, _ = codec.decode(blob, name="fetched object")
        return check_cache(model, self.plan.spec.identity, token_ids, stored, copy=False)

    def record(self, token_ids: list[int], blob: bytes | memoryview) -> Verdict:
        return check_record(self.model, self.plan.spec.identity, token_ids, blob)

    def close(self) -> None:
        self._model = None


@dataclass
class Checked:
    """One pending entry's verdict, as the process that checked it reports it."""

    key: bytes
    ok: bool
    what: str
    uploader: str | None = None
    label: str = ""


def record_verdicts(store: Store, home: Path, verdicts: list[Checked]) -> tuple[int, int]:
    """Record checks of pending entries: a passed one is marked so (never checked again); a refused
    one is deleted, its uploader quarantined (kvstore.fleet.queue), and every other entry that
    box uploaded and is still pending here is deleted with it (a look, then `kvstore remote
    release`, lets them be fetched again). Returns (passed, deleted)."""
    from dataclasses import replace

    passed = [v.key for v in verdicts if v.ok]
    bad = [v for v in verdicts if not v.ok]

    def mark(meta: EntryMeta) -> EntryMeta | None:
        if not pending(meta):
            return None
        return replace(meta, extra={**meta.extra, CHECK_FIELD: PASSED})

    n = store.edit_meta({k: mark for k in passed}) if passed else 0
    if not bad:
        return n, 0
    boxes = {v.uploader for v in bad if v.uploader}
    gone = {v.key for v in bad}
    gone |= {m.key for m in store.metas(errors=[])
             if pending(m) and m.extra.get("uploader") in boxes}  # fmt: skip
    deleted = store.delete(list(gone))
    from kvstore.fleet.queue import UploadQueue

    queue = UploadQueue(home)
    try:
        for v in bad:
            if v.uploader:
                queue.quarantine(v.uploader, f"{v.label}: {v.what} against this box's model")
            queue.count_refusal(MISMATCH)
    finally:
        queue.close()
    for v in bad:
        log.error(
            "remote: refused fetched entry %s %r: its KV is not what this box's model computes "
            "(%s); every object of uploader %s is quarantined (`kvstore remote release %s` after "
            "a look)", v.key.hex(), v.label, v.what, v.uploader or "unknown",
            v.uploader or "BOX",
        )  # fmt: skip
    return n, deleted


def request_of(verdicts: list[Checked]) -> FleetCheckedRequest:
    from kvstore.wire.messages import FleetCheckedRequest

    return FleetCheckedRequest(
        passed=[v.key for v in verdicts if v.ok],
        refused=[{"key": v.key, "what": v.what, "uploader": v.uploader, "label": v.label}
                 for v in verdicts if not v.ok],
    )  # fmt: skip
