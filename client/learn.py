"""Learned prefixes, the client side: report each request's prompt to the daemon, send the KV it
asks for, and restore from the store on a memory miss.

A `PinnedPromptCache`'s store tier (kvstore.client.persistent.StoreTier: the server's prompt cache
in `kvstore serve`, PersistentPromptCache with `learn=True`) calls in here; nothing here calls the
cache back: what goes into its LRU is returned.

- `Learner.restore`: on a memory miss, the store's cold tier (kvstore.learned.coldtier.ColdTier)
  or the fleet's read-through serves what it holds beyond memory; the KV is returned (the caller
  puts it in the LRU: the next hit is memory) instead of prefilling. The records read are sent in
  batches with `touch_blocks` (write-behind), so the learned LRU keeps them.
- `Learner.inserted`: at the end of a request (mlx-lm inserts prompt + generated tokens), one
  write-behind job: `learn` with the prompt; on `want`, the records are sliced from the cache the
  LRU holds (mlx arrays are immutable) and sent with `put_blocks`. The request path pays a list
  copy and a put_nowait.
- `Learner.split` (layouts with state layers, which cannot be cut after the fact): at a boundary
  the daemon asked for (`snapshot_at`), the request's prefill stops there, a copy of the cache at
  the boundary is sent as a learned entry (and returned, to be kept in the LRU), and the prefill
  goes on from it. And a request whose prompt extends an earlier request's whole prompt (a
  conversation's next turn: the turn after it extends it again) is split at its own last token:
  a copy of the state there is kept, and after the response the worker forwards that token on
  the copy and sends the exact state at the prompt's end. A restart before the next turn then
  loses no turn (same compute; the request path pays the copy).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore import metrics, mlxlm
from kvstore.client import modelthread
from kvstore.client.writebehind import CLOSE_TIMEOUT, Job, WriteBehind, store_entry
from kvstore.codec import cache_api
from kvstore.degrade import serve_hook
from kvstore.fleet.reads import FleetReads
from kvstore.learned.coldtier import ColdTier, LearnTarget, Restored
from kvstore.wire.messages import LearnRequest, PutBlocksRequest, Record, TouchBlocksRequest

log = logging.getLogger("kvstore.client")

FRAME_BYTES = 32 * 2**20  # record blobs per put_blocks request, at most (one frame each)
PENDING_PROMPTS = 8  # prompts fetched and not yet inserted (batched requests interleave)
BOUNDARIES = 64  # snapshot boundaries remembered per model
PROMPT_ENDS = 32  # recent whole prompts remembered per model (state layouts: turn-end snapshots)
LEARN_QUEUE = 16  # learn jobs waiting for the worker; more are dropped (never block a request)
TOUCH_BATCH_S = 5.0  # seconds between batches of restored records' keys sent (touch_blocks)
# state layouts: a learned boundary stores only the state layers; the KV layers are records
STATE_ONLY_SNAPSHOTS = True
# kvstore serve's start: the most recently used learned chains read into memory (preload_chains)
PRELOAD_CHAINS = 8
PRELOAD_CHAIN_BYTES = 256 * 2**20  # 256 MiB of their KV in all, at most


class Learner:
    """Reports requests to the daemon and sends what it wants learned; the cold tier of its LRU.

    One per prompt cache. Its jobs go through a write-behind queue (its own, or the one given);
    `drain` waits for them (kvstore serve on SIGTERM)."""

    def __init__(self, home: Path, *, writer: WriteBehind | None = None, learn: bool = True):
        self.home = Path(home)
        self.learn = learn
        self.writer = writer if writer is not None else WriteBehind(home, maxsize=LEARN_QUEUE)
        self._own_writer = writer is None
        self.cold = ColdTier(self.home)
        self.fleet = FleetReads(self.home, self.writer)  # read-through on a miss; no I/O here
        self.targets: dict[Any, LearnTarget] = {}
        self._pending: deque[tuple[Any, list[int]]] = deque(maxlen=PENDING_PROMPTS)
        self._boundaries: dict[Any, OrderedDict[int, tuple[int, ...]]] = {}
        # state layouts: recent whole prompts of requests (and ends the daemon named), and the
        # state one token short of the end of prompts that extend one, until their insert
        self._ends: dict[Any, OrderedDict[tuple[int, ...], None]] = {}
        self._tails: OrderedDict[tuple[Any, tuple[int, ...]], tuple[list, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._paused_said = False
        # state layouts: recent inserts that were not a request's end (system segments)
        self._segments: deque[tuple[Any, tuple[int, ...], list]] = deque(maxlen=PENDING_PROMPTS)
        self.reported = 0  # learn requests the daemon answered
        self.records_sent = 0
        self.snapshots_sent = 0
        self.queued = 0  # learn jobs handed to the write-behind queue
        self._touched: dict[bytes, list[bytes]] = {}  # fingerprint -> restored records' keys
        # chains preloaded at start that no request used yet: (tokens, their records' keys)
        self._preloaded: dict[Any, list[tuple[tuple[int, ...], list[bytes]]]] = {}
        self._touched_sent = time.monotonic()
        self._block = 256  # the store's block_tokens (read from it before records are cut)

    def add_target(self, model_key: Any, target: LearnTarget) -> None:
        self.targets[model_key] = target

    # -- the request path (generation thread) -------------------------------------------------

    def restore(
        self, model: Any, tokens: Sequence[int], served: int, *, used: bool = True
    ) -> Restored | None:
        """The store's KV of a longer prefix of `tokens` than memory's `served`, or None. The
        caller keeps `cache` in its LRU (read from the store) and generates on a copy. `used`:
        its records are touched (False for a request that is not counted: serve's warm-up)."""
        target = self.targets.get(model)
        if target is None:
            return None
        t0 = time.perf_counter()
        hit = self.cold.restore(target, tokens, served)
        if self.fleet.on and len(tokens) - 1 - max(served, hit.n if hit else 0) >= self._block:
            got = self.fleet.restore(target, tokens, served, hit, self.cold)
            hit = Restored(**got) if got is not None else hit
        if hit is None:
            return None
        if hit.prompt_end:  # a turn's end before a restart: this turn's end is snapshotted too
            self._note_end(model, tokens[: hit.n])
        if used and hit.keys:
            with self._lock:
                self._touched.setdefault(target.fingerprint, []).extend(hit.keys)
            if time.monotonic() - self._touched_sent >= TOUCH_BATCH_S:
                self.send_touched()
        dt = time.perf_counter() - t0
        metrics.RESTORE_BYTES.inc(hit.nbytes)
        metrics.RESTORE_SECONDS.inc(dt)
        log.info(
            "kvstore: restored %d tokens (%s, %.1f MiB) from the store in %.1f ms (memory had %d)",
            hit.n, hit.what, hit.nbytes / 2**20, dt * 1e3, served,
        )  # fmt: skip
        return hit

    def refresh(self) -> None:
        """Read the store's index again where it changed (a timer's work, off the request path:
        the next request memory serves then reads nothing of the store)."""
        self.cold.refresh(list(self.targets.values()))

    def preload_chains(self, model: Any) -> list[tuple[list[int], list]]:
        """At a server's start: the model's most recently used learned chains read from the
        store, as (token ids, KV) for the caller's LRU (read from the store), so the first
        request after a restart that continues one is served from memory instead of waiting for
        the cold tier's read. Never raises (a store problem leaves it to the cold tier)."""
        target = self.targets.get(model)
        if target is None or not target.is_sliceable():
            return []  # state layouts keep snapshots at boundaries: the cold tier serves them
        out: list[tuple[list[int], list]] = []
        # an optimisation: never keep the server from starting
        with serve_hook("kvstore: learned chains not read into memory"):
            for tokens in self.cold.recent_chains(target, PRELOAD_CHAINS, PRELOAD_CHAIN_BYTES):
                # one token more than the chain, so that the store serves the whole chain (a
                # restore leaves the prompt's last token to prefill)
                hit = self.cold.restore(target, [*tokens, 0], 0)
                if hit is not None and hit.n == len(tokens):
                    out.append((tokens, hit.cache))
                    self._preloaded.setdefault(model, []).append((tuple(tokens), hit.keys))
        return out

    def fetched(self, model: Any, tokens: Sequence[int]) -> None:
        """Remember the prompt of a request about to run: its insert_cache reports it."""
        if self._preloaded.get(model):
            self._use_preloaded(model, tokens)
        if self.learn and model in self.targets:
            self._pending.append((model, list(tokens)))

    def _use_preloaded(self, model: Any, tokens: Sequence[int]) -> None:
        """The first request that continues a preloaded chain: its records are touched, as a
        restore on that request's path would have touched them (the learned LRU keeps them)."""
        chains, target = self._preloaded[model], self.targets.get(model)
        for i, (chain, keys) in enumerate(chains):
            n = len(chain)
            if n <= len(tokens) and tokens[n - 1] == chain[-1] and tuple(tokens[:n]) == chain:
                del chains[i]
                if target is not None and keys:
                    with self._lock:
                        self._touched.setdefault(target.fingerprint, []).extend(keys)
                return

    def split(
        self, model: Any, tokens: Sequence[int], cache: Any, rest: list
    ) -> tuple[Any, list, list[tuple[list[int], list]]]:
        """For a layout with state layers: prefill up to a boundary the daemon asked for, send a
        copy of the cache there as a learned entry, and go on from it; then, when the prompt
        extends a recent request's whole prompt, prefill up to its last token and keep a copy
        there (`inserted` sends the state at the prompt's end). Returns (cache, rest, keep):
        `keep`, the (token ids, KV) of a boundary's snapshot, for the caller's LRU."""
        target = self.targets.get(model)
        keep: list[tuple[list[int], list]] = []
        if target is None or target.kv_bits is not None:
            return cache, rest, keep
        bounds = self._boundaries.get(model)
        if bounds:
            cache, rest = self._split_at_boundary(model, target, tokens, cache, rest, keep)
        if self.learn and rest and self._extends_an_end(model, tokens):
            cache, rest = self._split_at_end(model, target, tokens, cache, rest, keep)
        return cache, rest, keep

    def _prefill(self, target: LearnTarget, cache: Any, ids: Sequence[int]) -> list:
        import mlx.core as mx

        if cache is None:
            cache = target.template()
        arr = mx.array(list(ids), dtype=mx.uint32)
        for i in range(0, len(arr), target.prefill_step):
            target.model_obj(arr[i : i + target.prefill_step][None], cache=cache)
            mx.eval([cache_api.state(c) for c in cache])
        return cache

    def _split_at_boundary(self, model, target: LearnTarget, tokens, cache, rest, keep: list):
        bounds = self._boundaries[model]
        served, n = len(tokens) - len(rest), len(tokens)
        with self._lock:
            candidates = sorted((p for p in bounds if served < p < n), reverse=True)
            p = next(
                (p for p in candidates if bounds[p][-1] == tokens[p - 1]
                 and bounds[p] == tuple(tokens[:p])),
                None,
            )  # fmt: skip
            if p is None:
                return cache, rest
            del bounds[p]
        cache = self._prefill(target, cache, tokens[served:p])
        snapshot = copy.deepcopy(cache)
        keep.append((list(tokens[:p]), copy.deepcopy(snapshot)))
        prefix = list(tokens[:p])
        if self.writer.submit(
            Job(
                f"learned snapshot ({p} tokens)",
                lambda c: self._send_snapshot(c, target, prefix, snapshot),
            )
        ):
            self.queued += 1
        return cache, list(tokens[p:])

    def _extends_an_end(self, model: Any, tokens: Sequence[int]) -> bool:
        """The prompt extends the whole prompt of a recent request (or an end the daemon named)."""
        target = self.targets.get(model)
        if target is None or target.is_sliceable():
            return False
        with self._lock:
            ends = list(self._ends.get(model) or ())
        n = len(tokens)
        return any(
            len(e) < n and e[-1] == tokens[len(e) - 1] and e == tuple(tokens[: len(e)])
            for e in ends
        )

    def _split_at_end(self, model, target: LearnTarget, tokens, cache, rest, keep: list):
        """Prefill all but the prompt's last token, keep a copy of the state there (and one for
        the caller's LRU: mlx-lm's own prefill would have left it there for the next turn)."""
        served, n = len(tokens) - len(rest), len(tokens)
        cache = self._prefill(target, cache, tokens[served : n - 1])
        keep.append((list(tokens[: n - 1]), copy.deepcopy(cache)))
        with self._lock:
            self._tails[(model, tuple(tokens))] = (copy.deepcopy(cache), int(tokens[-1]))
            while len(self._tails) > PENDING_PROMPTS:
                self._tails.popitem(last=False)
        return cache, list(tokens[n - 1 :])

    def _note_end(self, model: Any, prompt: Sequence[int]) -> None:
        with self._lock:
            ends = self._ends.setdefault(model, OrderedDict())
            ends[tuple(prompt)] = None
            ends.move_to_end(tuple(prompt))
            while len(ends) > PROMPT_ENDS:
                ends.popitem(last=False)

    def inserted(self, model: Any, tokens: Sequence[int], cache: list) -> None:
        """The end of a request (mlx-lm inserts prompt + generated): report its prompt. Other
        inserts of a state layout (the batched path's system segment) are kept a while: one at a
        boundary the daemon asks for is that boundary's snapshot, with no split needed."""
        if not self._pending:
            return
        target = self.targets.get(model)
        if target is not None and not target.is_sliceable():
            if not any(m == model and p == list(tokens[: len(p)]) for m, p in self._pending
                       if len(p) <= len(tokens)):  # fmt: skip
                with self._lock:
                    self._segments.append((model, tuple(tokens), cache))
                return
        prompt = None
        for i in range(len(self._pending) - 1, -1, -1):
            m, p = self._pending[i]
            if m == model and len(p) <= len(tokens) and p[-1:] == list(tokens[len(p) - 1 : len(p)]):
                if p == list(tokens[: len(p)]):
                    prompt = p
                    del self._pending[i]
                    break
        target = self.targets.get(model)
        if prompt is None or target is None or len(prompt) < 2:
            return
        # Normally a no-op; a lazy graph (the batched path's extracted caches) must be evaluated
        # on this thread's stream: the worker has no access to it.
        mlxlm.eval_cache(cache)
        if not target.is_sliceable():
            self._note_end(model, prompt)
            with self._lock:
                tail = self._tails.pop((model, tuple(prompt)), None)
            if tail is not None:  # before the report: the daemon then holds the snapshot
                state, last = tail
                job = Job(
                    f"learned snapshot ({len(prompt)} tokens, a prompt's end)",
                    lambda c: self._send_end_snapshot(c, target, prompt, state, last),
                )
                if self.writer.submit(job):
                    self.queued += 1
                else:
                    metrics.LEARN_DROPPED.labels(reason="queue_full").inc()
        job = Job(
            f"learn report ({len(prompt)} tokens)",
            lambda c: self._learn(c, model, target, prompt, cache),
        )
        if self.writer.submit(job):
            self.queued += 1
        else:
            metrics.LEARN_DROPPED.labels(reason="queue_full").inc()

    def send_touched(self) -> None:
        """Hand the restored records' keys to the write-behind (one touch_blocks per model), so
        the learned LRU keeps what this process restores."""
        with self._lock:
            batches, self._touched = self._touched, {}
            self._touched_sent = time.monotonic()
        for fp, keys in batches.items():
            keys = list(dict.fromkeys(keys))
            self.writer.send(f"{len(keys)} learned record hits", TouchBlocksRequest(fp, keys))

    # -- the worker -----------------------------------------------------------------------------

    def _learn(self, client: Any, model: Any, target: LearnTarget, prompt: list, cache: list):
        from kvstore.store.entry import pack_tokens

        if target.files_ok is not None and not target.files_ok():
            return
        sliceable = target.is_sliceable()
        reply = client.send(
            LearnRequest(target.fingerprint, pack_tokens(prompt), sliceable, target.model,
                         target.label, target.extra)
        )  # fmt: skip
        self.reported += 1
        metrics.LEARN_REPORTS.inc()
        paused = reply.paused
        self.paused_by = reply.paused_by  # a seen prefix then reads write_budget
        metrics.LEARN_PAUSED.set(1 if paused else 0)
        if paused and not self._paused_said:
            self._paused_said = True
            log.warning("kvstore: %s", paused)
        at = [p for p in reply.snapshot_at if 0 < p <= len(prompt)]
        if at:
            with self._lock:
                held = {(m, t): c for m, t, c in self._segments}
                bounds = self._boundaries.setdefault(model, OrderedDict())
                ready = []
                if len(prompt) in at:  # a learnable end: the next turn extending it splits
                    ends = self._ends.setdefault(model, OrderedDict())
                    ends[tuple(prompt)] = None
                    while len(ends) > PROMPT_ENDS:
                        ends.popitem(last=False)
                for p in at:
                    cut = tuple(prompt[:p])
                    if (model, cut) in held:  # in memory already: send it, no split
                        ready.append((list(cut), held[(model, cut)]))
                    else:
                        bounds[p] = cut
                while len(bounds) > BOUNDARIES:
                    bounds.popitem(last=False)
            for prefix, segment in ready:
                self._send_snapshot(client, target, prefix, segment)
        want = [(s, e) for s, e in reply.want]
        if want and sliceable:
            self._send_records(client, target, prompt, cache, want)

    def _put_blocks(self, client, target: LearnTarget, tokens: list, records: list[dict]) -> None:
        """Send `records` of `tokens` (the prompt up to the last record's end) in one put_blocks
        and count what the daemon stored."""
        from kvstore.store.entry import pack_tokens

        rows = [Record(**r) for r in records]
        done = client.send(PutBlocksRequest(target.fingerprint, pack_tokens(tokens), rows,
                                            target.label, target.model, target.extra))  # fmt: skip
        self.records_sent += int(done.stored)
        metrics.WRITTEN_BYTES.labels(kind="learned").inc(int(done.bytes))

    def _send_records(self, client, target: LearnTarget, prompt, cache, want) -> None:
        from kvstore.learned.records import slice_record

        batch: list[dict] = []
        size = 0

        def send() -> None:
            self._put_blocks(client, target, prompt[: max(r["end"] for r in batch)], batch)

        for start, end in want:  # on the write-behind's thread and mlx stream
            if end > len(prompt):
                continue
            blob = slice_record(cache, start, end)
            if batch and size + len(blob) > FRAME_BYTES:
                send()
                batch, size = [], 0
            batch.append({"start": start, "end": end, "blob": blob})
            size += len(blob)
        if batch:
            send()

    def _send_end_snapshot(self, client, target: LearnTarget, prompt: list, state: list,
                           last: int) -> None:  # fmt: skip
        """Forward a prompt's last token on the copy of its state one short of the end (the
        exact state at the end: what a prefill of the prompt leaves) and send it."""
        import mlx.core as mx

        if target.files_ok is not None and not target.files_ok():
            return

        def forward() -> None:
            target.model_obj(mx.array([[last]], dtype=mx.uint32), cache=state)
            mx.eval([cache_api.state(c) for c in state])

        modelthread.call(forward)  # not on this worker: it exits (client/modelthread.py says why)
        self._send_snapshot(client, target, prompt, state, prompt_end=True)

    def _kv_records(self, client, target: LearnTarget, prefix: list, cache: list) -> list[int]:
        """A state layout's cuttable layers (KVCache, QuantizedKVCache) of `prefix` as block
        records: the ones the store lacks are sent with put_blocks (shared by every snapshot
        and chain that covers them). Returns those layers, or [] (the snapshot stays whole:
        no such layers, or no block records in this store)."""
        from kvstore.learned.chain import cuts
        from kvstore.learned.records import kv_layers, slice_record
        from kvstore.store.entry import pack_tokens

        layers = kv_layers(cache)
        blocks = self.cold.blocks() if layers and STATE_ONLY_SNAPSHOTS else None
        if blocks is None:
            return []
        self._block = blocks.cut_at()
        data = pack_tokens(prefix)
        stored = min(blocks.stored_end(target.fingerprint, data), len(prefix))
        rows: list[dict[str, Any]] = [
            {"start": s, "end": e, "blob": slice_record(cache, s, e, layers=layers)}
            for s, e in cuts(stored, len(prefix), self._block)
        ]
        for i in range(0, len(rows), 64):  # well under a frame each at any model's KV size
            batch = rows[i : i + 64]
            self._put_blocks(client, target, prefix[: batch[-1]["end"]], batch)
        return layers

    def _send_snapshot(self, client, target: LearnTarget, prefix: list, cache: list, *,
                       prompt_end: bool = False) -> None:  # fmt: skip
        from kvstore.identity.fingerprint import resolve_model_path, template_hash
        from kvstore.learned.records import state_part

        if target.files_ok is not None and not target.files_ok():
            return
        if target.template_hash is None:
            target.template_hash = template_hash(resolve_model_path(target.model))
        more: dict[str, Any] = {}
        layers = self._kv_records(client, target, prefix, cache)
        if layers:  # the KV layers went as shared records: the snapshot holds the state only
            cache = state_part(cache, layers)
            more = {"kv_layers": layers, "kv_block": self._block}
        sent = store_entry(client, target.fingerprint, prefix, cache, model=target.model,
                           template_hash=target.template_hash, label="learned", pinned=False,
                           state=target.extra, source="learned", learned=True,
                           prompt_end=prompt_end, **more)  # fmt: skip
        self.snapshots_sent += 1
        metrics.WRITTEN_BYTES.labels(kind="learned").inc(sent)

    # -- shutdown -------------------------------------------------------------------------------

    def drain(self, timeout: float = CLOSE_TIMEOUT) -> tuple[int, int]:
        """Wait for queued learn jobs (at most `timeout`); (sent, abandoned) jobs."""
        self.send_touched()
        done = self.writer.flush(timeout)
        left = 0 if done else self.writer.pending
        if left:
            metrics.LEARN_DROPPED.labels(reason="abandoned").inc(left)
        return self.writer.sent, left

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        self.send_touched()
        if self._own_writer:
            self.writer.close(timeout)
        self.cold.close()
        self.fleet.close()
