"""Prefill exactly a pin's tokens with mlx-lm and return its evaluated cache objects."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

PREFILL_STEP = 2048  # tokens per forward pass, as mlx_lm.generate's prefill_step_size


def prefill(
    model,
    tokens: Sequence[int],
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
    step: int = PREFILL_STEP,
) -> list:
    """Run `tokens` through `model` into a fresh prompt cache, quantizing its KV the way
    generate(kv_bits=, kv_group_size=, quantized_kv_start=) does: after each chunk, every
    layer whose offset reached quantized_kv_start (mlx-lm's default 5000: shorter prefixes stay
    full precision, as they would in a cold run)."""
    if not tokens:
        raise ValueError("cannot prefill an empty prefix")
    cache = make_prompt_cache(model)
    ids = mx.array(list(tokens), dtype=mx.uint32)
    for start in range(0, len(tokens), step):
        model(ids[start : start + step][None], cache=cache)
        maybe_quantize_kv_cache(cache, quantized_kv_start, kv_group_size, kv_bits)
        mx.eval([c.state for c in cache])
    return cache
