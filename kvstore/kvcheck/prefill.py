"""Prefill exactly a pin's tokens with mlx-lm and return its evaluated cache objects; the model
loaded for it, checked to be the one its plan fingerprinted (`load_model`)."""

from __future__ import annotations

import gc
import logging
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

from kvstore.degrade import foreign
from kvstore.errors import ModelError, PrefillStopped
from kvstore.identity.fingerprint import cache_layout
from kvstore.identity.model import ModelIdentity
from kvstore.identity.modelconfig import config_vocab_size  # noqa: F401  (kvstore.warm.transfer)
from kvstore.tokens import TokenIds

if TYPE_CHECKING:
    from kvstore.pins.plan import ModelPlan

log = logging.getLogger("kvstore")

PREFILL_STEP = 2048  # tokens per forward pass, as mlx_lm.generate's prefill_step_size

# The stop check of the prefills run inside `stop_when` (the daemon's shutdown), so callers in
# between (kvstore.warm.warm) need not pass it down.
_stop_check: ContextVar[Callable[[], bool] | None] = ContextVar("prefill_stop", default=None)


# names of the token embedding in mlx-lm's models (llama, gpt2, olmo, bloom/falcon, mamba...)
_EMBEDDING_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embedding")


def model_vocab_size(model) -> int | None:
    """Rows of the loaded model's token embedding (the ids it can take); None when unknown."""
    import mlx.nn as nn

    found = []
    for name, m in model.named_modules() if hasattr(model, "named_modules") else ():
        if isinstance(m, nn.QuantizedEmbedding):
            found.append((name, m.num_embeddings))
        elif isinstance(m, nn.Embedding):
            found.append((name, m.weight.shape[0]))
    named = [n for name, n in found if name.rsplit(".", 1)[-1] in _EMBEDDING_NAMES]
    if named or len(found) == 1:
        return (named or [found[0][1]])[0]
    args = getattr(model, "args", None)
    return config_vocab_size(vars(args)) if args is not None and hasattr(args, "__dict__") else None


def check_token_ids(
    tokens: Iterable | TokenIds, vocab: int | None, *, what: str = "tokens"
) -> tuple[int, ...]:
    """The ids as ints, from any sequence of ints, a numpy integer array or an `mx.array` (one
    row), or ValueError in one line naming the first that is not an integer token id (a bool is
    not one), or that is outside 0 .. vocab-1: mlx indexes the embedding unchecked, so such an id
    would crash the process (SIGSEGV), not raise."""
    array: Any = tokens
    if hasattr(array, "tolist") and hasattr(array, "ndim"):  # a numpy or mlx array
        if array.ndim != 1:
            shape = tuple(array.shape)
            raise ValueError(f"{what}: token ids must be one row, got an array of shape {shape}")
        tokens = array.tolist()
    out = []
    for i, t in enumerate(tokens):
        try:
            if isinstance(t, bool):
                raise TypeError
            t = operator.index(t)
        except TypeError:
            raise ValueError(f"{what}: token {i} is {t!r}, not an integer token id") from None
        if t < 0 or (vocab is not None and t >= vocab) or t >= 2**32:
            size = (
                f"the vocabulary has {vocab} ids (0 .. {vocab - 1})"
                if vocab
                else "ids are 0 .. 2**32-1"
            )
            raise ValueError(f"{what}: token id {t} (position {i}) is out of range: {size}")
        out.append(t)
    return tuple(out)


@contextmanager
def stop_when(check: Callable[[], bool]) -> Iterator[None]:
    """Prefills in this block raise PrefillStopped before their next chunk once `check()`."""
    token = _stop_check.set(check)
    try:
        yield
    finally:
        _stop_check.reset(token)


