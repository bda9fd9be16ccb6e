"""The semantic check before first use: KV another box computed is compared with what this box's
own model computes for the same tokens before it serves a request here. The first CHECK_TOKENS
positions are re-prefilled and compared with the object's first positions by the one KV check
(kvstore.kvcheck.check, the upgrade canary's and the import's); all of it when shorter, and the
whole entry for caches that cannot be cut (final-state layouts) or whose KV is quantized. Past
the first CHECK_TOKENS of a cuttable entry, SPOT_CHECKS positions drawn here from the OS's
randomness (one in each of SPOT_CHECKS equal stretches of the rest, so the uploader cannot know
which) get one decoding step each: the stored token run over the stored KV before it, the K/V it
makes compared with the stored K/V at that position by the same check. A few single-token steps,
whatever the entry's length; a tamper of a stretch of positions is caught when a step lands in it
(or after it: a step attends to every position before it). A mismatch quarantines every object
of that uploader (kvstore.fleet.queue.UploadQueue.quarantine) until `kvstore remote release`.

Learned records. A request's read-through (kvstore.fleet.reads) checks every record it
fetched, over the cache it assembled from them and the local records they continue
(`check_chain`): SPOT_CHECKS steps drawn over the whole fetched stretch [start, n), each over
everything before it, and the first CHECK_TOKENS re-prefilled where the stretch starts the
chain; a later record, or one continuing a chain this box holds, is stepped like the first.
`remote pull` checks every record it fetches (`check_record`): a chain's first record of plain
KV layers the same way; any other (past a chain's start, whose KV before it is not at hand; a
state layout's, which holds only its attention layers' K/V, so no step can run without the state
before it; quantized KV) whole: this model's own cache up to the record's end (one kept of a
longer chain as it is, one kept of a prefix continued, else prefilled from 0: SemanticCheck
keeps the last ENDS_KEPT, so a chain pulled in any order costs about one prefill of it), every
position of the record compared. Read-through never serves a state layout (it cannot be cut),
so a hybrid's learned records come from the fleet by `remote pull` only, with its state-only
snapshots (entries whose emptied KV layers are those records), which `check_cache` re-prefills
whole and compares on the state layers they hold. What it costs: `python -m bench.fleet_trust
--check-only`; the reference runs in bench/results/reference/fleet-notes.md, "What trust costs".

Limits: a change to a few positions that no drawn step lands on or after (a stretch is caught
when any step lands in it or after it); a read-through mismatch cannot name the record that
differs, so every uploader of the fetched records is quarantined; a record checked whole whose
chain this check keeps no cache of (a fifth chain pulled between them) is prefilled from 0.

Where it runs: `kvstore remote pull` checks before it stores. The warm's read-through (the
daemon's warms, `kvstore warm`) runs before any model is loaded, so it stores what it fetched
marked `fleet_check: pending`; the warm checks those with the model when it loads it anyway (other
pins to prefill), and otherwise the first process that holds the model (kvstore.client: load,
PersistentPromptCache, serve) checks each pending entry before it inserts it, at start, off the
request path, and records the verdict in the store (kvstore.ops.fleet, through the daemon's
`fleet_checked` when one runs). A pending entry is never inserted unchecked.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.codec import codec
from kvstore.kvcheck.check import check_kv, kv_view
from kvstore.store.entry import CHECK_PASSED, CHECK_PENDING, FLEET_CHECK

if TYPE_CHECKING:
    from kvstore.identity.model import ModelIdentity
    from kvstore.pins.plan import ModelPlan
    from kvstore.store.entry import EntryMeta
    from kvstore.wire.messages import FleetCheckedRequest

log = logging.getLogger("kvstore")

CHECK_TOKENS = 64  # positions re-prefilled per object
SPOT_CHECKS = 8  # positions past CHECK_TOKENS checked by one decoding step each, drawn at random
# an entry's extra: "pending" (fetched, not yet checked) | "passed"
CHECK_FIELD, PENDING, PASSED = FLEET_CHECK, CHECK_PENDING, CHECK_PASSED
MISMATCH = "mismatch"  # the refusal count's cause (`remote status`, /metrics)


@dataclass
class Verdict:
    ok: bool
    what: str  # "first 64 of 148 tokens: difference 1.2e-4, tolerance 7.8e-3"
    seconds: float
    prefilled: int = 0  # tokens the check prefilled (in prefill_seconds): a prefill rate
    prefill_seconds: float = 0.0


def pending(meta: EntryMeta) -> bool:
    """Whether this entry came from another box and was not yet checked against this model."""
    return meta.extra.fleet_check == PENDING


def _first(cache: list, n: int) -> list | None:
    """A view of the first `n` positions of a cache of plain KVCache layers (the stored arrays are
    only sliced, never changed: the entry is then inserted as it is); None for other layouts."""
    if not cache or any(type(c).__name__ != "KVCache" or c.keys is None for c in cache):
        return None
    return kv_view(cache, 0, n)


def spot_positions(n: int, k: int | None = None, start: int = CHECK_TOKENS) -> list[int]:
    """`k` (SPOT_CHECKS) positions of [start, n), one drawn uniformly in each of `k` equal
    stretches (so they spread over the whole rest of the entry), from the OS's randomness:
    nothing an uploader could know when it sealed the object."""
    k = SPOT_CHECKS if k is None else k
    span = n - start
    if span <= 0 or k <= 0:
        return []
    k = min(k, span)
    rng = secrets.SystemRandom()
    edges = [start + span * i // k for i in range(k + 1)]
    return [rng.randrange(lo, hi) for lo, hi in zip(edges, edges[1:])]


def _upto(stored: list, p: int, n: int) -> list:
    """A cache holding the first `p` positions of `stored`, to run a step on (`stored` itself is
    never changed: plain KVCache layers are sliced, other cuttable layouts copied and cut)."""
    import copy as copying

    from mlx_lm.models.cache import trim_prompt_cache

    view = _first(stored, p)
    if view is None:
        view = copying.deepcopy(stored)
        trim_prompt_cache(view, n - p)
    return view


def _at(c: Any, p: int) -> Any:
    """A one-position KVCache of layer `c`'s K/V at position `p`, or None for a layer that keeps
    no K/V per position there (a state layer, a wrapped window, quantized KV)."""
    name = type(c).__name__
    if name not in ("KVCache", "RotatingKVCache") or getattr(c, "keys", None) is None:
        return None
    if name == "RotatingKVCache" and c.offset > c.max_size:
        return None
    return kv_view([c], p, p + 1)[0]


def step_check(model: Any, token_ids: list[int], stored: list, positions: list[int]) -> Verdict:
    """At each of `positions`, one decoding step of the stored token over the stored KV before
    it, its K/V compared with the stored K/V at that position (the one KV check). `stored` is
    left as it was. The verdict names the first position that differs."""
    import mlx.core as mx

    t = time.perf_counter()
    layers = [i for i, c in enumerate(stored) if _at(c, 0) is not None]
    if not layers:
        return Verdict(True, "no layer keeps K/V per position: no step", 0.0)
    worst, tol, bad = 0.0, 0.0, None
    for p in sorted(positions):
        view = _upto(stored, p, len(token_ids))
        model(mx.array(token_ids[p : p + 1])[None], cache=view)
        fresh = [_at(view[i], p) for i in layers]
        if any(f is None for f in fresh):
            return Verdict(False, f"position {p}: the step made no K/V to compare", 0.0)
        v = check_kv(model, [_at(stored[i], p) for i in layers], fresh=fresh)
        d, tl = v.difference, v.tolerance
        worst, tol = max(worst, d), max(tol, tl)
        if d > tl and bad is None:
            bad = f"position {p}: difference {d:.3g}, tolerance {tl:.3g}"
    steps = f"{len(positions)} drawn positions stepped"
    if len(layers) < len(stored):
        steps += f" ({len(layers)} of {len(stored)} layers keep K/V per position)"
    what = f"{steps}, {bad}" if bad else f"{steps}: difference {worst:.3g}, tolerance {tol:.3g}"
    return Verdict(bad is None, what, time.perf_counter() - t)


def check_cache(
    model: Any,
    identity: ModelIdentity,
    token_ids: list[int],
    stored: list,
    *,
    copy: bool = True,
    positions: list[int] | None = None,
) -> Verdict:
    """Compare `stored` (the decoded KV of `token_ids`) with this model's own prefill of its first
    CHECK_TOKENS positions, and past them one decoding step at each of `positions` (default:
    SPOT_CHECKS drawn at random, spot_positions); the whole of it when shorter, or when it cannot
    be cut or is quantized. `stored` is left as it was unless `copy` is False (then it may be
    trimmed)."""
    import copy as copying

    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    t = time.perf_counter()
    n = len(token_ids)
    steps = None
    if n > CHECK_TOKENS and identity.kv_bits is None and can_trim_prompt_cache(stored):
        where = spot_positions(n) if positions is None else positions
        steps = step_check(model, token_ids, stored, where)  # before `stored` may be cut
        view = _first(stored, CHECK_TOKENS)
        if view is None:
            view = copying.deepcopy(stored) if copy else stored
            trim_prompt_cache(view, n - CHECK_TOKENS)
        stored, n = view, CHECK_TOKENS
    v = check_kv(model, stored, token_ids[:n], identity=identity, match=_state_only)
    what = f"first {n} of {len(token_ids)} tokens: difference {v.difference:.3g}, tolerance "
    what += f"{v.tolerance:.3g}"
    if v.skipped:
        what += f" (a state-only snapshot: its {v.skipped} KV layers are learned records)"
    ok = v.ok
    if steps is not None:
        what, ok = f"{what}; {steps.what}", ok and steps.ok
    return Verdict(ok, what, time.perf_counter() - t)


def _state_only(stored: list, fresh: list) -> tuple[list, list]:
    """A state layout's learned snapshot (kvstore.learned.records.state_part: its KV layers
    emptied, held as learned records, each checked as a record; the store loads such an entry
    only where its extra.kv_layers names them, and fills them from the records) compared on the
    layers it holds; any other cache as it is."""
    from kvstore.learned.records import kv_layers

    layers = kv_layers(fresh)
    empty = [i for i, c in enumerate(stored)
             if type(c).__name__ == "KVCache" and getattr(c, "keys", None) is None]  # fmt: skip
    if not layers or empty != layers or len(stored) != len(fresh):
        return stored, fresh
    keep = [i for i in range(len(fresh)) if i not in set(layers)]
    return [stored[i] for i in keep], [fresh[i] for i in keep]


def check_chain(
    model: Any,
    identity: ModelIdentity,
    token_ids: list[int],
    cache: list,
    start: int,
    *,
    positions: list[int] | None = None,
) -> Verdict:
    """The check of a fetched stretch [start, n) of a learned chain's assembled cache (`cache`:
    the KV of all n = len(`token_ids`) positions, the records this box holds before `start`
    and the fetched ones from it; plain KV layers, not quantized): where the stretch starts the
    chain, its first CHECK_TOKENS positions against this model's prefill; over the rest of the
    stretch, one decoding step at each of `positions` (default: SPOT_CHECKS drawn at random,
    spot_positions), each over the whole assembled cache before it. A few single-token steps
    whatever the chain's length. `cache` is left as it was."""
    t = time.perf_counter()
    n = len(token_ids)
    head = min(CHECK_TOKENS, n) if start == 0 else 0
    parts, ok, took = [], True, 0.0
    if head:
        v = check_kv(model, _upto(cache, head, n), token_ids[:head], identity=identity)
        ok, took = v.ok, v.prefill_seconds
        parts.append(
            f"first {head} of {n} tokens: difference {v.difference:.3g}, tolerance "
            f"{v.tolerance:.3g}"
        )
    lo = max(start, head)
    where = spot_positions(n, start=lo) if positions is None else positions
    if where:
        steps = step_check(model, token_ids, cache, where)
        ok = ok and steps.ok
        parts.append(f"{steps.what} (of [{lo}, {n}))")
    what = "; ".join(parts) or f"nothing fetched past {start}"
    return Verdict(ok, what, time.perf_counter() - t, head, took)


