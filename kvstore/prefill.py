"""Prefill exactly a pin's tokens with mlx-lm and return its evaluated cache objects."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

from kvstore.errors import PrefillStopped

PREFILL_STEP = 2048  # tokens per forward pass, as mlx_lm.generate's prefill_step_size

# The stop check of the prefills run inside `stop_when` (the daemon's shutdown), so callers in
# between (kvstore.warm) need not pass it down.
_stop_check: ContextVar[Callable[[], bool] | None] = ContextVar("prefill_stop", default=None)


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
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
    step: int = PREFILL_STEP,
    should_stop: Callable[[], bool] | None = None,
) -> list:
    """Run `tokens` through `model` into a fresh prompt cache, quantizing its KV the way
    generate(kv_bits=, kv_group_size=, quantized_kv_start=) does: after each chunk, every
    layer whose offset reached quantized_kv_start (mlx-lm's default 5000: shorter prefixes stay
    full precision, as they would in a cold run).

    `should_stop` (else the one of `stop_when`) is asked before each chunk: a long prefix stops
    within one chunk's forward pass rather than at its end."""
    if not tokens:
        raise ValueError("cannot prefill an empty prefix")
    check = should_stop or _stop_check.get()
    cache = make_prompt_cache(model)
    ids = mx.array(list(tokens), dtype=mx.uint32)
    for start in range(0, len(tokens), step):
        if check is not None and check():
            raise PrefillStopped(f"prefill stopped after {start} of {len(tokens)} tokens")
        model(ids[start : start + step][None], cache=cache)
        maybe_quantize_kv_cache(cache, quantized_kv_start, kv_group_size, kv_bits)
        mx.eval([c.state for c in cache])
    return cache