def prefill(
    model,
    tokens: Sequence[int],
    *,
    identity: ModelIdentity | None = None,
    step: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> list:
    """Run `tokens` through `model` into a fresh prompt cache, quantizing its KV the way
    generate(kv_bits=, kv_group_size=, quantized_kv_start=) does with `identity`'s settings (none:
    full precision): after each chunk, every layer whose offset reached quantized_kv_start
    (mlx-lm's default 5000: shorter prefixes stay full precision, as they would in a cold run).

    `should_stop` (else the one of `stop_when`) is asked before each chunk: a long prefix stops
    within one chunk's forward pass rather than at its end. `on_chunk(done, total)` is called
    after each chunk is evaluated (a long pin's progress). `step`: tokens per forward pass
    (default PREFILL_STEP)."""
    tokens = check_token_ids(tokens, model_vocab_size(model), what="prefill")
    if not tokens:
        raise ValueError("cannot prefill an empty prefix")
    check = should_stop or _stop_check.get()
    step = step or PREFILL_STEP
    cache = make_prompt_cache(model)
    ids = mx.array(tokens, dtype=mx.uint32)
    for start in range(0, len(tokens), step):
        if check is not None and check():
            raise PrefillStopped(f"prefill stopped after {start} of {len(tokens)} tokens")
        model(ids[start : start + step][None], cache=cache)
        if identity is not None:
            q = identity
            maybe_quantize_kv_cache(cache, q.quantized_kv_start, q.kv_group_size, q.kv_bits)
        mx.eval([c.state for c in cache])
        if on_chunk is not None:
            on_chunk(min(start + step, len(tokens)), len(tokens))
    return cache


def load_model(plan: ModelPlan):
    """Load the model for prefill (with the manifest's overrides) and check it is the one the
    fingerprint describes: same files (none changed while loading), same cache layout."""
    from mlx_lm import load

    identity = plan.spec.identity
    with foreign(lambda e: ModelError(f"model {plan.spec.path!r}: cannot load: {e}")):
        model, _ = load(
            str(plan.model_dir),
            adapter_path=identity.adapter,
            model_config=dict(identity.model_config or {}),
        )
    try:
        plan.fingerprint.check_unchanged(f"the daemon loaded model {plan.spec.path!r}")
    except ModelError as e:
        log.error("%s", e)
        raise
    layout = cache_layout(plan.model_dir, model)
    if layout != plan.fingerprint.layout:
        raise ModelError(f"model {plan.spec.path!r}: cache layout differs from its config's")
    return model


def release_model() -> None:
    gc.collect()
    import mlx.core as mx

    mx.clear_cache()


@dataclass(frozen=True)
class PrefillMemory:
    """What a prefill of `tokens` holds at its peak, in bytes: the KV it builds, and one chunk's
    attention scratch (the scores of `chunk` queries against every key so far, in every query
    head: what an attention that is not fused materializes)."""

    tokens: int
    kv: int
    scratch: int
    chunk: int

    @property
    def total(self) -> int:
        return self.kv + self.scratch


def prefill_memory(model, ntokens: int, *, step: int | None = None) -> PrefillMemory:
    """The memory a prefill of `ntokens` through `model` needs, from a one-token probe that is
    never evaluated (a graph only: no forward pass runs): per layer its KV bytes per token (a
    sliding window capped at its size plus a chunk; a fixed state counted once), and the query
    heads."""
    chunk = min(step or PREFILL_STEP, ntokens)
    cache = make_prompt_cache(model)
    model(mx.array([[0]], dtype=mx.uint32), cache=cache)  # lazy: shapes and dtypes only
    kv = 0
    itemsize = 2
    for c in _leaves(cache):
        arrays = [a for a in _flat(getattr(c, "keys", None)) + _flat(getattr(c, "values", None))]
        if arrays:
            held = arrays[0].shape[2]  # the sequence axis (grown in steps of the cache's own)
            per_token = sum(a.nbytes for a in arrays) // max(held, 1)
            cap = getattr(c, "max_size", None)
            # a window holds its size plus the chunk being added while that chunk runs
            window = cap + chunk if isinstance(cap, int) and cap > 0 else ntokens
            kv += per_token * min(ntokens, window)
            itemsize = arrays[0].dtype.size if arrays[0].dtype != mx.uint32 else itemsize
        else:
            kv += sum(a.nbytes for a in _flat(getattr(c, "state", None)))
    heads = _query_heads(model)
    return PrefillMemory(ntokens, kv, heads * chunk * ntokens * itemsize, chunk)


def _leaves(cache: list) -> list:
    out = []
    for c in cache:
        sub = getattr(c, "caches", None)  # CacheList
        out += _leaves(list(sub)) if isinstance(sub, (list, tuple)) else [c]
    return out


def _flat(x) -> list:
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (list, tuple)):
        return [a for y in x for a in _flat(y)]
    return []


def _query_heads(model) -> int:
    """The model's attention (query) heads, from its args (or their text_config); 1 if unknown."""
    args = getattr(model, "args", None)
    for a in (args, getattr(args, "text_config", None)):
        if isinstance(a, dict):
            n = a.get("num_attention_heads") or a.get("n_head")
        else:
            n = getattr(a, "num_attention_heads", None) or getattr(a, "n_head", None)
        if isinstance(n, int) and n > 0:
            return n
    return 1
