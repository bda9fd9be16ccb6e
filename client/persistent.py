"""The client's prompt cache: mlx-lm's LRUPromptCache with pins, over a store tier.

`PinnedPromptCache` is the one class that overrides `fetch_nearest_cache` and `insert_cache`. Pins
live in the LRU's trie, so a fetch finds them with mlx-lm's own search and copy semantics, but
not in its eviction order or byte count, so the LRU never evicts them. One mlx-lm behaviour needs
undoing: inserting a trimmable cache pops every stored prefix of it, which would drop a pin as
soon as a chained transcript extends it; the insert puts those pins back. What a request asks of
the store - restore a miss, count where its tokens came from, learn, record hits, offer an insert
to be stored - the cache asks of its `StoreTier`, which returns values and never calls the cache
back. KV read from the store (hydrate, a restore, a pin found there) goes in through
`insert_stored`, never through the request path's insert.

`PersistentPromptCache` is that cache for one loaded model in an app: hydrated from the store,
with runtime pins and per-call stats; new pins (and, opt-in, chained transcripts) go to the daemon
through the write-behind queue. `kvstore serve` builds the server's cache with its own tier.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from kvstore import metrics, mlxlm
from kvstore import tokens as token_ids
from kvstore.client.callstats import StatsRecorder, say
from kvstore.client.hydrate import HydrateReport, Prefetched, check_arguments, insert, prefetch
from kvstore.client.learn import Learner
from kvstore.client.writebehind import CLOSE_TIMEOUT, Job, WriteBehind
from kvstore.errors import KVStoreError
from kvstore.identity.model import IdentityKeywords, ModelIdentity
from kvstore.known import after_hydrate
from kvstore.learned.coldtier import LearnTarget
from kvstore.pins.manifest import pin_name_problem
from kvstore.pins.render import RenderedPin, pin_extra
from kvstore.store.entry import unchecked
from kvstore.wire.messages import TouchRequest

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizer
    from typing_extensions import Self, Unpack

    from kvstore.identity.fingerprint import Fingerprint

log = logging.getLogger("kvstore.client")

PIN_TYPE = "system"  # the LRU cache_type pins are filed under (as hydrate files stored entries)
HIT_BATCH_S = 5.0  # seconds between batches of hits sent to the daemon
STORE_PREFIXES = 256  # store-read prefixes remembered for provenance
FETCH_RECORDS = 64  # prompts whose fetch did more than serve from memory, until their call takes it
FETCH_RECORDS_EACH = 4  # records kept of one prompt (the same prompt fetched again untaken)


@dataclass(frozen=True)
class Pin:
    name: str
    tokens: tuple[int, ...]
    source: str  # where its KV came from: "memory", "store" or "prefill"
    seconds: float  # what pin() took on the caller's thread
    persist_s: float  # of which: handing the cache to the write-behind queue
    queued: bool  # sent towards the daemon to persist
    warning: str | None = None  # the pin misses pinned content, or serves single turns only
    valid_date: str | None = None  # clock-bound: the template prints the date; valid this day


class Provenance:
    """Token prefixes whose KV in memory was read from the store (hydrated or restored).

    A later entry that extends one keeps the prefix, so a fetch served by it still counts the
    store's part as `store` however long it stayed in memory."""

    def __init__(self, cap: int = STORE_PREFIXES):
        self._prefixes: OrderedDict[tuple[Any, tuple[int, ...]], None] = OrderedDict()
        self._cap = cap
        self._lock = threading.Lock()

    def note_store(self, model: Any, tokens: Sequence[int]) -> None:
        with self._lock:
            self._prefixes[(model, tuple(tokens))] = None
            self._prefixes.move_to_end((model, tuple(tokens)))
            while len(self._prefixes) > self._cap:
                self._prefixes.popitem(last=False)

    def store_part(self, model: Any, tokens: Sequence[int], served: int) -> int:
        """How many of the `served` first tokens of `tokens` came from the store."""
        best = 0
        if not served:
            return 0
        with self._lock:
            prefixes = [t for m, t in self._prefixes if m == model]
        for t in prefixes:
            k = min(len(t), served)
            if k > best and t[k - 1] == tokens[k - 1] and t[:k] == tuple(tokens[:k]):
                best = k
        return best

    def count(
        self, model: Any, tokens: Sequence[int], served_mem: int, restored: int, fleet: int = 0
    ) -> None:
        """Add one request to kvstore_prompt_tokens_total (`fleet`: of `restored`, read through
        from the fleet)."""
        if restored:
            store, memory = restored - fleet, 0
        else:
            store = self.store_part(model, tokens, served_mem)
            memory = served_mem - store
        served = restored or served_mem
        metrics.PROMPT_TOKENS.labels(source="store").inc(store)
        metrics.PROMPT_TOKENS.labels(source="memory").inc(memory)
        metrics.PROMPT_TOKENS.labels(source="fleet").inc(fleet)
        metrics.PROMPT_TOKENS.labels(source="prefill").inc(len(tokens) - served)


@dataclass(frozen=True)
class FetchRecord:
    """What one request's fetch did beyond serving from memory, for the call's record: tokens it
    prefilled itself (a learned split: prefill, though mlx-lm counts them as cached) and the
    seconds that took, and tokens of those it served read through from the fleet."""

    split: int = 0
    split_s: float = 0.0
    fleet: int = 0


