"""Prefill exactly a pin's tokens with mlx-lm and return its evaluated cache objects."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

from kvstore.errors import PrefillStopped
from kvstore.identity.model import ModelIdentity
from kvstore.identity.modelconfig import config_vocab_size  # noqa: F401  (kvstore.warm.transfer)

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
    tokens: Iterable, vocab: int | None, *, what: str = "tokens"
) -> tuple[int, ...]:
    """The ids as ints, or ValueError naming the first one outside 0 .. vocab-1: mlx indexes the
    embedding unchecked, so such an id would crash the process (SIGSEGV), not raise."""
    out = []
    for i, t in enumerate(tokens):
        try:
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
    step: int = PREFILL_STEP,
    should_stop: Callable[[], bool] | None = None,
) -> list:
    """Run `tokens` through `model` into a fresh prompt cache, quantizing its KV the way
    generate(kv_bits=, kv_group_size=, quantized_kv_start=) does with `identity`'s settings (none:
    full precision): after each chunk, every layer whose offset reached quantized_kv_start
    (mlx-lm's default 5000: shorter prefixes stay full precision, as they would in a cold run).

    `should_stop` (else the one of `stop_when`) is asked before each chunk: a long prefix stops
    within one chunk's forward pass rather than at its end."""
    tokens = check_token_ids(tokens, model_vocab_size(model), what="prefill")
    if not tokens:
        raise ValueError("cannot prefill an empty prefix")
    check = should_stop or _stop_check.get()
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
    return cache
