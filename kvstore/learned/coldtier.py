"""The store as the cold tier of a running process's prompt cache: on a memory miss, the KV of the
longest prefix of the request the store holds beyond what memory served - a chain of learned block
records (BlockStore.lookup + records.assemble) or a stored entry that prefixes the request (a pin
that left memory, today's clock-bound pin) - is read and returned (`Restored`), for the caller to
put in its LRU, instead of prefilling. Whether the store can serve more is answered from an index
of what it holds (`StoreIndex`), read again only when the store changed: a request memory served
reads no store. One read-only Store per process, opened lazily; any failure is a prefill, never a
failed request.

`LearnTarget` is what learning and restoring need about one served model; the client's learner
(kvstore.client.learn) and store tier call in here, and nothing here calls them back."""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore import tokens as tk
from kvstore.errors import KVStoreError
from kvstore.identity.model import model_name
from kvstore.learned.index import learned_chains
from kvstore.store.entry import unchecked

# the client's logger: the cold tier runs in the client's process (serve, the library)
log = logging.getLogger("kvstore.client")

RESTORE_MIN_GAIN = 16  # tokens the store must serve beyond memory to be worth a read
REOPEN_S = 5.0  # seconds between attempts to open a store that is not there yet
CORRUPT_PREFIXES = 64  # prefixes a corrupt learned record cut short, remembered (reasons)
INDEX_COST_SHARE = 50  # the request path reads the store's index at most 1/50 of its time


@dataclass
class StoreIndex:
    """What the store holds of one model, read in one pass: its learned chains (the packed token
    ids from position 0 to each chain's end, kvstore.tokens; sorted, none a prefix of another)
    and the token ids of its entries. Valid while the store's last committed transaction is
    `change`: a request memory served is then answered from here, without reading the store.
    It lives as long as the process and holds every learned chain, so a token costs 4 bytes here
    (packed, not a tuple of ints), and a request looks it up by bisection."""

    change: int
    chains: list[bytes]
    entries: list[tuple[tuple[int, ...], Any]]  # (token ids, EntryMeta)
    read_at: float = 0.0  # time.monotonic() when read
    cost: float = 0.0  # seconds the read took

    def may_serve(self, tokens: Sequence[int], served: int) -> bool:
        """Whether the store may serve more of `tokens` than memory's `served`: a chain that
        shares RESTORE_MIN_GAIN more tokens with them, or an entry that prefixes them past
        `served`."""
        need = served + RESTORE_MIN_GAIN
        if len(tokens) >= need:
            head = tk.pack(tokens[:need])  # the chains extending it follow it in sorted order
            i = bisect.bisect_left(self.chains, head)
            if i < len(self.chains) and self.chains[i].startswith(head):
                return True
        n = len(tokens)
        return any(
            served < len(t) < n and t[-1] == tokens[len(t) - 1] and t == tuple(tokens[: len(t)])
            for t, _ in self.entries
        )


@dataclass
class LearnTarget:
    """What learning and restoring need about one served model (one model key of the LRU)."""

    fingerprint: bytes
    model: str  # the model path, as entries record it
    model_obj: Any  # the loaded model: a template cache and the split's prefill
    extra: dict  # identity fields as `put` records them (adapter, kv_bits, ..., runtime)
    label: str = "learned"
    kv_bits: int | None = None
    prefill_step: int = 2048
    files_ok: Callable[[], bool] | None = None  # False: the weights changed; store nothing
    template_hash: bytes | None = None  # computed on the worker when first needed
    sliceable: bool | None = None  # the layout can be cut into block records
    identity: Any = None  # the served model's ModelIdentity (serve persists system prefixes)

    def __post_init__(self) -> None:
        self.model = model_name(self.model)  # learned records are stored under the one name

    def template(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model_obj)

    def is_sliceable(self) -> bool:
        if self.sliceable is None:
            try:
                from kvstore.learned.records import sliceable

                template = self.template()
                # a sliding window wraps past its size: then it keeps only a final window, a
                # state like an SSM's (its other layers still go as records)
                self.sliceable = bool(sliceable(template)) and not any(
                    type(c).__name__ == "RotatingKVCache" for c in template
                )
            except ImportError:  # a core without block records: entries only
                self.sliceable = False
        return self.sliceable


def fingerprint_parts(extra: dict) -> dict:
    """The fingerprint's parts an entry's extra carries (what a later `model_changed` names)."""
    parts = extra.get("fingerprint_parts")
    return {"fingerprint_parts": parts} if isinstance(parts, dict) else {}