NO_FETCH = FetchRecord()


# offer(model, tokens, kv, cache_type) -> whether the insert was sent towards the store
OnInsert = Callable[[Any, Sequence[int], list, str], bool]


class RecentPrefixes:
    """A set of token prefixes that keeps the most recently added `cap`: what a process restored
    or offered is remembered for its hits, request after request, never without bound."""

    def __init__(self, cap: int = STORE_PREFIXES):
        self._prefixes: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._cap = cap
        self._lock = threading.Lock()

    def add(self, tokens: tuple[int, ...]) -> None:
        with self._lock:
            self._prefixes[tokens] = None
            self._prefixes.move_to_end(tokens)
            while len(self._prefixes) > self._cap:
                self._prefixes.popitem(last=False)

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        with self._lock:
            return iter(list(self._prefixes))

    def __len__(self) -> int:
        return len(self._prefixes)


class StoreTier:
    """What a prompt cache asks of the store on the request path: restore a miss the store
    serves better (the learner's cold tier), count where a request's tokens came from, learn
    (report the request; send the KV the daemon wants), record hits on stored entries (touch,
    batched through the write-behind), and offer a request's insert to be stored (`on_insert`).

    It returns values and never calls the cache back. `quiet` holds the prompts of requests that
    are restored and served as any other but not counted, reported, hit or kept (`kvstore serve`'s
    warm-up requests, which it adds to and clears); `on_insert` is the library's chain persisting
    or serve's system prompts. Hits are recorded for one model (`serving`): the one whose entries
    the store holds."""

    def __init__(
        self,
        *,
        learner: Learner | None = None,
        writer: WriteBehind | None = None,
        on_insert: OnInsert | None = None,
        quiet: list[tuple[int, ...]] | None = None,
    ):
        self.provenance = Provenance()
        self.learner = learner
        self.writer = writer
        self.on_insert = on_insert
        self.quiet = quiet if quiet is not None else []
        self.model: Any = None  # the model key hits are recorded for
        self.fingerprint: bytes | None = None  # its entries' fingerprint
        self.stored: set[tuple[int, ...]] = set()  # hydrated: token ids the store holds an entry of
        self.restored = RecentPrefixes()  # read back from the store on a miss (learned records)
        self.offered = RecentPrefixes()  # sent towards the store from here
        self._hits: list[tuple[int, ...]] = []  # stored prefixes that served a fetch, unsent
        self._hits_sent = time.monotonic()
        self._said_unstorable = False
        # prompts whose fetch did more than serve from memory -> their FetchRecords, until taken
        self._fetches: OrderedDict[tuple[int, ...], list[FetchRecord]] = OrderedDict()
        self._fetches_lock = threading.Lock()

    def serving(self, model: Any, fingerprint: bytes | None) -> None:
        """Hits are now recorded for `model`, whose entries are filed under `fingerprint`."""
        self.model, self.fingerprint = model, fingerprint
        self.stored, self.restored, self.offered = set(), RecentPrefixes(), RecentPrefixes()

    def is_quiet(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` are a quiet prompt, a segment of it (the batched path inserts the
        system segment) or it and its output."""
        for p in self.quiet:
            n = min(len(p), len(tokens))
            if n and p[n - 1] == tokens[n - 1] and p[:n] == tuple(tokens[:n]):
                return True
        return False

    def storable(self, tokens: Sequence[int]) -> bool:
        """Whether the store can key `tokens`; a prompt with images (mlx_lm.server's negative
        ids) cannot: memory serves it as mlx-lm's cache would, and it is never restored,
        learned or offered; a stored prefix of it that serves it is a hit. Said once a
        process."""
        if token_ids.storable(tokens):
            return True
        if not self._said_unstorable:
            self._said_unstorable = True
            log.info("kvstore: prompts with images are cached in memory only, not in the store "
                     "(their image tokens have no stored form)")  # fmt: skip
        return False

    def note_stored(self, model: Any, tokens: Sequence[int], *, restored: bool = False) -> None:
        """The KV of `tokens` in memory was read from the store (hydrated; or `restored` on a
        request's miss, which happens request after request: the most recent STORE_PREFIXES
        are kept): counted as `store` when it serves, and its uses are hits."""
        self.provenance.note_store(model, tokens)
        if restored:
            self.restored.add(tuple(tokens))
        else:
            self.stored.add(tuple(tokens))

    def restore(self, model: Any, tokens: Sequence[int], served: int, *, quiet: bool) -> Any:
        """The learner's restore (a `kvstore.learned.coldtier.Restored`), or None."""
        if self.learner is None:
            return None
        return self.learner.restore(model, tokens, served, used=not quiet)

    def split(
        self, model: Any, tokens: Sequence[int], cache: Any, rest: list
    ) -> tuple[Any, list, list[tuple[list[int], list]]]:
        """The learner's split at a learned boundary (state layouts): (cache, rest, keep)."""
        if self.learner is None:
            return cache, rest, []
        return self.learner.split(model, tokens, cache, rest)

    def served(
        self,
        model: Any,
        tokens: Sequence[int],
        memory: int,
        restored: int,
        served: int,
        fleet: int = 0,
        split: tuple[int, float] = (0, 0.0),
        *,
        learn: bool = True,
    ) -> None:
        """A request's fetch is done: count its tokens by source (`fleet`: of `restored`, read
        through from the fleet), remember its prompt for the learner (unless not `learn`), and
        record a hit on the stored prefix that served it. `split`: (tokens, seconds) the fetch
        prefilled itself (a learned split): prefill, whatever the remainder it hands mlx-lm
        says. The split and the fleet's tokens are the prompt's `FetchRecord` until
        `fetch_record` takes it."""
        self.provenance.count(model, tokens, memory, restored, fleet)
        if split[0] > 0 or fleet > 0:
            self._keep(tuple(tokens), FetchRecord(split[0], split[1], fleet))
        if learn and self.learner is not None:
            self.learner.fetched(model, tokens)
        if served and model == self.model and self.fingerprint is not None:
            self._hit(tokens, served)

    def _keep(self, key: tuple[int, ...], record: FetchRecord) -> None:
        with self._fetches_lock:
            kept = self._fetches.setdefault(key, [])
            kept.append(record)
            del kept[:-FETCH_RECORDS_EACH]
            self._fetches.move_to_end(key)
            while len(self._fetches) > FETCH_RECORDS:
                self._fetches.popitem(last=False)

    def fetch_record(self, tokens: Sequence[int]) -> FetchRecord:
        """What this prompt's fetch did beyond memory (the oldest untaken fetch of it), taken
        once: the call's record reads it (the library's stats, serve's usage and line); an
        empty record when there is none."""
        if not self._fetches:
            return NO_FETCH
        key = tuple(tokens)
        with self._fetches_lock:
            kept = self._fetches.get(key)
            if not kept:
                return NO_FETCH
            record = kept.pop(0)
            if not kept:
                del self._fetches[key]
        return record

    def inserted(self, model: Any, tokens: Sequence[int], kv: list, cache_type: str) -> None:
        """A request's insert (its end, or the batched path's system segment)."""
        if self.learner is not None:
            self.learner.inserted(model, tokens, kv)
        if self.on_insert is not None and self.on_insert(model, tokens, kv, cache_type):
            self.offered.add(tuple(tokens))  # stored soon: its later uses are hits

    def _hit(self, tokens: Sequence[int], served: int) -> None:
        """Remember which stored prefix a fetch reused (hits, last_used: the order the daemon's
        budget evicts in), sent every HIT_BATCH_S seconds. A prefix counts whether its stored
        entry or an in-memory transcript extending it served."""
        best = max(
            (t for t in itertools.chain(self.stored, self.restored, self.offered)
             if len(t) <= served and tuple(tokens[: len(t)]) == t),
            key=len,
            default=None,
        )  # fmt: skip
        if best is None:
            return
        self._hits.append(best)
        if time.monotonic() - self._hits_sent >= HIT_BATCH_S:
            self.send_hits()

    def send_hits(self) -> None:
        """Hits on stored entries (touch) and on restored learned records (touch_blocks); their
        keys are made on the write-behind's thread."""
        hits, self._hits, self._hits_sent = self._hits, [], time.monotonic()
        if hits and self.writer is not None and self.fingerprint is not None:
            self.writer.submit(Job(f"{len(hits)} hits", _toucher(self.fingerprint, hits)))
        if self.learner is not None:
            self.learner.send_touched()

    def refresh(self) -> None:
        """Off the request path (a timer): read the store's index again where it changed."""
        if self.learner is not None:
            self.learner.refresh()


def _toucher(fingerprint: bytes, hits: list[tuple[int, ...]]) -> Callable[[Any], Any]:
    def touch(client: Any) -> Any:
        from kvstore.store.entry import entry_key

        return client.send(TouchRequest([entry_key(fingerprint, t) for t in hits]))

    return touch


class PinnedPromptCache(LRUPromptCache):
    """An LRUPromptCache whose pins sit in its trie but outside its eviction order and byte
    count, over a `StoreTier` (restore, count, learn, hits, offer).

    `fetch_nearest_cache` finds pins with mlx-lm's own search and copy semantics; the LRU never
    evicts them, and inserting a trimmable cache that extends a pin (mlx-lm pops every stored
    prefix of it) puts the pin back. PersistentPromptCache and `kvstore serve` keep pins this way.
    """

    def __init__(
        self, max_size: int = 10, max_bytes: int = 1 << 63, *, tier: StoreTier | None = None
    ):
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self.tier = tier if tier is not None else StoreTier()
        self._pins: dict[tuple[Any, tuple[int, ...]], tuple[Any, Any]] = {}  # -> (pin, entry)
        self._to_pin: dict[tuple[Any, tuple[int, ...]], str] = {}  # inserted as pins: -> label

    @property
    def learner(self) -> Learner | None:
        """The store tier's learner (learning and the cold tier), if any."""
        return self.tier.learner

    @learner.setter
    def learner(self, learner: Learner | None) -> None:
        self.tier.learner = learner

    # -- the request path -------------------------------------------------------------------

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        """mlx-lm's fetch; then the store when it serves more (the cold tier), a split at a
        learned boundary (state layouts), and the request's tokens counted by source."""
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and tokens and not rest:
            cache, rest = mlxlm.leave_last_token(self, model, tokens, cache)
        memory = len(tokens) - len(rest)
        quiet = self.tier.is_quiet(tokens)
        if not self.tier.storable(tokens):  # memory only: nothing restored, split or learned
            if not quiet:
                self.tier.served(model, tokens, memory, 0, memory, learn=False)
            return cache, rest
        restored = fleet = 0
        hit = self.tier.restore(model, tokens, memory, quiet=quiet)
        if hit is not None:
            if not quiet:  # in memory now: the next hit is memory's
                self._insert(model, list(tokens[: hit.n]), hit.cache, cache_type="system")
                self.tier.note_stored(model, tokens[: hit.n], restored=True)
            cache, rest, restored = copy.deepcopy(hit.cache), list(tokens[hit.n :]), hit.n
            fleet = hit.fleet
        if quiet:
            return cache, rest
        before, t0 = len(rest), time.perf_counter()
        cache, rest, keep = self.tier.split(model, tokens, cache, rest)
        for t, kv in keep:  # a learned boundary's snapshot, or a turn's state one short of its
            kind = "user" if len(t) == len(tokens) - 1 else "system"  # end (as mlx-lm files it)
            self._insert(model, t, kv, cache_type=kind)
        split = (before - len(rest), time.perf_counter() - t0)  # prefilled here, not served
        self.tier.served(model, tokens, memory, restored, len(tokens) - len(rest), fleet, split)
        return cache, rest

    def fetch_record(self, tokens: Sequence[int]) -> FetchRecord:
        """What this prompt's fetch did beyond memory (`StoreTier.fetch_record`), taken once: the
        tokens it prefilled itself (a learned split: mlx-lm counts them as cached) and those read
        through from the fleet."""
        return self.tier.fetch_record(tokens)

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> bool:
        """A request's insert: mlx-lm's, with pins kept, then the store tier's (learn, offer).
        False (nothing inserted) for a pin's exact tokens or a quiet request's."""
        if self.tier.is_quiet(tokens):
            return False
        label = self._to_pin.pop((model, tuple(tokens)), None)
        if label is not None:
            self.attach_pin(model, tokens, prompt_cache, label)
            return True
        if not self._insert(model, tokens, prompt_cache, cache_type=cache_type):
            return False
        if self.tier.storable(tokens):
            self.tier.inserted(model, tokens, prompt_cache, cache_type)
        return True

    # -- what is not a request --------------------------------------------------------------

    def insert_stored(self, model: Any, tokens: Sequence[int], kv: list) -> bool:
        """KV read from the store (hydrate): kept (as a pin when `keep_pins` named it), counted
        as the store's when it serves, its uses hits; nothing reported or sent."""
        label = self._to_pin.pop((model, tuple(tokens)), None)
        if label is not None:
            self.attach_pin(model, tokens, kv, label)
            inserted = True
        else:
            inserted = self._insert(model, list(tokens), kv, cache_type=PIN_TYPE)
        self.tier.note_stored(model, tokens)
        return inserted

    def _insert(self, model: Any, tokens: list[int], kv: list[Any], *, cache_type: str) -> bool:
        """mlx-lm's insert, with pins kept; False (nothing inserted) for a pin's exact tokens."""
        ident = tuple(tokens)
        if (model, ident) in self._pins:
            return False  # the pin already holds exactly this KV; replacing it would unpin it
        shadowed = []
        if self._pins and can_trim_prompt_cache(kv):
            shadowed = [
                (t, entry)
                for (m, t), (_, entry) in self._pins.items()
                if m == model and len(t) < len(ident) and ident[: len(t)] == t
            ]
        # mlx-lm pops (and un-counts the bytes of) every stored prefix of a trimmable insert. Pins
        # are not in its byte count: count them in first so its budget check sees true numbers.
        for _, entry in shadowed:
            mlxlm.lru_count(self, entry, +1)
        super().insert_cache(model, tokens, kv, cache_type=cache_type)
        for t, entry in shadowed:
            mlxlm.trie_add(self, model, t, entry)
        return True

    # -- pins -------------------------------------------------------------------------------

    def attach_pin(self, model: Any, tokens: Sequence[int], cache: list, pin: Any) -> None:
        """Keep `cache`, the KV of exactly `tokens`, as a pin (`pin` says which, for the owner)."""
        tokens = tuple(tokens)
        entry = mlxlm.cache_entry(cache, sum(c.nbytes for c in cache), PIN_TYPE)
        prev = mlxlm.trie_add(self, model, tokens, entry)
        if prev is not None and (model, tokens) not in self._pins:
            # an LRU entry of the same tokens: take it off the LRU's books
            mlxlm.lru_forget(self, model, tokens, prev)
        self._pins[(model, tokens)] = (pin, entry)

    def keep_pins(self, model: Any, metas: Sequence[Any]) -> None:
        """The next inserts of these entries' tokens become pins. Pins of other models are
        let go (`kvstore serve` holds one model; loading one again hydrates them again)."""
        for m, tokens in [k for k in self._pins if k[0] != model]:
            mlxlm.trie_pop(self, m, tokens)
            del self._pins[(m, tokens)]
        self._to_pin = {(model, tuple(meta.token_ids())): meta.label for meta in metas}

    def pins_of(self, model: Any) -> dict[tuple[int, ...], int]:
        """This model's pins: tokens -> bytes of KV."""
        return {t: entry.nbytes for (m, t), (_, entry) in self._pins.items() if m == model}

    def pin_labels(self, model: Any) -> dict[tuple[int, ...], str]:
        """This model's pins: tokens -> label (what a `diverged` reason names)."""
        return {
            t: str(getattr(pin, "label", None) or getattr(pin, "name", pin))
            for (m, t), (pin, _) in self._pins.items()
            if m == model
        }

    def __len__(self) -> int:
        return mlxlm.lru_len(self) + len(self._pins)

    @property
    def nbytes(self) -> int:
        return mlxlm.lru_nbytes(self) + self.pinned_nbytes

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of the pins' KV: resident whatever the LRU's limits."""
        return sum(entry.nbytes for _, entry in self._pins.values())

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        # what mlx_lm.server logs per request: pins are not in any of the LRU's types
        stats = super().stats_by_type()
        stats["pinned"] = {"n_sequences": len(self._pins), "n_bytes": self.pinned_nbytes}
        return stats


@dataclass(frozen=True)
class CacheOptions:
    """How a PersistentPromptCache keeps, counts and sends KV (its model's identity and home
    apart). Each is also a keyword argument of `PersistentPromptCache.open` and `load`."""

    model_key: Any = None  # the LRU's key of the model; default: the model path
    max_size: int = 10  # LRU entries, pins apart
    max_bytes: int = 1 << 63  # bytes of LRU entries, pins apart
    persist_chains: bool = False  # send chained transcripts to the daemon too
    learn: bool = False  # report prompts; restore from the store on a memory miss
    start_daemon: bool = False  # no daemon holds the home: start one (client/writebehind.py)
    stats: bool = True  # record each call's prefill stats
    verbose: bool | None = None  # print each call's line (None: unless logging shows it)
    chat_template_kwargs: Mapping[str, Any] | None = None  # what the app's requests render with

    @classmethod
    def given(cls, keywords: dict[str, Any], base: CacheOptions | None = None) -> CacheOptions:
        """`base` (default: the defaults) with the options named in `keywords` (taken out of
        it); TypeError for a keyword that is none of them."""
        names = {f.name for f in fields(cls)}
        if unknown := sorted(set(keywords) - names):
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        return replace(base or cls(), **{k: keywords.pop(k) for k in list(keywords)})


class CacheKeywords(IdentityKeywords, total=False):
    """The keyword arguments `PersistentPromptCache.open` and `load` take one by one: the model's
    identity (or the whole `identity`) and the cache's options (CacheOptions' fields)."""

    identity: ModelIdentity
    model_key: Any
    max_size: int
    max_bytes: int
    persist_chains: bool
    learn: bool
    start_daemon: bool
    stats: bool
    verbose: bool | None
    chat_template_kwargs: Mapping[str, Any] | None


# what the constructor takes by keyword (anything else is an earlier checkout's call form)
_INIT_NAMES = frozenset({"model", "tokenizer", "identity", "home", "options", "writer", "stats"})


class PersistentPromptCache(PinnedPromptCache):
    """An LRUPromptCache for one loaded model that survives restarts through the kvstore daemon.

    >>> cache = PersistentPromptCache.open(model, tokenizer, "/models/Qwen3-8B")
    >>> cache.pin("classify", messages=[{"role": "system", "content": ROUTER}])
    >>> text = client.generate(cache, model, tokenizer, prompt, label="classify")

    `open` (or `kvstore.client.load`) makes one: from the model, its tokenizer, its identity (a
    path, or a `ModelIdentity`), the home and `options` (CacheOptions). The keyword rows of both
    are accepted as well (`adapter_path=`, `kv_bits=`, ..., `learn=`, `stats=`, ...): the model
    as loaded (`model_config`: the overrides of `mlx_lm.load(model_config=)`; its own arguments
    are read from `model` either way) and how the cache keeps KV. `open` hydrates the store's
    entries for the model (read then, or `prefetched` by `kvstore.client.load`) and starts the
    write-behind to the daemon. Load it with `kvstore.client.load` and a weight file changed
    since is caught: nothing is hydrated or persisted for that model. A model from plain
    `mlx_lm.load` is compared with its files (a sample of its weights) instead. Before each store
    the files are checked again: KV is filed only under the fingerprint of the weights that
    computed it. Like `hydrate`, `open` never raises for a store problem or a wrong argument
    type: the report holds one warning and the cache works as a plain LRUPromptCache.

    The constructor takes the values the cache holds, already checked and opened (the identity,
    the resolved home, the options, the write-behind and stats recorder, if any) and does no
    I/O: nothing read, no thread started, nothing sent.

    With `learn=True` prompts are reported to the daemon, which learns the prefixes that recur
    (kept in the store as block records or learned entries), and a memory miss the store can
    serve is restored from it instead of prefilled (kvstore.client.learn).
    """

    def __new__(cls, *args: Any, **keywords: Any) -> Self:
        # An earlier checkout's call form, PersistentPromptCache(model, tokenizer, path, ...):
        # one line naming the new one, before anything is built.
        third = args[2] if len(args) > 2 else keywords.get("identity")
        if (third is not None and not isinstance(third, ModelIdentity)) or (
            set(keywords) - _INIT_NAMES
        ):
            raise TypeError(
                "PersistentPromptCache(model, tokenizer, path, ...) is now "
                "PersistentPromptCache.open(model, tokenizer, path, ...) (or kvstore.client.load)"
            )
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizer | TokenizerWrapper,
        identity: ModelIdentity,
        home: Path | None = None,
        options: CacheOptions | None = None,
        *,
        writer: WriteBehind | None = None,
        stats: StatsRecorder | None = None,
    ):
        from kvstore.kvcheck.prefill import model_vocab_size

        self.options = options = options if options is not None else CacheOptions()
        super().__init__(
            options.max_size, options.max_bytes,
            tier=StoreTier(
                writer=writer, on_insert=self._offer_chain if options.persist_chains else None
            ),
        )  # fmt: skip
        self.model, self.tokenizer = model, tokenizer
        self.identity = identity  # the model as its entries are keyed
        self.model_path = str(identity.path)
        self.model_key = self.model_path if options.model_key is None else options.model_key
        # What the app passes to apply_chat_template (as mlx_lm.server --chat-template-args).
        self.chat_template_kwargs = dict(options.chat_template_kwargs or {})
        self.home = home  # None: nothing read or sent (no usable home)
        self._writer = writer
        self.stats = stats
        self.stored_labels: dict[tuple[int, ...], str] = {}  # hydrated entries: tokens -> label
        self.stored_dates: dict[tuple[int, ...], str] = {}  # of those, clock-bound: -> ISO day
        self._fp: Fingerprint | None = None  # with the files it hashed: re-checked before a store
        self._files_warned = False  # the files changed since: said once, nothing stored after
        self._template_hash: bytes | None = None
        self.fingerprint: bytes | None = None
        self.vocab_size = model_vocab_size(model)  # ids the model takes (a prompt's are checked)
        self.report = HydrateReport()
        self._at_exit: Callable[[], None] | None = None

    @classmethod
    def open(
        cls,
        model: nn.Module,
        tokenizer: PreTrainedTokenizer | TokenizerWrapper,
        model_path: str | Path | ModelIdentity,
        *,
        home: str | Path | None = None,
        options: CacheOptions | None = None,
        prefetched: Prefetched | None = None,
        **keywords: Unpack[CacheKeywords],
    ) -> Self:
        """A ready cache: check the arguments, start the write-behind and the stats, hydrate,
        and attach the learner. Never raises for a store problem or a wrong argument."""
        rows: dict[str, Any] = dict(keywords)
        given = ModelIdentity.given(model_path, rows)  # as given: checked here
        identity = rows.pop("identity", None)
        if identity is None:
            identity = model_path if isinstance(model_path, ModelIdentity) else given
        options = CacheOptions.given(rows, options)
        resolved, bad = None, None
        try:
            resolved, identity = check_arguments(identity, home=home)
        except KVStoreError as e:
            bad = f"kvstore: not hydrating or persisting: {e}"
        # no writer (nothing sent anywhere) without a usable home
        writer = (
            WriteBehind(resolved, start_daemon=options.start_daemon)
            if resolved is not None
            else None
        )
        stats = None
        if options.stats:
            stats = StatsRecorder(
                str(identity.path), writer=writer, send=writer is not None, verbose=options.verbose
            )
        cache = cls(model, tokenizer, identity, resolved, options, writer=writer, stats=stats)
        cache._close_at_exit()
        if bad is not None:
            log.warning("%s", bad)
            cache.report = HydrateReport(warning=bad)
        else:
            cache.report = cache._hydrate(prefetched, home)
        if stats is not None:  # what the reasons of prefilled tokens need from it
            after_hydrate(
                stats.attribute, cache.report, cache.home, cache.model_path, cache.stored_dates,
                cache._fp.parts if cache._fp is not None else None, tokenizer,
            )  # fmt: skip
        if options.learn and cache.fingerprint is not None and writer is not None:
            cache._attach_learner()
        return cache

    def _close_at_exit(self) -> None:
        """Unsent stats and pins still reach the daemon when the app exits without close()."""
        ref = weakref.ref(self)

        def at_exit() -> None:
            c = ref()
            if c is not None:
                c.close()

        self._at_exit = at_exit
        atexit.register(at_exit)

    def _hydrate(self, prefetched: Prefetched | None, home: str | Path | None) -> HydrateReport:
        """Insert the stored entries of this model (read now unless `prefetched`); the report."""
        if prefetched is None:  # else read already, while the weights loaded (client.load)
            prefetched = prefetch(self.identity, home=home, model=self.model)
        self._fp = prefetched.fingerprint
        fp = prefetched.report.fingerprint
        self.fingerprint = bytes.fromhex(fp) if fp else None
        self.tier.serving(self.model_key, self.fingerprint)
        # the stored entries a `diverged` reason names (kvstore.reasons)
        self.stored_labels = {tuple(m.token_ids()): m.label for m, _ in prefetched.entries}
        self.stored_dates = {
            tuple(m.token_ids()): m.valid_date for m, _ in prefetched.entries if m.valid_date
        }
        return insert(self, self.model_key, prefetched, model=self.model)

    def _attach_learner(self) -> None:
        """Learn this process's recurring prefixes; restore from the store on a memory miss."""
        from kvstore.identity.codehash import runtime_versions

        if self.home is None or self.fingerprint is None:
            return  # (never: attached only with a usable home and a fingerprint)
        learner = Learner(self.home, writer=self._writer)
        self.tier.learner = learner
        if self.stats is not None:
            self.stats.attribute.learner = learner
        learner.add_target(
            self.model_key,
            LearnTarget(
                fingerprint=self.fingerprint,
                model=self.model_path,
                model_obj=self.model,
                extra={
                    **self.identity.state,
                    "owners": ["app"],
                    "runtime": runtime_versions(),
                    **self._parts(),
                },  # fmt: skip
                kv_bits=self.identity.kv_bits,
                files_ok=self._files_hold_these_weights,
            ),
        )

    @property
    def writer(self) -> WriteBehind | None:
        """The write-behind to the home's daemon (None without a usable home): the cache's own
        writes go through it, and an integration's jobs may too (they run in order)."""
        return self._writer

    @property
    def pins(self) -> dict[str, Pin]:
        return {pin.name: pin for pin, _ in self._pins.values()}

    def pin_labels(self, model: Any) -> dict[tuple[int, ...], str]:
        """The stored entries' labels and this model's pins: tokens -> label."""
        labels = dict(self.stored_labels) if model == self.model_key else {}
        return {**labels, **super().pin_labels(model)}

    def _offer_chain(self, model: Any, tokens: Sequence[int], kv: list, cache_type: str) -> bool:
        """`persist_chains`: a request's transcript of this model goes to the daemon."""
        return model == self.model_key and self._persist(
            list(tokens), kv, label="chain", pinned=False
        )

    # -- pins --------------------------------------------------------------------------------

    def pin(
        self,
        name: str,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tokens: token_ids.TokenIds | None = None,
        tools: Iterable[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Pin:
        """Register a stage prefix that the LRU never evicts: chat `messages` (rendered with the
        stable-boundary rule, optionally with `tools` and the template arguments the app's
        requests use: `chat_template_kwargs`, default the cache's) or exact `tokens` (any
        sequence of ints, a numpy integer array or an mx.array; a bool is not a token id).

        Its KV comes from memory or the store when present; otherwise the loaded model prefills
        it here, once, and the daemon is asked to persist it (off the request path).
        """
        t0 = time.perf_counter()
        if problem := pin_name_problem(name):  # it is the entry's label: one line in ls
            raise ValueError(f"pin name: {problem}")
        if (messages is None) == (tokens is None):
            raise ValueError("pin: give exactly one of messages= or tokens=")
        limit = self._max_pin_tokens()
        warning, extra = None, {}
        if messages is not None:
            kwargs = (
                self.chat_template_kwargs if chat_template_kwargs is None else chat_template_kwargs
            )
            rendered = self._render(name, messages, tools, dict(kwargs), limit)
            given: Any = rendered.tokens
            warning, extra = rendered.warning, pin_extra(rendered, dict(kwargs))
        else:
            given = tokens  # any sequence of ints, a numpy or an mx array
        from kvstore.kvcheck.prefill import check_token_ids, model_vocab_size

        # an id past the embedding would crash the process in mlx, not raise
        ids = check_token_ids(given, model_vocab_size(self.model), what=f"pin {name!r}")
        if not ids:
            raise ValueError(f"pin {name!r}: no tokens to pin")
        key = (self.model_key, ids)
        if key in self._pins:
            return self._pins[key][0]
        source, cache = self._find(ids)
        if cache is None:
            from kvstore.kvcheck.prefill import prefill
            from kvstore.warm.warm import PrefillBounds, PrefillProgress, over_limit

            if why := over_limit(self.model_path, name, len(ids), limit, self._context()):
                raise ValueError(why)
            source = "prefill"
            verbose = self.options.verbose
            progress = PrefillProgress(
                lambda line: say(f"kvstore: {line}", verbose), name, PrefillBounds.progress_every
            )
            cache = prefill(self.model, ids, identity=self.identity, on_chunk=progress)
        queued, persist_s = False, 0.0
        if source != "store" and ids not in self.tier.stored:
            t1 = time.perf_counter()
            queued = self._persist(list(ids), cache, label=name, pinned=True, extra=extra)
            persist_s = time.perf_counter() - t1
        pin = Pin(
            name, ids, source, time.perf_counter() - t0, persist_s, queued, warning,
            extra.get("valid_date"),
        )  # fmt: skip
        self.attach_pin(self.model_key, pin.tokens, cache, pin)
        if source == "store":
            self.tier.note_stored(self.model_key, pin.tokens)
        log.info(
            "kvstore: pinned %r: %d tokens from %s in %.3f s", name, len(ids), source, pin.seconds
        )
        return pin

    def _max_pin_tokens(self) -> int:
        """The home's max_pin_tokens setting, read at each pin as `kvstore warm` reads it."""
        from kvstore.home.settings import DEFAULT, load_settings
        from kvstore.warm.warm import max_pin_tokens

        if self.home is None:
            return DEFAULT.max_pin_tokens
        return max_pin_tokens(load_settings(self.home))

    def _context(self) -> tuple[int, str] | None:
        """The longest prefix the loaded model takes, and where that is said (or None)."""
        from kvstore.warm.warm import model_context

        args = getattr(self.model, "args", None)
        config = vars(args) if args is not None and hasattr(args, "__dict__") else {}
        return model_context(config, self.tokenizer)

    def _render(
        self,
        name: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Iterable | None,
        template_kwargs: dict,
        max_tokens: int,
    ) -> RenderedPin:
        from kvstore.pins.manifest import PrefixSpec, check_template_kwargs
        from kvstore.pins.render import render_prefix

        spec = PrefixSpec(
            name=name,
            messages=tuple(dict(m) for m in messages),
            text=None,
            file=None,
            tools=None,
            tools_data=tuple(dict(t) for t in tools) if tools else None,
            chat_template_kwargs=check_template_kwargs(template_kwargs or None),
        )
        return render_prefix(self.tokenizer, spec, max_tokens=max_tokens)

    def _find(self, ids: tuple[int, ...]) -> tuple[str, list | None]:
        """The KV of exactly these tokens from memory (no copy: the pin takes the entry over) or
        the store; (source, None) when neither has it."""
        found = mlxlm.trie_search(self, self.model_key, ids)
        if found.exact is not None:
            return "memory", mlxlm.trie_get(self, self.model_key, ids).prompt_cache
        if self.fingerprint is None or self.home is None:
            return "", None
        from kvstore.learned.blockstore import load_entry
        from kvstore.store.entry import entry_key, pack_tokens
        from kvstore.store.store import Store

        try:
            with Store(self.home, readonly=True) as store:
                meta, cache = load_entry(store, entry_key(self.fingerprint, ids), pack_tokens(ids))
        except KeyError:
            return "", None
        except KVStoreError as e:  # already said once by hydrate; prefill as if absent
            log.debug("kvstore: pin lookup in the store failed: %s", e)
            return "", None
        if unchecked(meta):  # fetched from the fleet since start: checked at the next one
            return "", None
        return "store", cache

    # -- write-behind ------------------------------------------------------------------------

    def _persist(
        self, tokens: list[int], cache: list, *, label: str, pinned: bool, extra: dict | None = None
    ) -> bool:
        """Hand an evaluated cache to the write-behind worker; a few microseconds here."""
        ident = tuple(tokens)
        if self.fingerprint is None or self._writer is None or self._files_warned:
            return False
        if ident in self.tier.offered:
            return False
        import mlx.core as mx

        # Normally a no-op (prefill and generation evaluate); it keeps graph work off the worker.
        mx.eval([c.state for c in cache])
        what = f"{'pin' if pinned else 'chain'} {label!r} ({len(tokens)} tokens)"
        # The LRU holds this same cache object and never mutates it (fetch hands out copies), so
        # the worker may read it later without a copy here.
        job = Job(what, lambda c: self._send(c, tokens, cache, label, pinned, extra or {}))
        if not self._writer.submit(job):
            return False
        self.tier.offered.add(ident)
        return True

    def _send(
        self, client: Any, tokens: list[int], cache: list, label: str, pinned: bool, extra: dict
    ) -> None:
        from kvstore.client.writebehind import store_entry
        from kvstore.identity.fingerprint import template_hash

        if self.fingerprint is None or not self._files_hold_these_weights():
            return
        if self._template_hash is None:
            self._template_hash = template_hash(self.model_path)
        store_entry(client, self.fingerprint, tokens, cache, model=self.model_path,
                    template_hash=self._template_hash, label=label, pinned=pinned,
                    state=self.identity.state, source="pin" if pinned else "chain",
                    owners=["app"], extra={**extra, **self._parts()})  # fmt: skip

    def _parts(self) -> dict:
        """The fingerprint's parts, as entries record them (what a later `model_changed` names)."""
        return {"fingerprint_parts": dict(self._fp.parts)} if self._fp is not None else {}

    def _files_hold_these_weights(self) -> bool:
        """Whether the files still are the fingerprinted ones (a stat each; a re-fingerprint
        only when one changed). When not, the KV in memory is the old weights': filed under the
        fingerprint it would never be hydrated by a process loading the files as they are now,
        and must never be filed under theirs. Said once; nothing is stored after."""
        if self._fp is None or self.home is None or not self._fp.changed_files():
            return True
        from kvstore.home.settings import FILEHASH_NAME
        from kvstore.identity.fingerprint import FileHashCache, model_fingerprint

        try:
            now = model_fingerprint(
                self.identity,
                model_object=self.model,
                hash_cache=FileHashCache(self.home / FILEHASH_NAME),
            )
            same = now.digest == self._fp.digest
        except KVStoreError as e:
            now, same = None, False
            log.debug("kvstore: re-fingerprinting %s: %s", self.model_path, e)
        if same:
            self._fp = now  # touched, same content: remember the new identities
            return True
        if not self._files_warned:
            self._files_warned = True
            log.warning(
                "kvstore: %s changed on disk since this model was loaded: its KV is no longer "
                "that of the files, so this process stores no more pins or chains for it "
                "(load the model again to store them)",
                ", ".join(self._fp.changed_files()[:3]) or self.model_path,
            )
        return False

    def flush(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Send queued pins and stats to the daemon; wait (at most `timeout`) until it has them."""
        self.tier.send_hits()
        if self.stats is not None:
            self.stats.flush(timeout)
        return self._writer.flush(timeout) if self._writer is not None else True

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Flush, then stop the write-behind thread. The cache itself keeps working."""
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        self.tier.send_hits()
        if self.stats is not None:
            self.stats.close(timeout)
        if self._writer is not None:
            self._writer.close(timeout)
        if self.learner is not None:
            self.learner.close(timeout)

    def __enter__(self) -> PersistentPromptCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
