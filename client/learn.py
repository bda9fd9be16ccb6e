"""Learned prefixes, the client side: report each request's prompt to the daemon, send the KV it
asks for, and restore from the store on a memory miss.

A `PinnedPromptCache`'s store tier (kvstore.client.persistent.StoreTier: the server's prompt cache
in `kvstore serve`, PersistentPromptCache with `learn=True`) calls in here; nothing here calls the
cache back: what goes into its LRU is returned.

- `Learner.restore` (the cold tier): when the store serves more of the prompt than memory - a
  chain of learned block records (BlockStore.lookup + codec.blocks.assemble), or a stored entry
  that prefixes the request (a pin that left memory, today's clock-bound pin) - the KV is read
  and returned (the caller puts it in the LRU: the next hit is memory) instead of prefilling.
  Whether the store can serve more is answered from an index of what it holds (`StoreIndex`),
  read again only when the store changed: a request memory served reads no store. The records
  read are sent in batches with `touch_blocks` (write-behind), so the learned LRU keeps them.
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

import bisect
import copy
import heapq
import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore import metrics, mlxlm
from kvstore import tokens as tk
from kvstore.client import modelthread
from kvstore.client.fleetcheck import unchecked
from kvstore.client.fleetread import FleetReads
from kvstore.client.writebehind import CLOSE_TIMEOUT, Job, WriteBehind, store_entry
from kvstore.codec import cache_api
from kvstore.degrade import serve_hook
from kvstore.errors import KVStoreError
from kvstore.identity.model import model_name
from kvstore.wire.messages import LearnRequest, PutBlocksRequest, Record, TouchBlocksRequest

log = logging.getLogger("kvstore.client")

FRAME_BYTES = 32 * 2**20  # record blobs per put_blocks request, at most (one frame each)
PENDING_PROMPTS = 8  # prompts fetched and not yet inserted (batched requests interleave)
BOUNDARIES = 64  # snapshot boundaries remembered per model
PROMPT_ENDS = 32  # recent whole prompts remembered per model (state layouts: turn-end snapshots)
RESTORE_MIN_GAIN = 16  # tokens the store must serve beyond memory to be worth a read
REOPEN_S = 5.0  # seconds between attempts to open a store that is not there yet
LEARN_QUEUE = 16  # learn jobs waiting for the worker; more are dropped (never block a request)
CORRUPT_PREFIXES = 64  # prefixes a corrupt learned record cut short, remembered (reasons)
INDEX_COST_SHARE = 50  # the request path reads the store's index at most 1/50 of its time
TOUCH_BATCH_S = 5.0  # seconds between batches of restored records' keys sent (touch_blocks)
# state layouts: a learned boundary stores only the state layers; the KV layers are records
STATE_ONLY_SNAPSHOTS = True
# kvstore serve's start: the most recently used learned chains put into memory (Learner.warm)
WARM_CHAINS = 8
WARM_CHAIN_BYTES = 256 * 2**20  # 256 MiB of their KV in all, at most


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
    fleet: int = 0  # of its tokens, read through from the fleet (kvstore.client.fleetread)


SAID_CORRUPT: set[bytes] = set()  # learned records this process said are corrupt (once each)


@dataclass
class StoreIndex:
    """What the store holds of one model, read in one pass: its learned chains (the packed token
    ids from position 0 to each chain's end, kvstore.tokens; sorted, none a prefix of another)
    and the token ids of its entries. Valid while the store's last committed transaction is
    `change`: a request memory served is then answered from here, without reading the store.
    Packed, a learned token costs 4 bytes here (as tuples of ints it cost ~36: serve grew with
    every chain the daemon learned, issue 34 item 6), and a request looks it up by bisection."""

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


def leaf_chains(packed: Sequence[bytes]) -> list[bytes]:
    """Packed chains, sorted, without those another one extends (in sorted order, a chain's
    extensions follow it: the next one says)."""
    chains = sorted(packed)
    return [c for c, after in zip(chains, [*chains[1:], b""][: len(chains)], strict=True)
            if not after.startswith(c)]  # fmt: skip


class _Record:
    """One learned record as `LearnedChains` keeps it: where it starts and ends, the record it
    follows and its own tokens (packed), not its KV. Unreadable: start and end -1."""

    __slots__ = ("end", "last_used", "parent", "start", "tokens")

    def __init__(self, parent: bytes, meta: Any):
        self.parent = parent
        self.start: int = meta.start if meta is not None else -1
        self.end: int = meta.end if meta is not None else -1
        self.tokens: bytes = meta.tokens if meta is not None else b""
        self.last_used: float = meta.last_used if meta is not None else 0.0


class LearnedChains:
    """One model's learned records as the store holds them, read incrementally: `update` walks
    the model's `kids` rows (keys only, nothing decoded), decodes the metas of the records that
    appeared since it last ran and forgets those that left. A change to the store costs what
    changed, not a read of every learned record: serve read them all on each change, twice (the
    cold tier's index and the reasons' learned prefixes), transient peaks that grew with the
    store and fragmented the heap (issue 34 item 6, docs/soak.md).

    Kept: each record's own tokens (4 bytes a token: the learned budget bounds them) and the
    chains (`chains`: the packed token ids from position 0 to each record nothing extends,
    sorted, none a prefix of another, as `leaf_chains` keeps them; a new list on each change,
    so a reader on another thread sees one or the other). A chain that ends off a block
    boundary (a prompt's end) inside a record of another is left out while that one is there. A
    record's `last_used` is what it had when first read (later touches are not read again): the
    reasons' most recently used prefixes are the most recently learned ones."""

    def __init__(self, fingerprint: bytes):
        self.fingerprint = fingerprint
        self.records: dict[bytes, _Record] = {}
        self.kids: dict[bytes, int] = {}  # record (or root) key -> records known that follow it
        self._off: dict[bytes, set[bytes]] = {}  # parent -> its records that end off a block
        self.chains: list[bytes] = []
        self.change = -1  # the store's last transaction id when last read
        self.version = 0  # changes seen
        self.block = 0  # the store's block_tokens
        self.decoded = 0  # record metas decoded, in all (what a test counts)
        self._lock = threading.Lock()
        self._cut: dict[bytes, bytes] = {}  # `prefixes` last given, by end record (reused)

    def update(self, blocks: Any) -> bool:
        """Read what changed in `blocks` (a BlockStore of an open Store) since the last update;
        whether the records changed."""
        with self._lock:
            change = blocks.changes()
            if change == self.change or not blocks.opened():
                return False
            with blocks.store.reading() as txn:
                added, removed = self._diff(blocks, txn)
                metas = [(parent, key, blocks.meta_in(txn, key)) for parent, key in added]
                self.block = blocks.block_tokens(txn)
            self.decoded += len(metas)
            self.change = change
            if not added and not removed:
                return False
            chains = self.chains.copy()
            self._remove(removed, chains)
            self._add(metas, chains)
            self.chains = chains
            self.version += 1
            return True

    def _diff(self, blocks: Any, txn: Any) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
        """(parent, key) of the records the store holds that are not known, and the keys of
        known records it no longer holds."""
        now = blocks.links(txn, self.fingerprint)
        records = self.records
        added = [(parent, key) for key, parent in now.items() if key not in records]
        removed = []
        if len(now) - len(added) < len(records):  # some left: which
            removed = [k for k, rec in records.items() if now.get(k) != rec.parent]
        return added, removed

    def _prefix(self, key: bytes) -> bytes:
        """The packed tokens from position 0 to the end of record `key` (b"": a record on the
        way is missing or unreadable)."""
        parts = []
        rec = self.records.get(key)
        while rec is not None and rec.start >= 0:
            parts.append(rec.tokens)
            if rec.start == 0:
                return b"".join(reversed(parts))
            up = self.records.get(rec.parent)
            rec = up if up is not None and up.end == rec.start else None
        return b""

    def _remove(self, removed: list[bytes], chains: list[bytes]) -> None:
        for key in removed:  # every chain first: a removed record may be on the way of another
            _discard(chains, self._prefix(key))
        parents = []
        for key in removed:
            rec = self.records.pop(key)
            self.kids.pop(key, None)
            self._cut.pop(key, None)
            off = self._off.get(rec.parent)
            if off is not None:
                off.discard(key)
                if not off:
                    del self._off[rec.parent]
                parents.append(rec.parent)  # a chain it held inside may be an end again
            n = self.kids.get(rec.parent, 0) - 1
            if n > 0:
                self.kids[rec.parent] = n
            else:
                self.kids.pop(rec.parent, None)
                parents.append(rec.parent)
        for key in parents:  # nothing follows them now: ends of chains
            if key in self.records and key not in self.kids:
                _insert(chains, self._prefix(key))
            for end in self._off.get(key, ()):
                if end not in self.kids:
                    _insert(chains, self._prefix(end))

    def _add(self, metas: list[tuple[bytes, bytes, Any]], chains: list[bytes]) -> None:
        metas.sort(key=lambda m: m[2].start if m[2] is not None else 0)  # parents first
        for parent, key, meta in metas:
            self.records[key] = rec = _Record(parent, meta)
            if self.block and rec.end % self.block:
                self._off.setdefault(parent, set()).add(key)
            was = self.kids.get(parent, 0)
            self.kids[parent] = was + 1
            if not was and parent in self.records:  # its chain goes on in this one
                _discard(chains, self._prefix(parent))
        for _, key, _ in metas:
            if key not in self.kids:
                _insert(chains, self._prefix(key))

    def prefixes(self, *, max_tokens: int, limit: int) -> list[tuple[bytes, int]]:
        """As BlockStore.learned_prefixes says them, from what is known (nothing read): the most
        recently learned `limit` learned prefixes (a record that ends off a block boundary, or
        that nothing follows), each cut at `max_tokens`, with its stored length. The cut
        prefixes of those given last time are given again (the same objects)."""
        with self._lock:
            block = self.block or 1
            ends = heapq.nlargest(
                limit,
                ((r.last_used, k) for k, r in self.records.items()
                 if r.start >= 0 and (r.end % block or k not in self.kids)),
            )  # fmt: skip
            out, cut = [], {}
            for _, key in ends:
                got = self._cut.get(key)
                if got is None:
                    got = tk.cut(self._prefix(key), 0, max_tokens)
                if got:
                    cut[key] = got
                    out.append((got, self.records[key].end))
            self._cut = cut
            return out


def _discard(chains: list[bytes], chain: bytes) -> None:
    i = bisect.bisect_left(chains, chain)
    if chain and i < len(chains) and chains[i] == chain:
        del chains[i]


def _insert(chains: list[bytes], chain: bytes) -> None:
    """Put `chain` in sorted `chains` unless one there extends it (it would follow it); one it
    extends (it would precede it) goes (as `leaf_chains` leaves them)."""
    i = bisect.bisect_left(chains, chain)
    if not chain or (i < len(chains) and chains[i].startswith(chain)):
        return
    if i and chain.startswith(chains[i - 1]):
        chains[i - 1] = chain
    else:
        chains.insert(i, chain)


_VIEWS: weakref.WeakValueDictionary[tuple[str, bytes], LearnedChains] = (
    weakref.WeakValueDictionary()
)
_VIEWS_LOCK = threading.Lock()


def learned_chains(home: Path, fingerprint: bytes) -> LearnedChains:
    """The process's `LearnedChains` of this home's model (one, shared by the cold tier and the
    reasons' reader while either holds it)."""
    key = (str(home), bytes(fingerprint))
    with _VIEWS_LOCK:
        view = _VIEWS.get(key)
        if view is None:
            view = _VIEWS[key] = LearnedChains(bytes(fingerprint))
        return view


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
        which records came and went walks every record of the model (15 ms at 13,000 records,
        issue 34 item 6): the timer reads it every HIT_BATCH_S, the request path then at most
        1 part in INDEX_COST_SHARE of its time. A stale index only costs a restore: the records
        it names are read from the store, and a newer record waits for the next read."""
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
                        prompt_end=meta.extra.get("prompt_end") is True)  # fmt: skip


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
        # chains `warm` read at start that no request used yet: (tokens, their records' keys)
        self._warmed: dict[Any, list[tuple[tuple[int, ...], list[bytes]]]] = {}
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

    def warm(self, model: Any) -> list[tuple[list[int], list]]:
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
            for tokens in self.cold.recent_chains(target, WARM_CHAINS, WARM_CHAIN_BYTES):
                # one token more than the chain, so that the store serves the whole chain (a
                # restore leaves the prompt's last token to prefill)
                hit = self.cold.restore(target, [*tokens, 0], 0)
                if hit is not None and hit.n == len(tokens):
                    out.append((tokens, hit.cache))
                    self._warmed.setdefault(model, []).append((tuple(tokens), hit.keys))
        return out

    def fetched(self, model: Any, tokens: Sequence[int]) -> None:
        """Remember the prompt of a request about to run: its insert_cache reports it."""
        if self._warmed.get(model):
            self._use_warmed(model, tokens)
        if self.learn and model in self.targets:
            self._pending.append((model, list(tokens)))

    def _use_warmed(self, model: Any, tokens: Sequence[int]) -> None:
        """The first request that continues a chain `warm` read: its records are touched, as a
        restore on that request's path would have touched them (the learned LRU keeps them)."""
        chains, target = self._warmed[model], self.targets.get(model)
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
            self.writer.submit(Job(f"{len(keys)} learned record hits", self._toucher(fp, keys)))

    def _toucher(self, fingerprint: bytes, keys: list[bytes]) -> Callable[[Any], None]:
        """The write-behind job's work: touch these records of `fingerprint`."""
        return lambda client: self._touch(client, fingerprint, keys)

    def _touch(self, client: Any, fingerprint: bytes, keys: list[bytes]) -> None:
        client.send(TouchBlocksRequest(fingerprint, keys))

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
