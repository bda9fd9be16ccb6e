"""`attach`: the persistent prompt cache for a model an app or a framework loaded itself.

smolagents' `MLXModel`, LangChain's `ChatMLX` / `MLXPipeline`, Outlines' `MLXLM` and llama-index's
`MLXLLM` call `mlx_lm.stream_generate` / `mlx_lm.generate` without a `prompt_cache`, so each call
prefills its whole prompt. After `attach(model, tokenizer, model_path)`, such a call for that
model goes through one route (`kvstore.mlxlm.route_generate_step`): the nearest prefix a
`PersistentPromptCache` holds (hydrated from the store, learned prefixes restored from it) is
fetched, only the rest is prefilled, the transcript is inserted for the next call, and the call's
stats are recorded (the `kvstore: ...` line). One mechanism for every framework: they all end in
mlx-lm's `generate_step`.

Left alone (mlx-lm's own generate_step, as without kvstore): a call that passes its own
`prompt_cache`, `input_embeddings`, `max_kv_size` or KV quantization other than the cache's, a
model not attached, a call generate_step itself refuses, and code that bound `generate_step` by
name at import (LangChain's streaming path imports it from `mlx_lm.utils`, which mlx-lm 0.31 and
0.32 no longer have). A fault of the cache on a call gives one warning and the call prefills
as it would have without kvstore.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore import mlxlm
from kvstore.client.callstats import CachedCall, CallStats, StatsRecorder
from kvstore.client.persistent import PersistentPromptCache
from kvstore.client.writebehind import CLOSE_TIMEOUT
from kvstore.degrade import Degrade, library_call
from kvstore.identity.model import ModelIdentity

# (not client/attach.py: the package's `attach` must be the function, and a submodule of that
# name would replace it on the package once imported)

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from typing_extensions import Unpack

    from kvstore.client.persistent import CacheKeywords

log = logging.getLogger("kvstore.client")

# keywords of generate_step whose calls the cache cannot serve as they would be served without it
_OWN_CACHE = ("prompt_cache", "input_embeddings", "max_kv_size")
_KV_QUANT = ("kv_bits", "kv_group_size", "quantized_kv_start")


class Attachment:
    """A model attached to its persistent prompt cache; `detach()` (or leaving the `with` block)
    undoes it, flushing what is queued for the daemon.

    `cache` is the model's PersistentPromptCache (`cache.report`: what was hydrated), `stats` its
    StatsRecorder (None with `stats=False`), `calls` the recent calls' CallStats, oldest first."""

    def __init__(self, model: Any, tokenizer: Any, cache: PersistentPromptCache, *, label: str):
        self.model, self.tokenizer, self.cache, self.label = model, tokenizer, cache, label
        self.lock = threading.Lock()  # the cache's LRU and stats, between calls of two threads
        self._warned = False

    @property
    def stats(self) -> StatsRecorder | None:
        return self.cache.stats

    @property
    def calls(self) -> list[CallStats]:
        return list(self.cache.stats.calls) if self.cache.stats is not None else []

    @property
    def attached(self) -> bool:
        return _ATTACHED.get(id(self.model)) is self

    def detach(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Calls for this model prefill as without kvstore again; queued stores and stats are
        flushed to the daemon (at most `timeout`). Detaching twice does nothing more."""
        with _REGISTRY:
            if _ATTACHED.get(id(self.model)) is not self:
                return
            del _ATTACHED[id(self.model)]
            _unroute_if_idle()
        self.cache.close(timeout)

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def degrade(self, what: str) -> Degrade:
        """A block the call survives as without kvstore: its failure a warning the first time
        (`kvstore: <what>; prefilling as without kvstore: <Type>: <message>`), then debug."""
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        return library_call(f"kvstore: {what}; prefilling as without kvstore", level=level)


_REGISTRY = threading.Lock()
_ATTACHED: dict[int, Attachment] = {}  # id(model) -> its attachment (which holds the model)
_undo: Callable[[], None] | None = None  # puts mlx-lm's generate_step back


def attach(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    model_path: str | Path | ModelIdentity,
    *,
    label: str = "default",
    **cache_options: Unpack[CacheKeywords],
) -> Attachment:
    """Make mlx-lm generation calls for `model` made without a `prompt_cache` use a persistent
    prompt cache: `PersistentPromptCache.open(model, tokenizer, model_path, learn=True,
    **cache_options)` (the store's entries hydrated, recurring prefixes learned and written
    behind to the daemon, a memory miss restored from the store).

    >>> model, tokenizer = mlx_lm.load(path)
    >>> kvstore.client.attach(model, tokenizer, path)

    Each served call prefills only what its nearest cached prefix does not cover, gives the same
    tokens as mlx-lm alone (logits processors still see the whole prompt), inserts its transcript
    for the next call, and records a CallStats under `label`. Each call keeps its own state, so
    several threads may generate with the model at once (the cache is locked between them only
    to fetch and to insert). Returns the `Attachment` (a context manager; `detach()` undoes it
    and lets go of the model). Like `PersistentPromptCache.open`, never raises for a store
    problem: one warning, and calls are served from memory only. Attaching a model already
    attached warns and returns its attachment."""
    with _REGISTRY:
        attached = _ATTACHED.get(id(model))
        if attached is not None:
            log.warning("kvstore: this model is attached already; detach() it to attach it again")
            return attached
    options: dict[str, Any] = {"learn": True, **cache_options}
    cache = PersistentPromptCache.open(model, tokenizer, model_path, **options)
    attachment = Attachment(model, tokenizer, cache, label=label)
    global _undo
    with _REGISTRY:
        _ATTACHED[id(model)] = attachment
        if _undo is None:
            _undo = mlxlm.route_generate_step(_route)
    return attachment


def _unroute_if_idle() -> None:
    """With no model attached, mlx-lm's generate_step is put back (under _REGISTRY)."""
    global _undo
    if not _ATTACHED and _undo is not None:
        _undo()
        _undo = None


def _route(
    plain: Callable[..., Iterator[Any]], prompt: Any, model: Any, *args: Any, **kw: Any
) -> Iterator[Any]:
    """generate_step for every caller: an attached model's call without its own cache is
    served through the model's cache; anything else is `plain(...)` untouched."""
    attachment = _ATTACHED.get(id(model))
    if (
        attachment is None
        or attachment.model is not model
        or not len(prompt)
        or any(kw.get(k) is not None for k in _OWN_CACHE)
        or not _same_kv_quantization(attachment.cache.identity, kw)
        or not mlxlm.binds(plain, prompt, model, *args, **kw)
    ):
        return plain(prompt, model, *args, **kw)
    with attachment.degrade("the prompt cache failed on a generation call") as failed:
        tokens = [int(t) for t in prompt.tolist()] if hasattr(prompt, "tolist") else list(prompt)
        with attachment.lock:
            call = CachedCall.open(
                attachment.cache, model, tokens, label=attachment.label,
                decode=getattr(attachment.tokenizer, "decode", None),
            )  # fmt: skip
        processors = mlxlm.whole_history(plain, kw.get("logits_processors"), prompt[: call.served])
        rest = prompt[call.served :]
    if failed.error is not None:  # a fault of the cache: this call as without kvstore
        return plain(prompt, model, *args, **kw)
    kw = {**kw, "prompt_cache": call.cache, "logits_processors": processors}
    if kw.get("prompt_progress_callback") is not None:  # progress over the whole prompt
        kw["prompt_progress_callback"] = _progress(kw["prompt_progress_callback"], call.served)
    return _served(attachment, call, plain(rest, model, *args, **kw))


def _progress(callback: Callable[[int, int], None], served: int) -> Callable[[int, int], None]:
    """A prompt_progress_callback counting the tokens the cache served as processed."""

    def progress(done: int, total: int) -> None:
        callback(done + served, total + served)

    return progress


def _same_kv_quantization(identity: ModelIdentity, kw: dict[str, Any]) -> bool:
    """Whether the call quantizes its KV as the cache's entries are (plain KV when neither does)."""
    if kw.get("kv_bits") != identity.kv_bits:
        return False
    return identity.kv_bits is None or all(
        kw[k] == getattr(identity, k) for k in _KV_QUANT if k in kw
    )


def _served(attachment: Attachment, call: CachedCall, steps: Iterator[Any]) -> Iterator[Any]:
    """generate_step's (token, logprobs) pairs, then the call closed: stats and transcript."""
    generated: list[int] = []
    prefill_s = 0.0
    t0 = time.perf_counter()
    try:
        for token, logprobs in steps:
            if not generated:
                prefill_s = time.perf_counter() - t0
            generated.append(int(token))
            yield token, logprobs
    finally:
        if not sys.is_finalizing():  # (a generator left open until the interpreter exits: no)
            _close(attachment, call, generated, prefill_s, time.perf_counter() - t0)


def _close(
    attachment: Attachment, call: CachedCall, generated: list[int], prefill_s: float, elapsed: float
) -> None:
    # the answer is out already: a failure here only misses a transcript
    with attachment.degrade("the prompt cache failed to keep a generation call"), attachment.lock:
        call.close(generated, prefill_s, elapsed)
