"""Prefill exactly a pin's tokens with mlx-lm and return its evaluated cache objects."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

PREFILL_STEP = 2048  # tokens per forward pass, as mlx_lm.generate's prefill_step_size


def prefill(
    model,
    tokens: Sequence[int],
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    step: int = PREFILL_STEP,
) -> list:
    """Run `tokens` through `model` into a fresh prompt cache, quantized as generate(kv_bits=)."""
    if not tokens:
        raise ValueError("cannot prefill an empty prefix")
    cache = make_prompt_cache(model)
    ids = mx.array(list(tokens), dtype=mx.uint32)
    for start in range(0, len(tokens), step):
        model(ids[start : start + step][None], cache=cache)
        mx.eval([c.state for c in cache])
    if kv_bits is not None:
        cache = [
            c.to_quantized(group_size=kv_group_size, bits=kv_bits)
            if hasattr(c, "to_quantized") and type(c).__name__ == "KVCache"
            else c
            for c in cache
        ]
        mx.eval([c.state for c in cache])
    return cache
