"""`kvstore.client.load`: `mlx_lm.load` with the store's entries for the model read while the
weights load.

The fingerprint needs only the model's files and config.json, so a second thread reads, checks
and decodes the entries while this thread loads the weights; both mostly wait on the kernel
(page faults on fresh memory, file reads), so on a multi-core machine the hydrate hides behind
the load. That pays off only on an idle core: on busy ones the two threads share a core and the
GIL and cost more than one after the other, so then the entries are read after the weights, on
this thread (`kvstore.codec.idle_cores`). The returned cache is a `PersistentPromptCache` filed
from what was read.

Threads and mlx: mlx >= 0.31.2 supports evaluating on several threads (each thread gets its own
default streams; ml-explore/mlx#2133, #3126). The reading thread's mlx work is array creation
from host bytes and metadata-only views on the CPU stream, all evaluated there before it ends, and
it is always joined before `load` returns or raises: no mlx work runs on it at exit (a thread
still evaluating at exit is what crashed, ml-explore/mlx#3126).

The files are fingerprinted on this thread before mlx-lm reads them and re-checked after
(client/loader.py): a weight file replaced while loading would otherwise file the old weights'
KV under the new files' fingerprint, so such a model hydrates nothing.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.client.hydrate import Prefetched, check_arguments, prefetch
from kvstore.client.loader import fingerprint_files, tag_loaded
from kvstore.codec import idle_cores
from kvstore.degrade import library_call
from kvstore.errors import KVStoreError
from kvstore.identity.model import ModelIdentity

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from typing_extensions import Unpack

    from kvstore.client.persistent import CacheKeywords, CacheOptions, PersistentPromptCache

log = logging.getLogger("kvstore.client")

WARM_ENTRY_BYTES = 64 << 20  # the largest stored prefix load's warm-up forward runs on
# new tokens of the warm-up's request past that prefix: a multi-token prefill and a decode step
WARM_SUFFIX_TOKENS = 16


class _Reading:
    """The store's entries for a model, read on a second thread while its weights load (or
    after them, on the caller's), with the files' identity taken before mlx-lm reads them."""

    def __init__(self, identity: ModelIdentity, home: Any, overlap: bool | None):
        self.identity, self.home = identity, home
        self.entries: Prefetched | None = None
        try:  # as given: checked here, and said once by the cache when wrong
            self.identity = check_arguments(identity, home=home)[1]
            self.usable = True
        except KVStoreError:
            self.usable = False
        self.before = fingerprint_files(self.identity, home=home) if self.usable else None
        # Reading beside the load pays off only on a core nothing else runs on: else the two
        # threads share one core and the GIL, and the sum costs more (see the module doc).
        self.overlap = self.usable and (idle_cores() >= 1 if overlap is None else overlap)
        self.thread = threading.Thread(target=self._read, name="kvstore-prefetch", daemon=True)

    def _read(self) -> None:
        self.entries = prefetch(self.identity, home=self.home, fingerprint=self.before)

    def __enter__(self) -> _Reading:
        if self.overlap:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.overlap:
            self.thread.join()  # also when the load fails: never leave mlx work on a thread

    def result(self, model: Any, model_path: Any) -> Prefetched | None:
        """The entries read under the files `model` was loaded from; None when they changed
        (or the thread died): the cache then reads again (and refuses) with the model."""
        same_files = tag_loaded(model, self.before, model_path)
        if self.usable and not self.overlap and same_files:
            self._read()  # after the load, on this thread
        got = self.entries
        if got is None or not same_files or self.before is None:
            return None
        return got if got.report.fingerprint == self.before.hex else None


def load(
    model_path: str | Path | ModelIdentity,
    *,
    home: str | Path | None = None,
    tokenizer_config: dict | None = None,
    overlap: bool | None = None,
    warm: bool = True,
    options: CacheOptions | None = None,
    **keywords: Unpack[CacheKeywords],
) -> tuple[nn.Module, TokenizerWrapper, PersistentPromptCache]:
    """Return `(model, tokenizer, cache)`: what `mlx_lm.load` returns, and a
    `PersistentPromptCache` hydrated from the store while the weights loaded.

    `model_path` is the model, or its whole `ModelIdentity`; else the identity keywords name the
    rest of it (`adapter_path`, `kv_bits`, `kv_group_size`, `quantized_kv_start`,
    `model_config`: load-time overrides, as `mlx_lm.load(model_config=...)` takes them). The other
    keywords are the cache's options (`CacheOptions`, or its fields one by one: model_key,
    max_size, max_bytes, stats, ...). Like `hydrate`, a store problem or a wrong argument type
    is one warning in `cache.report`, never an exception (mlx_lm.load's own errors still raise).
    `overlap` reads the entries on a second thread while the weights load (True), or after them
    on this one (False); by default only when a core is idle (`kvstore.codec.idle_cores`).
    `warm` pays what the first `generate` would pay once (`first_call`): without it the first
    call costs more than the next ones.
    """
    from mlx_lm import load as mlx_load

    from kvstore.client.persistent import CacheOptions, PersistentPromptCache

    rows: dict[str, Any] = dict(keywords)
    given = ModelIdentity.given(model_path, rows)
    given = rows.pop("identity", None) or (
        model_path if isinstance(model_path, ModelIdentity) else given
    )
    options = CacheOptions.given(rows, options)
    overrides = given.model_config
    with _Reading(given, home, overlap) as reading:
        model, tokenizer = mlx_load(
            str(given.path),
            tokenizer_config=tokenizer_config,
            model_config=dict(overrides) if isinstance(overrides, dict) else overrides,
            adapter_path=None if given.adapter is None else str(given.adapter),
        )
    prefetched = reading.result(model, given.path)
    largest, largest_tokens, pinned = _warm_up_entry(prefetched)
    cache = PersistentPromptCache.open(
        model, tokenizer, reading.identity, home=home, options=options, prefetched=prefetched
    )
    if warm:
        grown = first_call(model, tokenizer, largest, largest_tokens)
        if pinned and largest is not None and grown is not None:
            give_room(largest, grown)
    return model, tokenizer, cache


def _warm_up_entry(prefetched: Prefetched | None) -> tuple[list | None, list[int], bool]:
    """The stored KV the warm-up's request extends a copy of, as the first request's does, its
    tokens, and whether it is a pin."""
    # the largest one up to WARM_ENTRY_BYTES (above, its grown copy costs load as much as the
    # request it spares)
    read_entries = [
        e for e in (prefetched.entries if prefetched is not None else [])
        if e[0].nbytes <= WARM_ENTRY_BYTES
    ]  # fmt: skip
    if not read_entries:
        return None, [], False
    meta, kv = max(read_entries, key=lambda e: e[0].ntokens)
    return kv, meta.token_ids(), meta.pinned


def give_room(entry: list, grown: list) -> bool:
    """Put the warm-up's copy of `entry`, trimmed back to the prefix, in the entry's place.

    mlx-lm's KVCache grows 256 tokens at a time. A prefix it prefilled has room for the next
    request's tokens, but a hydrated one holds exactly its own. So the first request through it
    would copy the whole prefix into a longer buffer, which later requests (extending a cache
    that has room) do not pay. The warm-up's request already made that copy. Trimmed back, it
    holds the same KV (the prefix's bytes, copied) with room to grow, and it takes the entry's
    place in the list the prompt cache holds. For plain KVCache layers only (their room is at the
    end, and trimming keeps it); pins only (the LRU's byte count does not include them, so
    nothing in it changes). Returns whether the entry was replaced."""
    from mlx_lm.models.cache import KVCache

    layers = [*entry, *grown]
    if not entry or len(entry) != len(grown) or any(type(c) is not KVCache for c in layers):
        return False
    n = entry[0].offset
    if any(c.offset != n or c.keys is None for c in entry):
        return False
    for c in grown:
        c.trim(c.offset - n)
    if any(c.offset != n or c.keys is None or c.keys.shape[2] <= n for c in grown):
        return False
    entry[:] = grown  # the same list object: the prompt cache's entry
    return True


def first_call(
    model: Any, tokenizer: Any, entry: list | None = None, tokens: Sequence[int] = ()
) -> list | None:
    """Pay here, once, what the app's first request pays and later ones do not: the chat
    template's compile (transformers keeps it by its text), the tokenizer's first encode of the
    stored prefix's text (`tokens`, which every request through it starts with: the tokenizer
    keeps its words), and one request through mlx-lm's `stream_generate` on a copy of `entry`
    (the largest hydrated prefix, never the one in the cache): the detokenizer's tables, and a
    prefill and a decode step on mlx-lm's generation stream, where its first forward traces the
    model's `mx.compile`d functions (mlx keeps traces per stream: a forward on the default stream
    leaves the generate's to trace), runs its graph code and allocates the buffers the prefix's
    KV grows into; and the package's lazy `generate` names. Greedy, so mlx's random state is
    untouched; nothing is recorded or inserted. Returns that copy, grown by the request (None
    when the warm-up was skipped), for `give_room`.
    Never raises: it is a warm-up, and the app's own call says what is wrong."""
    import copy

    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    with library_call("kvstore: first-call warm-up skipped", level=logging.DEBUG):
        if getattr(tokenizer, "chat_template", None):
            tokenizer.apply_chat_template(
                [{"role": "system", "content": "x"}, {"role": "user", "content": "x"}],
                add_generation_prompt=True,
                tokenize=False,
            )
        tokenizer.encode(tokenizer.decode(list(tokens)) if tokens else "x")
        # the package's lazy `generate` names (looked up, not imported: the package imports us)
        package = sys.modules[__name__.rpartition(".")[0]]
        for name in ("generate", "stream_generate"):
            getattr(package, name)
        kv = copy.deepcopy(entry) if entry is not None else make_prompt_cache(model)
        suffix = [0] * WARM_SUFFIX_TOKENS
        for _ in mlx_lm.stream_generate(model, tokenizer, suffix, max_tokens=1, prompt_cache=kv):
            pass
        return kv
    return None
