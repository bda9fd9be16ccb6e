"""Read-through on a request's miss, the request side: when neither memory nor the local store
serves a prompt's prefix, ask the fleet (kvstore.fleet.readthrough: lookup, cost rule, deadline,
breaker, every object verified), assemble the fetched records with the local ones they extend,
check every fetched record against the model this process holds (kvstore.fleet.check.check_chain
over the assembled cache: decoding steps at positions drawn at random over the whole fetched
stretch, and the first 64 positions re-prefilled where it starts the chain) and serve it; the
records go to the store through the daemon's put_blocks (write-behind: the client never writes
the store; without a daemon nothing is stored).

Called by the learner's restore (kvstore.client.learn) only when at least one whole block of the
prompt is past what memory and the store serve: a pin hit never enters here. Off without a
[remote] table that downloads, and without a fleet key on this box (what the request path serves
from the bucket is always authenticated): said once. A refusal (MAC, quarantine, a record
another model computed) is logged once per cause, and the request prefills.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvstore import metrics
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from kvstore.fleet.objects import VerifiedRecord
    from kvstore.fleet.readthrough import ReadThrough

log = logging.getLogger("kvstore.client")

QUARANTINE_S = 60.0  # seconds between reads of this home's quarantined uploaders
FRAME_BYTES = 32 * 2**20  # record blobs per put_blocks request, at most
TOTALS_S = 5.0  # seconds between writes of this process's totals (`kvstore remote status`)
RATE_S = 5.0  # seconds between reads of the ledger while it has no prefill rate for a model


class Sender(Protocol):
    """Where the request side sends the daemon its verdicts and the fetched records, off the
    request path (the client's write-behind queue)."""

    def send(self, what: str, request: Any) -> bool: ...


class FleetReads:
    """One process's read-through: opened at the first miss that may use it (no I/O before)."""

    def __init__(self, home: Path, writer: Sender):
        self.home = Path(home)
        self.writer = writer
        self.on = True  # False once found off (no [remote], no download, no fleet key)
        self.reader: ReadThrough | None = None
        self._rates: dict[str, float | None] = {}  # model -> prefill tokens/s on this box
        self._rates_read: dict[str, float] = {}  # model -> when the ledger was last read for it
        self._quarantined: dict[str, str] = {}
        self._quarantine_read = -1e9
        self._said: set[str] = set()
        self.block = 256  # block_tokens, where the home has no store to read it from yet
        self._written = time.monotonic()

    def _open(self) -> ReadThrough | None:
        if self.reader is not None or not self.on:
            return self.reader
        from kvstore.fleet.objects import Remote
        from kvstore.fleet.readthrough import ReadThrough
        from kvstore.fleet.remote_settings import remote_settings
        from kvstore.home.settings import load_settings

        self.on = False
        try:
            settings = load_settings(self.home)
            rs = remote_settings(settings, self.home)
            if rs is None or not rs.download:
                return None
            if not rs.fleet_keys:
                log.warning("kvstore: fleet read-through off: no fleet_key on this box (what a "
                            "request is served from the bucket must be authenticated; `kvstore "
                            "remote key new`)")  # fmt: skip
                return None
            if isinstance(block := settings.block_tokens, int) and block > 0:
                self.block = block
            self.reader = ReadThrough(Remote(rs), quarantined=self.quarantined)
        except KVStoreError as e:
            log.warning("kvstore: fleet read-through off: %s", e)
            return None
        self.on = True
        return self.reader

    def quarantined(self) -> dict[str, str]:
        """This home's quarantined uploaders (kvstore.fleet.queue), read at most every
        QUARANTINE_S."""
        now = time.monotonic()
        if now - self._quarantine_read >= QUARANTINE_S:
            from kvstore.fleet.queue import UploadQueue

            self._quarantine_read = now
            try:
                queue = UploadQueue(self.home)
                try:
                    self._quarantined = queue.quarantined()
                finally:
                    queue.close()
            except KVStoreError as e:
                log.debug("kvstore: quarantined uploaders not read: %s", e)
        return self._quarantined

    def prefill_rate(self, model: str) -> float | None:
        """Tokens a second this box prefills `model` at: the ledger's, else its own checks'. A
        fresh home's ledger has none at the first ask: it is read again (every RATE_S) until it
        has, so a long-running server's cost rule and deadline learn its own prefills."""
        now = time.monotonic()
        if self._rates.get(model) is None and now - self._rates_read.get(model, -1e9) >= RATE_S:
            from kvstore.fleet.fetch import ledger_rate
            from kvstore.home.ledger import Ledger

            self._rates_read[model] = now
            self._rates[model] = ledger_rate(Ledger(self.home), model)
        return self._rates.get(model)

    def restore(
        self, target: Any, tokens: Sequence[int], served: int, local: Any, cold: Any
    ) -> dict[str, Any] | None:
        """The KV of the longest prefix of `tokens` the fleet holds past `served` (memory) and
        `local` (the store's restore), checked and assembled, as the fields of the learner's
        Restored (`target`, `local`, `cold`: kvstore.learned.coldtier's LearnTarget, Restored and
        ColdTier); None: the request prefills."""
        if target.kv_bits is not None or not target.is_sliceable() or self._open() is None:
            return None
        assert self.reader is not None
        from kvstore.fleet.readthrough import Ask

        blocks = cold.blocks()  # None: no store here yet (nothing local to extend)
        # the store's cut, else the settings' (a store with no record yet answers its default)
        cut = blocks.cut_at() if blocks is not None else self.block
        block = cut if blocks is None or cut != blocks.block else self.block
        chain = blocks.lookup(target.fingerprint, tokens) if blocks is not None else []
        chain = [m for m in chain if m.end <= len(tokens)
                 and tuple(tokens[m.start : m.end]) == _ids(m.tokens)]  # fmt: skip
        have = frozenset({0, *(m.end for m in chain)})
        best = max(served, local.n if local is not None else 0)
        ask = Ask(target.fingerprint, tokens, block, have, best, self.prefill_rate(target.model))
        try:
            got = self.reader.read(ask)
            hit = None if got is None else self._serve(target, tokens, chain, cold, *got)
            if got is not None and hit is None:
                self.reader.not_used(ask)
            return hit  # its "fleet" tokens reach the call's record through the store tier
        except (KVStoreError, OSError, ValueError) as e:  # never fail a request: prefill
            if "failed" not in self._said:
                self._said.add("failed")
                log.warning("kvstore: fleet read-through failed (the request prefills): %s", e)
            return None
        finally:
            if time.monotonic() - self._written >= TOTALS_S:
                self.write_totals()

    def write_totals(self) -> None:
        """This process's read-through totals for `kvstore remote status` (one small file)."""
        if self.reader is None:
            return
        self._written = time.monotonic()
        try:
            self.reader.tally.write(self.home, self.reader.breaker.state)
        except OSError as e:
            log.debug("kvstore: fleet read-through totals not written: %s", e)

    def _serve(
        self, target: Any, tokens: Sequence[int], chain: list, cold: Any,
        fetched: list[VerifiedRecord], n: int,
    ) -> dict[str, Any] | None:  # fmt: skip
        from kvstore.learned.records import assemble

        start = fetched[0].meta.start
        local = [m for m in chain if m.end <= start]
        blobs = cold.blocks().read_blobs(local) if local else []
        if len(blobs) < len(local):  # evicted or corrupt since the lookup: prefill
            return None
        metas = local + [v.meta for v in fetched]
        cache = assemble([*blobs, *(bytes(v.blob) for v in fetched)], metas, n, target.template())
        if not self._checked(target, tokens[:n], cache, fetched):
            return None
        self._store(target, tokens[:n], fetched)
        metrics.PROMPT_TOKENS.labels(source="fleet")  # shown before counted
        nbytes = sum(len(b) for b in blobs) + sum(len(v.blob) for v in fetched)
        uploaders = sorted({v.provenance.box for v in fetched})
        log.info("kvstore: %d tokens of a request fetched from the fleet (%d records from %s)",
                 n - start, len(fetched), ", ".join(uploaders))  # fmt: skip
        return {"cache": cache, "n": n, "nbytes": nbytes, "keys": [m.key for m in local],
                "what": f"{len(fetched)} records from the fleet", "fleet": n - start}  # fmt: skip

    def _checked(
        self, target: Any, tokens: Sequence[int], cache: list, fetched: list[VerifiedRecord]
    ) -> bool:
        """Every fetched record against this process's model (kvstore.fleet.check.check_chain
        over the assembled `cache` of `tokens`: the first 64 positions re-prefilled where the
        fetch starts the chain, and decoding steps at positions drawn at random over the whole
        fetched stretch); a mismatch quarantines the uploaders of the fetched records (through
        the daemon's fleet_checked) and the request prefills."""
        from kvstore.fleet.check import Checked, check_chain, request_of
        from kvstore.identity.model import ModelIdentity

        start = fetched[0].meta.start
        ids = list(tokens)
        v = check_chain(target.model_obj, ModelIdentity(target.model), ids, cache, start)
        if v.prefill_seconds > 0 and self._rates.get(target.model) is None:  # no ledger
            self._rates[target.model] = v.prefilled / v.prefill_seconds  # figure: the check's
        if v.ok:
            return True
        metrics.FLEET_REFUSED.labels(reason="mismatch").inc()
        first: dict[str, VerifiedRecord] = {}  # one verdict per uploader: its first record
        for f in fetched:
            first.setdefault(f.provenance.box, f)
        boxes = sorted(first)
        if "mismatch" not in self._said:
            self._said.add("mismatch")
            log.error("kvstore: refused %d learned records [%d, %d) from the fleet: their KV is "
                      "not what this box's model computes (%s); uploader %s quarantined",
                      len(fetched), start, len(ids), v.what, ", ".join(boxes))  # fmt: skip
        req = request_of([Checked(f.meta.key, False, v.what, box, f.meta.label)
                          for box, f in first.items()])  # fmt: skip
        self.writer.send("fleet check verdict", req)
        self._quarantined = {**self._quarantined, **{box: v.what for box in boxes}}
        return False

    def _store(self, target: Any, tokens: Sequence[int], fetched: list) -> None:
        """The fetched records to the store, through the daemon (write-behind)."""
        from kvstore.store.entry import pack_tokens
        from kvstore.wire.messages import PutBlocksRequest, Record

        batch: list[Record] = []
        size = 0
        for v in fetched:
            batch.append(Record(v.meta.start, v.meta.end, bytes(v.blob)))
            size += len(v.blob)
            if size >= FRAME_BYTES or v is fetched[-1]:
                extra = {**target.extra, "origin": "remote", "uploader": v.provenance.box}
                req = PutBlocksRequest(target.fingerprint, pack_tokens(list(tokens[: v.meta.end])),
                                       batch, target.label, target.model, extra)  # fmt: skip
                self.writer.send(f"{len(batch)} records from the fleet", req)
                batch, size = [], 0

    def close(self) -> None:
        if self.reader is not None:
            self.write_totals()
            self.reader.close()


def _ids(packed: bytes) -> tuple[int, ...]:
    from kvstore import tokens as tk

    return tuple(tk.unpack(packed))
