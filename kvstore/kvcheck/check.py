"""The one KV check: prefill, compare, decide. The upgrade canary (kvstore.warm.canary),
`kvstore import`'s check (kvstore.warm.importfit.kv_check) and the fleet check
(kvstore.fleet.check) each call `check_kv` and read its verdict (tests/test_rules.py holds them to
it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.kvcheck.kvdiff import KVVerdict, layer_differences

if TYPE_CHECKING:
    import mlx.nn as nn

    from kvstore.identity.model import ModelIdentity

Match = Callable[[list, list], tuple[list, list]]  # (stored, fresh) made comparable


def check_kv(
    model: nn.Module | None,
    stored: list,
    tokens: Sequence[int] = (),
    *,
    identity: ModelIdentity | None = None,
    fresh: list | None = None,
    first: int = 0,
    match: Match | None = None,
) -> KVVerdict:
    """`stored` (the KV of `tokens`) against this model's own: prefilled here with `identity`'s
    KV quantization unless `fresh` is given (a window or a step run on the stored KV), made
    comparable by `match(stored, fresh)`, compared per layer (`first`: the position the KV starts
    at) and judged."""
    took, n = 0.0, 0
    if fresh is None:
        from kvstore.kvcheck.prefill import prefill

        t = time.perf_counter()
        fresh = prefill(model, tokens, identity=identity)
        took, n = time.perf_counter() - t, len(tokens)
    skipped = 0
    if match is not None:
        before = len(stored)
        stored, fresh = match(stored, fresh)
        skipped = before - len(stored)
    return KVVerdict(layer_differences(stored, fresh, first=first), n, took, skipped)


def kv_view(cache: list, start: int, end: int) -> list:
    """Plain KVCache layers holding positions [start, end) of `cache`'s plain KV layers: views,
    the arrays only sliced (the stored cache is left as it was, and may be inserted as it is)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        k = KVCache()  # attributes, not `state`: its setter differs between mlx-lm 0.31 and 0.32
        k.keys, k.values = c.keys[..., start:end, :], c.values[..., start:end, :]
        k.offset = end - start
        out.append(k)
    return out