def check_record(
    model: Any,
    identity: ModelIdentity,
    token_ids: list[int],
    blob,
    *,
    ends: dict[bytes, list] | None = None,
) -> Verdict:
    """The check of one learned record, positions [start, end) of `token_ids` (the chain's
    tokens up to the record's end; start = end - the positions the record holds). A chain's
    first record of plain KV layers (not quantized): its first CHECK_TOKENS positions against
    this model's prefill, and one decoding step at each of SPOT_CHECKS positions drawn at random
    past them. Otherwise (a state layout's record, which holds its KV layers only, so no step
    can run on it without the state before it; a record past a chain's start, whose KV before
    it is not here; quantized KV) the whole of it: this model's own cache of [0, end) (from
    `ends`: packed chain tokens -> this model's cache of them, which this check keeps up to date;
    SemanticCheck keeps the last ENDS_KEPT: one of a longer chain serves as it is, one of a
    prefix is continued, else it is prefilled from 0), every position of the record compared.
    A chain's records checked in any order cost about one prefill of the chain."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore.learned.records import kv_layers

    stored, _ = codec.decode(blob, name="fetched learned record")
    end = len(token_ids)
    start = end - (codec.cache_tokens(stored) or 0)
    plain = not kv_layers(make_prompt_cache(model)) and _first(stored, 0) is not None
    if start == 0 and plain and identity.kv_bits is None:
        return check_chain(model, identity, token_ids, stored, 0)
    return _whole_record(model, identity, token_ids, stored, start, ends)


ENDS_KEPT = 4  # this model's caches at chain ends a SemanticCheck keeps, to continue from


def _own_cache(
    model: Any, identity: ModelIdentity, token_ids: list[int], ends: dict | None
) -> tuple[list, int, str]:
    """This model's own cache of (at least) `token_ids`, the tokens run for it and how: one `ends`
    keeps of a chain these tokens start (their KV is in it already), else the one of their
    longest prefix `ends` keeps continued over the rest (it is kept under the longer tokens
    instead), else prefilled from 0 (kept). Quantized KV (`kv_bits`) is always prefilled."""
    import mlx.core as mx

    from kvstore import tokens as tk
    from kvstore.kvcheck.prefill import PREFILL_STEP, prefill

    n, packed = len(token_ids), tk.pack(token_ids)
    if ends is None or identity.kv_bits is not None:
        return prefill(model, token_ids, identity=identity), n, "prefilled from 0"
    for kept, cache in ends.items():
        if kept.startswith(packed):
            return cache, 0, f"in this model's cache of a chain of {tk.count(kept)} here"
    base = max((k for k in ends if packed.startswith(k)), key=len, default=None)
    if base is None:
        cache, at, how = prefill(model, token_ids, identity=identity), 0, "prefilled from 0"
    else:
        cache, at = ends.pop(base), tk.count(base)
        for i in range(at, n, PREFILL_STEP):
            model(mx.array(token_ids[i : i + PREFILL_STEP])[None], cache=cache)
            mx.eval([codec.cache_api.state(c) for c in cache])
        how = f"continued from {at}"
    ends[packed] = cache
    while len(ends) > ENDS_KEPT:
        del ends[next(iter(ends))]
    return cache, n - at, how


def _whole_record(
    model: Any,
    identity: ModelIdentity,
    token_ids: list[int],
    stored: list,
    start: int,
    ends: dict | None,
) -> Verdict:
    """Record positions [start, len(token_ids)) of the cuttable layers against this model's own
    cache of the chain up to them (check_record's full check)."""
    from kvstore.learned.records import kv_layers, slice_record

    t = time.perf_counter()
    end = len(token_ids)
    fresh, ran, how = _own_cache(model, identity, token_ids, ends)
    took = time.perf_counter() - t
    layers = None if len(stored) == len(fresh) else kv_layers(fresh) or None
    mine, _ = codec.decode(slice_record(fresh, start, end, layers=layers))
    v = check_kv(model, stored, fresh=mine)
    what = (f"positions {start}-{end - 1}, all of them, {how}: difference {v.difference:.3g}, "
            f"tolerance {v.tolerance:.3g}")  # fmt: skip
    if layers:
        what += f" ({len(layers)} of {len(fresh)} layers keep K/V per position)"
    return Verdict(v.ok, what, time.perf_counter() - t, ran, took)


class SemanticCheck:
    """One model plan's check, its model loaded at the first object (then kept for the rest), or
    given (a warm that loaded it anyway)."""

    def __init__(self, plan: ModelPlan, model: Any = None):
        self.plan = plan
        self._model: Any = model
        self.load_seconds = 0.0
        self._ends: dict[bytes, list] = {}  # check_record's own caches at chain ends

    @property
    def model(self) -> Any:
        from kvstore.kvcheck.prefill import load_model

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
        return check_record(self.model, self.plan.spec.identity, token_ids, blob, ends=self._ends)

    def close(self) -> None:
        self._model, self._ends = None, {}


@dataclass
class Checked:
    """One pending entry's verdict, as the process that checked it reports it."""

    key: bytes
    ok: bool
    what: str
    uploader: str | None = None
    label: str = ""


def request_of(verdicts: list[Checked]) -> FleetCheckedRequest:
    from kvstore.wire.messages import FleetCheckedRequest

    return FleetCheckedRequest(
        passed=[v.key for v in verdicts if v.ok],
        refused=[{"key": v.key, "what": v.what, "uploader": v.uploader, "label": v.label}
                 for v in verdicts if not v.ok],
    )  # fmt: skip
