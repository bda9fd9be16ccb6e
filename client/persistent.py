"""PersistentPromptCache: mlx-lm's LRUPromptCache, hydrated from the store, with runtime pins.

Pins live in the LRU's trie, so `fetch_nearest_cache` finds them with mlx-lm's own search and
copy semantics, but not in its eviction order or byte count, so the LRU never evicts them. One
mlx-lm behaviour needs undoing: inserting a trimmable cache pops every stored prefix of it, which
would drop a pin as soon as a chained transcript extends it; `insert_cache` puts those pins back.

New pins (and, opt-in, chained transcripts) go to the daemon through the write-behind queue.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from kvstore import mlxlm
from kvstore.client.fleetcheck import unchecked
from kvstore.client.hydrate import (
    HydrateReport,
    Prefetched,
    check_arguments,
    given_identity,
    insert,
    prefetch,
)
from kvstore.client.learn import Learner, LearnTarget, Provenance
from kvstore.client.reasons import after_hydrate
from kvstore.client.stats import StatsRecorder
from kvstore.client.writebehind import CLOSE_TIMEOUT, Job, WriteBehind
from kvstore.errors import KVStoreError
from kvstore.identity.model import ModelIdentity
from kvstore.pins.manifest import pin_name_problem
from kvstore.pins.render import RenderedPin, pin_extra
from kvstore.wire.messages import TouchRequest

if TYPE_CHECKING:
    from kvstore.identity.fingerprint import Fingerprint

log = logging.getLogger("kvstore.client")

PIN_TYPE = "system"  # the LRU cache_type pins are filed under (as hydrate files stored entries)
HIT_BATCH_S = 5.0  # seconds between batches of hits sent to the daemon


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


class PinnedPromptCache(LRUPromptCache):
    """An LRUPromptCache whose pins sit in its trie but outside its eviction order and byte count.

    `fetch_nearest_cache` finds pins with mlx-lm's own search and copy semantics; the LRU never
    evicts them, and inserting a trimmable cache that extends a pin (mlx-lm pops every stored
    prefix of it) puts the pin back. PersistentPromptCache and `kvstore serve` keep pins this way.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63):
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self._pins: dict[tuple[Any, tuple[int, ...]], tuple[Any, Any]] = {}  # -> (pin, entry)
        self.provenance = Provenance()  # which prefixes in memory were read from the store
        self.learner: Learner | None = None  # learning and the cold tier (kvstore.client.learn)
        self._restoring = False  # inserting KV read from the store: not a request's end

    def note_from_store(self, model: Any, tokens: Sequence[int]) -> None:
        """The KV just inserted for `tokens` was read from the store (hydrate calls this)."""
        self.provenance.note_store(model, tokens)

    def insert_restored(
        self, model: Any, tokens: list[int], cache: list, *, from_store: bool = True
    ) -> None:
        """Put KV the learner restored (or split off) into the LRU: no report, no persist."""
        self._restoring = True
        try:
            self.insert_cache(model, tokens, cache, cache_type="system")
        finally:
            self._restoring = False
        if from_store:
            self.note_from_store(model, tokens)

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        """mlx-lm's fetch; then the store when it serves more (the cold tier), a split at a
        learned boundary (state layouts), and the request's tokens counted by source."""
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and tokens and not rest:
            cache, rest = mlxlm.leave_last_token(self, model, tokens, cache)
        served = len(tokens) - len(rest)
        restored = 0
        learner = self.learner
        if learner is not None:
            hit = learner.restore(self, model, tokens, served)
            if hit is not None:
                cache, rest, restored = hit
        self.provenance.count(model, tokens, served, restored)
        if learner is not None:
            learner.fetched(model, tokens)
            cache, rest = learner.split(self, model, tokens, cache, rest)
        return cache, rest

    def __len__(self) -> int:
        return mlxlm.lru_len(self) + len(self._pins)

    @property
    def nbytes(self) -> int:
        return mlxlm.lru_nbytes(self) + self.pinned_nbytes

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of the pins' KV: resident whatever the LRU's limits."""
        return sum(entry.nbytes for _, entry in self._pins.values())

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> bool:
        """mlx-lm's insert, with pins kept; False (nothing inserted) for a pin's exact tokens."""
        ident = tuple(tokens)
        if (model, ident) in self._pins:
            return False  # the pin already holds exactly this KV; replacing it would unpin it
        shadowed = []
        if self._pins and can_trim_prompt_cache(prompt_cache):
            shadowed = [
                (t, entry)
                for (m, t), (_, entry) in self._pins.items()
                if m == model and len(t) < len(ident) and ident[: len(t)] == t
            ]
        # mlx-lm pops (and un-counts the bytes of) every stored prefix of a trimmable insert. Pins
        # are not in its byte count: count them in first so its budget check sees true numbers.
        for _, entry in shadowed:
            mlxlm.lru_count(self, entry, +1)
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        for t, entry in shadowed:
            mlxlm.trie_add(self, model, t, entry)
        if self.learner is not None and not self._restoring:
            self.learner.inserted(model, tokens, prompt_cache)
        return True

    def attach_pin(self, model: Any, tokens: Sequence[int], cache: list, pin: Any) -> None:
        """Keep `cache`, the KV of exactly `tokens`, as a pin (`pin` says which, for the owner)."""
        tokens = tuple(tokens)
        entry = mlxlm.cache_entry(cache, sum(c.nbytes for c in cache), PIN_TYPE)
        prev = mlxlm.trie_add(self, model, tokens, entry)
        if prev is not None and (model, tokens) not in self._pins:
            # an LRU entry of the same tokens: take it off the LRU's books
            mlxlm.lru_forget(self, model, tokens, prev)
        self._pins[(model, tokens)] = (pin, entry)


class PersistentPromptCache(PinnedPromptCache):
    """An LRUPromptCache for one loaded model that survives restarts through the kvstore daemon.

    >>> cache = PersistentPromptCache(model, tokenizer, "/models/Qwen3-8B")
    >>> cache.pin("classify", messages=[{"role": "system", "content": ROUTER}])
    >>> text = client.generate(cache, model, tokenizer, prompt, label="classify")

    `model_config` names the overrides the model was loaded with (`mlx_lm.load(model_config=)`);
    its own arguments are read from `model` either way. `identity` (a ModelIdentity) may be given
    instead of `adapter_path`, `kv_bits`, `kv_group_size`, `quantized_kv_start` and
    `model_config`. Load it with `kvstore.client.load` and a
    weight
    file changed since is caught: nothing is hydrated or persisted for that model. A model from
    plain `mlx_lm.load` is compared with its files (a sample of its weights) instead. Before each
    store the files are checked again: KV is filed only under the fingerprint of the weights that
    computed it. Like `hydrate`, it never raises for a store problem or a wrong argument type:
    the report holds one warning and the cache works as a plain LRUPromptCache.

    With `learn=True` prompts are reported to the daemon, which learns the prefixes that recur
    (kept in the store as block records or learned entries), and a memory miss the store can
    serve is restored from it instead of prefilled (kvstore.client.learn).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        model_path: str | Path,
        *,
        model_key: Any = None,
        home: str | Path | None = None,
        adapter_path: str | Path | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = 5000,
        model_config: dict | None = None,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        persist_chains: bool = False,
        learn: bool = False,
        stats: bool = True,
        verbose: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        prefetched: Prefetched | None = None,
        identity: ModelIdentity | None = None,
    ):
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self.model, self.tokenizer = model, tokenizer
        self.model_path = str(model_path)
        self.model_key = self.model_path if model_key is None else model_key
        if identity is None:  # as given: checked below (a wrong type is the one warning)
            identity = given_identity(
                model_path, adapter_path, kv_bits, kv_group_size, quantized_kv_start, model_config
            )
        # the model as the entries are keyed: what every hydrate, prefill and store here uses
        self.identity = identity
        self.home: Path | None = None
        try:
            self.home, self.identity = check_arguments(identity, home=home)
            bad_argument = None
        except KVStoreError as e:
            self.home, bad_argument = None, f"kvstore: not hydrating or persisting: {e}"
        self.persist_chains = persist_chains
        # What the app passes to apply_chat_template (as mlx_lm.server --chat-template-args).
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._hydrated: set[tuple[int, ...]] = set()  # token tuples the store already holds
        self.stored_labels: dict[tuple[int, ...], str] = {}  # hydrated entries: tokens -> label
        self.stored_dates: dict[tuple[int, ...], str] = {}  # of those, clock-bound: -> ISO day
        self._offered: set[tuple[int, ...]] = set()  # sent to the daemon once already
        self._hits: list[bytes] = []  # keys of stored entries that served a fetch, not yet sent
        self._hits_sent = time.monotonic()
        self._hydrating = True
        # the Fingerprint, with the files it hashed: re-checked before each store
        self._fp: Fingerprint | None = None
        self._files_warned = False  # the files changed since: said once, nothing stored after
        # no writer (nothing sent anywhere) without a usable home
        self._writer = WriteBehind(self.home) if self.home is not None else None
        # Unsent stats and pins still reach the daemon when the app exits without close().
        ref = weakref.ref(self)

        def at_exit() -> None:
            c = ref()
            if c is not None:
                c.close()

        self._at_exit = at_exit
        atexit.register(self._at_exit)
        self.stats = (
            StatsRecorder(
                self.model_path, writer=self._writer, send=self._writer is not None, verbose=verbose
            )
            if stats
            else None
        )
        self._template_hash: bytes | None = None
        self.fingerprint: bytes | None = None
        self.report: HydrateReport = self._hydrate(prefetched, home, bad_argument)
        if self.stats is not None:  # what the reasons of prefilled tokens need from it
            after_hydrate(
                self.stats.attribute, self.report, self.home, self.model_path, self.stored_dates,
                self._fp.parts if self._fp is not None else None,
            )  # fmt: skip
        fp = self.report.fingerprint
        self.fingerprint = bytes.fromhex(fp) if fp else None
        if learn and self.fingerprint is not None and self._writer is not None:
            self._attach_learner()

    def _hydrate(
        self, prefetched: Prefetched | None, home: str | Path | None, bad_argument: str | None
    ) -> HydrateReport:
        """Insert the stored entries of this model (read now unless `prefetched`); the report."""
        try:
            if bad_argument is not None:
                log.warning("%s", bad_argument)
                return HydrateReport(warning=bad_argument)
            if prefetched is None:  # else read already, while the weights loaded (client.load)
                prefetched = prefetch(self.identity, home=home, model=self.model)
            self._fp = prefetched.fingerprint
            # the stored entries a `diverged` reason names (kvstore.reasons)
            self.stored_labels = {tuple(m.token_ids()): m.label for m, _ in prefetched.entries}
            self.stored_dates = {
                tuple(m.token_ids()): m.valid_date for m, _ in prefetched.entries if m.valid_date
            }
            return insert(self, self.model_key, prefetched, model=self.model)
        finally:
            self._hydrating = False

    def _attach_learner(self) -> None:
        """Learn this process's recurring prefixes; restore from the store on a memory miss."""
        from kvstore.identity.codehash import runtime_versions

        if self.home is None or self.fingerprint is None:
            return  # (never: attached only with a usable home and a fingerprint)
        self.learner = Learner(self.home, writer=self._writer)
        if self.stats is not None:
            self.stats.attribute.learner = self.learner
        self.learner.add_target(
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

    # -- LRUPromptCache, with pins kept out of its eviction (PinnedPromptCache) -------------

    @property
    def pins(self) -> dict[str, Pin]:
        return {pin.name: pin for pin, _ in self._pins.values()}

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> bool:
        if (self._hydrating or self._restoring) and (model, tuple(tokens)) not in self._pins:
            self._hydrated.add(tuple(tokens))
        if not super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type):
            return False
        if (
            self.persist_chains
            and not (self._hydrating or self._restoring)
            and model == self.model_key
        ):
            self._persist(list(tokens), prompt_cache, label="chain", pinned=False)
        return True

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and model == self.model_key and len(rest) < len(tokens):
            self._record_hit(tokens, len(tokens) - len(rest))
        return cache, rest

    def _record_hit(self, tokens: list[int], served: int) -> None:
        """Tell the daemon which stored prefix a fetch reused (hits, last_used: the order its
        budget evicts in), batched through the write-behind queue every HIT_BATCH_S seconds.
        A prefix counts whether its stored entry or an in-memory transcript extending it served."""
        if self.fingerprint is None:
            return
        best = max(
            (
                t
                for t in self._hydrated | self._offered
                if len(t) <= served and tuple(tokens[: len(t)]) == t
            ),
            key=len,
            default=None,
        )
        if best is None:
            return
        from kvstore.store.entry import entry_key

        self._hits.append(entry_key(self.fingerprint, best))
        if time.monotonic() - self._hits_sent >= HIT_BATCH_S:
            self._send_hits()

    def _send_hits(self) -> None:
        """Hits on stored entries (touch) and on restored learned records (touch_blocks)."""
        keys, self._hits, self._hits_sent = self._hits, [], time.monotonic()
        if keys and self._writer is not None:
            self._writer.submit(
                Job(f"{len(keys)} hits", lambda client: client.send(TouchRequest(keys)))
            )
        if self.learner is not None:
            self.learner.send_touched()

    # -- pins --------------------------------------------------------------------------------

    def pin(
        self,
        name: str,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tokens: Sequence[int] | None = None,
        tools: Iterable[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Pin:
        """Register a stage prefix that the LRU never evicts: chat `messages` (rendered with the
        stable-boundary rule, optionally with `tools` and the template arguments the app's
        requests use: `chat_template_kwargs`, default the cache's) or exact `tokens`.

        Its KV comes from memory or the store when present; otherwise the loaded model prefills
        it here, once, and the daemon is asked to persist it (off the request path).
        """
        t0 = time.perf_counter()
        if problem := pin_name_problem(name):  # it is the entry's label: one line in ls
            raise ValueError(f"pin name: {problem}")
        if (messages is None) == (tokens is None):
            raise ValueError("pin: give exactly one of messages= or tokens=")
        warning, extra = None, {}
        if messages is not None:
            kwargs = (
                self.chat_template_kwargs if chat_template_kwargs is None else chat_template_kwargs
            )
            rendered = self._render(name, messages, tools, dict(kwargs))
            ids, warning = rendered.tokens, rendered.warning
            extra = pin_extra(rendered, dict(kwargs))
        else:
            ids = tuple(tokens or ())  # given: messages is None
        from kvstore.warm.prefill import check_token_ids, model_vocab_size

        # an id past the embedding would crash the process in mlx, not raise
        ids = check_token_ids(ids, model_vocab_size(self.model), what=f"pin {name!r}")
        if not ids:
            raise ValueError(f"pin {name!r}: no tokens to pin")
        key = (self.model_key, ids)
        if key in self._pins:
            return self._pins[key][0]
        source, cache = self._find(ids)
        if cache is None:
            from kvstore.warm.prefill import prefill

            source = "prefill"
            cache = prefill(self.model, ids, identity=self.identity)
        queued, persist_s = False, 0.0
        if source != "store" and ids not in self._hydrated:
            t1 = time.perf_counter()
            queued = self._persist(list(ids), cache, label=name, pinned=True, extra=extra)
            persist_s = time.perf_counter() - t1
        pin = Pin(
            name, ids, source, time.perf_counter() - t0, persist_s, queued, warning,
            extra.get("valid_date"),
        )  # fmt: skip
        self.attach_pin(self.model_key, pin.tokens, cache, pin)
        if source == "store":
            self.note_from_store(self.model_key, pin.tokens)
        log.info(
            "kvstore: pinned %r: %d tokens from %s in %.3f s", name, len(ids), source, pin.seconds
        )
        return pin

    def _render(
        self,
        name: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Iterable | None,
        template_kwargs: dict,
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
        return render_prefix(self.tokenizer, spec)

    def _find(self, ids: tuple[int, ...]) -> tuple[str, list | None]:
        """The KV of exactly these tokens from memory (no copy: the pin takes the entry over) or
        the store; (source, None) when neither has it."""
        found = mlxlm.trie_search(self, self.model_key, ids)
        if found.exact is not None:
            return "memory", mlxlm.trie_get(self, self.model_key, ids).prompt_cache
        if self.fingerprint is None or self.home is None:
            return "", None
        from kvstore.store.blocks import load_entry
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
        self._hydrated.add(ids)
        return "store", cache

    # -- write-behind ------------------------------------------------------------------------

    def _persist(
        self, tokens: list[int], cache: list, *, label: str, pinned: bool, extra: dict | None = None
    ) -> bool:
        """Hand an evaluated cache to the write-behind worker; a few microseconds here."""
        ident = tuple(tokens)
        if self.fingerprint is None or self._writer is None or self._files_warned:
            return False
        if ident in self._offered:
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
        self._offered.add(ident)
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
        from kvstore.identity.fingerprint import FileHashCache, model_fingerprint
        from kvstore.settings import FILEHASH_NAME

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
        self._send_hits()
        if self.stats is not None:
            self.stats.flush(timeout)
        return self._writer.flush(timeout) if self._writer is not None else True

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Flush, then stop the write-behind thread. The cache itself keeps working."""
        atexit.unregister(self._at_exit)
        self._send_hits()
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