@dataclass
class Restored:
    cache: list
    n: int  # tokens of the request it serves
    nbytes: int
    what: str  # "3 records", "entry 'classify'"
    keys: list[bytes] = field(default_factory=list)  # the records read: used now (touch_blocks)
    prompt_end: bool = False  # a snapshot of a request's whole prompt (a chat turn's end)
    fleet: int = 0  # of its tokens, read through from the fleet (kvstore.fleet.reads)


SAID_CORRUPT: set[bytes] = set()  # learned records this process said are corrupt (once each)


@dataclass
class ColdTier:
    """The store as the second tier of an LRU: one read-only Store per process, opened lazily."""

    home: Path
    _store: Any = None
    _blocks: Any = None
    _tried: float = -1e9
    _index: dict = field(default_factory=dict)  # fingerprint -> StoreIndex
    _chains: dict = field(default_factory=dict)  # fingerprint -> LearnedChains
    _warned: bool = False
    # prefixes a corrupt record would have served: (tokens, what) (kvstore.reasons' `corrupt`)
    corrupt: deque = field(default_factory=lambda: deque(maxlen=CORRUPT_PREFIXES))

    def _open(self) -> bool:
        if self._store is not None:
            return True
        now = time.monotonic()
        if now - self._tried < REOPEN_S:
            return False
        self._tried = now
        from kvstore.store.store import Store

        try:
            self._store = Store(self.home, readonly=True)
        except (KVStoreError, OSError) as e:  # no store yet: the daemon has not made one
            log.debug("kvstore: no store to restore from yet: %s", e)
            return False
        import lmdb

        try:
            from kvstore.learned.blockstore import BlockStore

            self._blocks = BlockStore(self._store)
        except ImportError:  # a core without block records: entries only
            self._blocks = None
        except (KVStoreError, lmdb.Error) as e:  # an older store without the record DBs
            log.debug("kvstore: no block records in %s: %s", self.home, e)
            self._blocks = None
        return True

    def blocks(self) -> Any:
        """The store's learned-block tables (a BlockStore), or None (no store, or none in it)."""
        return self._blocks if self._open() else None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        self._blocks, self._index, self._chains = None, {}, {}

    def index(self, target: LearnTarget, *, timer: bool = False) -> StoreIndex:
        """What the store holds of `target`'s model, read again only when the store changed
        since (its last transaction id, read without a transaction): its learned chains read
        incrementally (LearnedChains), its entries again. On the request path (not `timer`) an
        index is read again only once INDEX_COST_SHARE of the time since it was read covers
        what reading it cost: a learning serve changes the store every request, and reading
        which records came and went walks every record of the model: the timer reads it every
        HIT_BATCH_S, the request path then at most 1 part in INDEX_COST_SHARE of its time. A
        stale index only costs a restore: the records it names are read from the store, and a
        newer record waits for the next read."""
        change = int(self._store.env.info()["last_txnid"])
        index = self._index.get(target.fingerprint)
        if (
            index is None
            or index.change != change
            and (timer or time.monotonic() - index.read_at >= INDEX_COST_SHARE * index.cost)
        ):
            index = self._read_index(target, change)
            self._index[target.fingerprint] = index
        return index

    def _read_index(self, target: LearnTarget, change: int) -> StoreIndex:
        t0 = time.monotonic()
        chains: list[bytes] = []
        if self._blocks is not None and target.is_sliceable():
            view = self._chains.get(target.fingerprint)
            if view is None:
                view = self._chains[target.fingerprint] = learned_chains(
                    self.home, target.fingerprint
                )
            view.update(self._blocks)
            chains = view.chains
        metas = self._store.metas(target.fingerprint, errors=[])
        entries = [(tuple(m.token_ids()), m) for m in metas if not unchecked(m)]
        now = time.monotonic()
        return StoreIndex(change, chains, entries, now, now - t0)

    def refresh(self, targets: Sequence[LearnTarget]) -> None:
        """Read the index again where the store changed (off the request path: a timer)."""
        if self._store is None:
            return
        for target in targets:
            try:
                self.index(target, timer=True)
            except (KVStoreError, OSError) as e:
                log.debug("kvstore: store index not read: %s", e)

    def restore(self, target: LearnTarget, tokens: Sequence[int], served: int) -> Restored | None:
        """The store's KV of the longest prefix of `tokens` it holds beyond `served` (at most
        len(tokens) - 1: mlx-lm leaves a token to prefill), or None."""
        if len(tokens) - 1 - served < RESTORE_MIN_GAIN or not self._open():
            return None
        try:
            index = self.index(target)
            if not index.may_serve(tokens, served):
                return None
            hit = None
            if self._blocks is not None and target.is_sliceable():
                hit = self._from_records(target, tokens, served)
            best = hit.n if hit is not None else served
            entry = self._from_entries(index, target, tokens, best)
            return entry or hit
        except (KVStoreError, OSError, ValueError) as e:  # never fail a request: prefill instead
            if not self._warned:
                self._warned = True
                log.warning("kvstore: not restoring from the store (prefilling instead): %s", e)
            return None

    def _from_records(self, target: LearnTarget, tokens: Sequence[int], served: int):
        from kvstore.learned.records import assemble

        corrupt: list = []  # CorruptEntryError of records the lookup or the read passed over
        chain = self._blocks.lookup(target.fingerprint, tokens, corrupt=corrupt)
        n = min(self._blocks.served(chain, tokens), len(tokens) - 1)
        if n - served < RESTORE_MIN_GAIN:
            self._say_corrupt(corrupt, target, chain, tokens[:n])
            return None
        chain = [m for m in chain if m.start < n]
        blobs = self._blocks.read_blobs(chain, corrupt=corrupt)
        self._say_corrupt(corrupt, target, chain, tokens[:n])
        if len(blobs) < len(chain):  # a corrupt or vanished record: serve the ones before it
            chain = chain[: len(blobs)]
            if not chain:
                return None
            n = chain[-1].end
            if n - served < RESTORE_MIN_GAIN:
                return None
        cache = assemble(blobs, chain, n, target.template())
        return Restored(cache, n, sum(len(b) for b in blobs), f"{len(chain)} records",
                         [m.key for m in chain])  # fmt: skip

    def _say_corrupt(
        self, corrupt: list, target: LearnTarget, chain: list, would: Sequence[int]
    ) -> None:
        """Once per record per process: a corrupt learned record ends a chain (the tokens after
        it are prefilled); `kvstore verify --repair` drops it. `would`: what the chain would
        have served (a request that holds it reads `corrupt` for the tokens it lost)."""
        for e in corrupt:
            at = next((m for m in chain if m.key == e.key), None)
            lost = (tuple(would), f"learned record {e.key.hex()[-8:]}")
            if at is not None and would and lost not in self.corrupt:
                self.corrupt.append(lost)
            if e.key in SAID_CORRUPT:
                continue
            SAID_CORRUPT.add(e.key)
            log.warning(
                "kvstore: learned record %s%s of %s is corrupt (%s); its chain is served up to "
                "it and the rest prefilled (`kvstore verify --repair` drops it)", e.key.hex(),
                f" at tokens {at.start}-{at.end}" if at is not None else "", target.model,
                e.reason,
            )  # fmt: skip

    def recent_chains(self, target: LearnTarget, limit: int, max_bytes: int) -> list[list[int]]:
        """The token ids of this model's learned chains (records from position 0 to one that
        nothing extends), most recently used first, up to `limit` of them and `max_bytes` of
        KV in all."""
        if not self._open() or self._blocks is None:
            return []
        from kvstore.store.entry import unpack_tokens

        fp = target.fingerprint
        extended = self._blocks.extended()
        ends = [m for m in self._blocks.records() if m.key.startswith(fp) and m.key not in extended]
        out: list[list[int]] = []
        total = 0
        for end in sorted(ends, key=lambda m: m.last_used, reverse=True)[:limit]:
            try:
                chain = self._blocks.chain_to(end.key)
            except KVStoreError:  # a record on the way is gone: a request prefills that part
                continue
            nbytes = sum(m.nbytes for m in chain)
            if total + nbytes > max_bytes:
                continue
            total += nbytes
            out.append(unpack_tokens(b"".join(m.tokens for m in chain)))
        return out

    def _from_entries(
        self, index: StoreIndex, target: LearnTarget, tokens: Sequence[int], served: int
    ) -> Restored | None:
        best = None
        for t, meta in index.entries:
            if served < len(t) < len(tokens) and (best is None or len(t) > len(best[0])):
                if t[-1] == tokens[len(t) - 1] and t == tuple(tokens[: len(t)]):
                    best = (t, meta)
        if best is None:
            return None
        t, meta = best
        try:
            from kvstore.learned.blockstore import load_entry

            _, cache = load_entry(self._store, meta.key, meta.tokens)
        except KeyError:  # evicted since the index was read
            self._index.pop(target.fingerprint, None)
            return None
        return Restored(cache, len(t), meta.nbytes, f"entry {meta.label!r}",
                        prompt_end=meta.extra.prompt_end is True)  # fmt: skip
