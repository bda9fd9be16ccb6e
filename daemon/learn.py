"""The daemon's side of learned prefixes: the `learn`, `put_blocks` and `touch_blocks`
operations, and the cap on learned snapshot entries. The policy itself is `kvstore.learned.policy`;
records are `kvstore.learned.blockstore`; the messages are kvstore.wire.messages.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvstore import metrics
from kvstore import tokens as tk
from kvstore.home.ledger import Ledger
from kvstore.home.settings import Settings
from kvstore.learned.blockstore import BlockStore, is_snapshot, learned_summary, today
from kvstore.learned.chain import chain_hashes
from kvstore.learned.policy import MIN_LCP, LearnPolicy, Sighting, worth_storing
from kvstore.ops import put as put_ops
from kvstore.ops.budget import Budget
from kvstore.ops.evict import evict, snapshot_cap
from kvstore.store.entry import EntryMeta, packed_prefix_hash
from kvstore.store.store import Store
from kvstore.wire.messages import (
    LearnReply,
    LearnRequest,
    PutBlocksReply,
    PutBlocksRequest,
    TouchBlocksReply,
    TouchBlocksRequest,
)

log = logging.getLogger("kvstore.daemon")


class Learning:
    """Learned prefixes: the daemon's part that answers learn, put_blocks and touch_blocks.

    `write(name, fn)` runs `fn` on the writer thread and waits; `budget` is the upkeep's;
    `uploader()` is the fleet tier's upload queue, or None. With an uploader, a prefix recurs
    across the fleet (`_fleet_end`): its seen-markers are looked up and written.
    """

    def __init__(
        self,
        store: Store,
        blocks: BlockStore,
        ledger: Ledger,
        settings: Settings,
        write: Callable[[str, Callable[[], Any]], Any],
        *,
        budget: Budget,
        uploader: Callable[[], Any],
    ):
        self.store, self.blocks, self.ledger, self.settings = store, blocks, ledger, settings
        self.write = write
        self.budget = budget
        self.uploader = uploader
        self._learn_lock = threading.Lock()  # connection threads share the policy
        self._bytes_per_token: dict[bytes, float] = {}  # per fingerprint, from put_blocks
        self._paused: str | None = None
        self.policy = LearnPolicy(
            min_requests=int(settings.learn_min_requests), block=self.blocks.block
        )

    def _prefill_tps(self, model: str) -> float | None:
        rows = [r for r in self.ledger.stats()["by_model_label"] if r["model"] == model]
        tokens, seconds = (
            sum(r["prefilled_tokens"] for r in rows),
            sum(r["prefill_s"] for r in rows),
        )
        return tokens / seconds if tokens and seconds > 0 else None

    def _pinned_end(self, fp: bytes, data: bytes) -> int:
        """Tokens of the longest pin of this model that prefixes `data` (packed), or 0."""
        best = 0
        for m in self.store.metas(fp, errors=[]):
            if m.pinned and not is_snapshot(m) and len(m.tokens) > tk.nbytes(best):
                if data.startswith(m.tokens):
                    best = tk.count(m.tokens)
        return best

    def learn_paused(self) -> str | None:
        """Why learning is paused now (the daily write budget), or None; logged once a day."""
        msg = self.policy.paused(
            written_today=self.blocks.written_today(),
            write_budget=int(self.settings.learn_write_bytes_per_day),
        )
        self._note_paused(msg)
        return msg

    def _note_paused(self, msg: str | None) -> None:
        self._paused = msg
        metrics.LEARN_PAUSED.set(1 if msg else 0)
        if msg and self.policy.first_time(msg, today()):
            log.warning("%s", msg)

    def learn(self, req: LearnRequest) -> LearnReply:
        fp, data, sliceable, model = req.fingerprint, req.tokens, req.sliceable, req.model
        policy = self.policy
        hashes = chain_hashes(fp, data, policy.block)
        with self._learn_lock:
            seen = policy.sighting(fp, data, hashes)
        end = max(seen.end, self._fleet_end(fp, data, hashes, seen) if sliceable else 0)
        paused = self.learn_paused()
        if paused:
            return LearnReply(paused=paused, paused_by="write_budget")
        if end == 0:
            return LearnReply()
        bpt = self._bytes_per_token.get(fp)
        if not worth_storing(bpt and bpt * end, end, self._prefill_tps(model)):
            log.debug("learn: %d tokens of %s not worth storing (prefill is faster)", end, model)
            return LearnReply()
        want: list[list[int]] = []
        snapshot_at: list[int] = []
        if sliceable:
            stored = min(self.blocks.stored_end(fp, tk.cut(data, 0, end)), end)
            if stored >= end or end - self._pinned_end(fp, tk.cut(data, 0, end)) < MIN_LCP:
                return LearnReply()  # stored: as records, or in a pin (one copy)
            why = policy.paused(
                written_today=0,
                write_budget=1,
                want_bytes=int(bpt * (end - stored)) if bpt else None,
                learned_budget=int(self.settings.learned_max_bytes),
            )
            if why:
                self._note_paused(why)
                return LearnReply(paused=why, paused_by="learned_budget")
            with self._learn_lock:
                want = [list(r) for r in policy.wants(fp, data, hashes, stored, end)]
        else:
            key = fp + packed_prefix_hash(tk.cut(data, 0, end))
            if self.store.get_meta(key) is None:
                marker = b"snap" + key
                with self._learn_lock:
                    now = policy.clock()
                    if policy.inflight.get(marker, 0) <= now:
                        policy.inflight[marker] = now + policy.inflight_s
                        snapshot_at = [end]
        if want or snapshot_at:
            log.info("learn: %s of %s: want %s, snapshot at %s", req.label or "-", model, want,
                     snapshot_at)  # fmt: skip
        return LearnReply(want, snapshot_at)

    def _fleet_end(self, fp: bytes, data: bytes, hashes: list[bytes], seen: Sighting) -> int:
        """The prefix another box's earlier request makes recurring (block-granular, 0: none):
        the seen-markers of the nodes this request saw first here and the store does not hold
        (records fetched from the fleet, say), looked up; those the fleet lacks are marked
        (written by kvstore.fleet.sightings' worker, off this reply)."""
        uploader = self.uploader()
        if seen.fleet is None or uploader is None:
            return 0
        lo, hi = seen.fleet
        lo = max(lo, self.blocks.stored_end(fp, data) // self.policy.block + 1)
        if lo > hi:
            return 0
        found = uploader.sightings.deepest(fp, hashes, lo, hi)
        uploader.sightings.mark(fp, hashes, range(max(lo, found + 1), hi + 1))
        if found:
            log.info("learn: %d tokens recur across the fleet (another box's request passed "
                     "them)", found * self.policy.block)  # fmt: skip
        return found * self.policy.block

    def put_blocks(self, req: PutBlocksRequest) -> PutBlocksReply:
        rows = req.records

        def job():
            written, keys = put_ops.put_blocks(self.blocks, req, budget=self.budget)
            with self._learn_lock:
                self.policy.landed(keys)
            uploader = self.uploader()  # the fleet tier, or None
            if uploader is not None and req.extra.get("origin") != "remote":  # pulled: there
                uploader.notify_records(keys)
            ntok = sum(r.end - r.start for r in rows)
            if ntok:
                self._bytes_per_token[req.fingerprint] = sum(len(r.blob) for r in rows) / ntok
            metrics.WRITTEN_BYTES.labels(kind="learned").inc(written)
            log.info("put_blocks %r of %s: %d records, %d bytes written", req.label, req.model,
                     len(rows), written)  # fmt: skip
            self.learned_stats(self.store.metas(errors=[]))  # gauges
            return written

        written = self.write("put_blocks", job)
        return PutBlocksReply(stored=len(rows), bytes=written)

    def touch_blocks(self, req: TouchBlocksRequest) -> TouchBlocksReply:
        """Records a client restored from the store: used now (the learned LRU evicts the
        least recently used leaves, so a prefix restored every day stays)."""
        touched = self.write("touch_blocks", lambda: self.blocks.touch(req.keys))
        return TouchBlocksReply(touched=touched)

    def after_put(self, meta: EntryMeta) -> None:
        """On the writer thread after an entry was stored: a learned snapshot counts in the
        daily write budget and keeps at most max_snapshots_per_prefix per chain (the shallowest
        go)."""
        if not is_snapshot(meta):
            metrics.WRITTEN_BYTES.labels(kind="pin").inc(meta.nbytes)
            return
        metrics.WRITTEN_BYTES.labels(kind="learned").inc(meta.nbytes)
        self.blocks.count_written(meta.nbytes)
        log.info("learned snapshot %s: %d tokens, %d bytes written (%s)", meta.key.hex(),
                 meta.ntokens, meta.nbytes, "state only" if meta.extra.kv_layers
                 else "whole cache")  # fmt: skip
        cap = max(1, int(self.settings.max_snapshots_per_prefix))
        same_chain = [
            m
            for m in self.store.metas(meta.fingerprint, errors=[])
            if is_snapshot(m) and (m.tokens.startswith(meta.tokens) or
                                   meta.tokens.startswith(m.tokens))
        ]  # fmt: skip
        same_chain.sort(key=lambda m: m.ntokens, reverse=True)
        # the shallowest go, tombstoned like any eviction: a later miss on one reads `evicted`
        evict(self.budget.home, snapshot_cap(cap), store=self.store, entries=same_chain[cap:])

    def learned_stats(self, metas: list) -> dict[str, Any]:
        summary = learned_summary(self.blocks, metas, self.settings, self._paused)
        metrics.set_learned(summary)
        return summary

    @property
    def paused(self) -> str | None:
        """Why learning was paused at the last look, or None."""
        return self._paused
