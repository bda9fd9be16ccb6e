"""Does an imported prompt-cache file fit the model it is filed under?

The model's own shapes come from a probe: the model is loaded lazily (no weight is read) and one
token is run through it into a fresh cache without evaluating anything, so each layer's KV heads,
head dim and dtype are known from the graph alone. Each layer of the file must match: heads, head
dims and dtype (quantized KV: the dtype of its scales and the head dim it unpacks to), and
quantization bits and group size must be what mlx-lm's QuantizedKVCache produces.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvstore.degrade import foreign
from kvstore.errors import KVStoreError
from kvstore.identity.model import (  # what a manifest (and generate) may ask for
    KV_BITS,
    KV_GROUP_SIZES,
    ModelIdentity,
)
from kvstore.kvcheck.check import check_kv, kv_view
from kvstore.kvcheck.kvdiff import KVVerdict

_KV_CLASSES = ("KVCache", "RotatingKVCache", "ChunkedKVCache", "QuantizedKVCache")


class ImportMismatch(KVStoreError):
    """A prompt-cache file does not fit the model it was said to come from."""


def _layer(c: Any, where: str) -> list[tuple]:
    """(part, shape with the sequence axis as None, dtype) of one cache layer's state."""
    name = type(c).__name__
    if name == "CacheList":
        return [x for i, sub in enumerate(c.caches) for x in _layer(sub, f"{where}.{i}")]
    if name == "QuantizedKVCache":
        bits, group = c.bits, c.group_size
        if bits not in KV_BITS or group not in KV_GROUP_SIZES:
            raise ImportMismatch(
                f"{where}: quantized with bits={bits}, group_size={group}; kvstore serves KV "
                f"quantized as mlx-lm does for kv_bits in {KV_BITS}, group_size in {KV_GROUP_SIZES}"
            )
        out = []
        for part, (packed, scales, _) in (("keys", c.keys), ("values", c.values)):
            dim = packed.shape[-1] * 32 // bits
            if dim % group or scales.shape[-1] * group != dim:
                raise ImportMismatch(
                    f"{where}: {part} scales do not fit head dim {dim} with group_size {group}"
                )
            out.append((part, (packed.shape[0], packed.shape[1], None, dim), _dtype(scales)))
        return out
    if name in _KV_CLASSES:
        return [
            (part, (a.shape[0], a.shape[1], None, a.shape[3]), _dtype(a))
            for part, a in (("keys", c.keys), ("values", c.values))
        ]
    slots = getattr(c, "cache", None)  # ArraysCache: conv and recurrent state, no sequence axis
    if not isinstance(slots, list):
        return [(name, None, None)]
    return [
        (f"state {i}", None if a is None else tuple(a.shape), None if a is None else _dtype(a))
        for i, a in enumerate(slots)
    ]


def probe_layers(model_dir: Path, *, adapter: str | None, model_config: dict | None) -> list:
    """The model's per-layer state shapes and dtypes after one token, computed lazily."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_adapters, load_model

    with foreign(lambda e: KVStoreError(f"model {model_dir}: cannot probe its KV layout: {e}")):
        model, _ = load_model(model_dir, lazy=True, model_config=dict(model_config or {}))
        if adapter is not None:
            model = load_adapters(model, adapter)
        cache = make_prompt_cache(model)
        model(mx.array([[0]], dtype=mx.uint32), cache=cache)  # a graph only: nothing evaluated
    return [_layer(c, f"layer {i}") for i, c in enumerate(cache)]


def _same_model(named: str, given: str, model_dir: Path) -> bool:
    """The file's `model` metadata names the same model: as given, as resolved, or by its final
    name (a hub id and a local directory of it)."""
    if named == given:
        return True
    try:
        from kvstore.identity.fingerprint import resolve_model_path

        if resolve_model_path(named) == model_dir:
            return True
    except KVStoreError:
        pass
    tail = Path(named.rstrip("/")).name.lower()
    return tail in {Path(given.rstrip("/")).name.lower(), model_dir.name.lower()}


def check_fits(
    cache: list,
    metadata: dict,
    *,
    file: Path,
    model: str,
    model_dir: Path,
    adapter: str | None = None,
    model_config: dict | None = None,
) -> None:
    """Raise ImportMismatch naming the first layer (or the metadata) that does not fit."""
    named = metadata.get("model")
    if isinstance(named, str) and named and not _same_model(named, model, model_dir):
        raise ImportMismatch(
            f"{file}: made with model {named!r} (its metadata), which does not match model "
            f"{model!r}; import it with the model it was made with"
        )
    want = probe_layers(model_dir, adapter=adapter, model_config=model_config)
    if len(want) != len(cache):
        raise ImportMismatch(
            f"{file}: {len(cache)} cache layers, but model {model!r} has {len(want)}"
        )
    for i, (c, expected) in enumerate(zip(cache, want)):
        got = _layer(c, f"layer {i}")
        if got != expected:
            bad = (
                next((g, e) for g, e in zip(got, expected) if g != e)
                if len(got) == len(expected)
                else (got, expected)
            )
            raise ImportMismatch(
                f"{file}: layer {i} ({type(c).__name__}) does not fit model {model!r}: "
                f"{_say(bad[0])} in the file, {_say(bad[1])} in the model "
                "(KV heads, head dim, dtype); was it made with another model or dtype?"
            )


def _dtype(a: Any) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def _say(part: Any) -> str:
    if isinstance(part, tuple) and len(part) == 3 and isinstance(part[0], str):
        name, shape, dtype = part
        if shape is not None and len(shape) == 4 and shape[2] is None:
            return f"{name} with {shape[1]} heads of dim {shape[3]}, {dtype}"
        return f"{name} {shape} {dtype}"
    return str(part)


# -- is it this model's KV of these tokens? ------------------------------------------------------

FULL_CHECK_TOKENS = 1024  # up to this many tokens every position is re-prefilled and compared
SAMPLE_WINDOWS = 8  # beyond it (plain KV caches): windows of positions spread to the very end,
SAMPLE_WINDOW = 32  # each computed on the cache's own earlier KV and compared


@contextmanager
def loaded_for_check(identity: ModelIdentity, model_dir: Path, fp) -> Iterator[Any]:
    """The model loaded as `identity` names it (adapter, overrides; from its resolved
    `model_dir`) for a check, its files unchanged since `fp` was computed; released afterwards."""
    from mlx_lm import load

    from kvstore.kvcheck.prefill import release_model

    with foreign(
        lambda e: KVStoreError(f"model {identity.path!r}: cannot load it to check KV: {e}")
    ):
        loaded, _ = load(
            str(model_dir),
            adapter_path=identity.adapter,
            model_config=dict(identity.model_config or {}),
        )
    try:
        fp.check_unchanged(f"checking KV against model {identity.path!r}")
        yield loaded
    finally:
        del loaded
        release_model()


def _as_stored(stored: list, fresh: list) -> tuple[list, list]:
    """The fresh layers quantized as the stored ones are (same bits and group size)."""
    return stored, [
        f.to_quantized(group_size=s.group_size, bits=s.bits)
        if type(s).__name__ == "QuantizedKVCache" and type(f).__name__ == "KVCache"
        else f
        for s, f in zip(stored, fresh)
    ]


def kv_check(model, cache: list, tokens: list[int], *, what: str) -> str:
    """Compare `cache` with what `model` computes for `tokens` by the one KV check
    (kvstore.kvcheck.check, the upgrade canary's tolerance); raise ImportMismatch naming the
    first layer and position that differ. Caches of up to FULL_CHECK_TOKENS tokens, and those
    that keep a window or a final state only, are re-prefilled whole; longer plain KV caches are
    compared on their first FULL_CHECK_TOKENS positions (a prefix re-prefilled) and on
    SAMPLE_WINDOWS windows spread to their end. Returns what was compared, in words."""
    import mlx.core as mx

    def judge(verdict: KVVerdict) -> None:
        if bad := verdict.over:
            worst = min(bad, key=lambda d: (d.position is None, d.position or 0, d.layer))
            raise ImportMismatch(
                f"{what + ': ' if what else ''}not the KV this model computes for these "
                f"tokens: {worst.describe()}"
                f"{f' ({len(bad)} layers differ)' if len(bad) > 1 else ''}; was it made with "
                "another model or another prompt?"
            )

    n = len(tokens)
    plain = all(type(c).__name__ == "KVCache" for c in cache)
    if n <= FULL_CHECK_TOKENS or not plain:
        judge(check_kv(model, cache, tokens, match=_as_stored))
        return f"all {n} positions" if plain else f"the whole prompt ({n} tokens)"
    judge(check_kv(model, kv_view(cache, 0, FULL_CHECK_TOKENS), tokens[:FULL_CHECK_TOKENS]))
    span = max(0, n - FULL_CHECK_TOKENS - SAMPLE_WINDOW)
    starts = sorted(
        {FULL_CHECK_TOKENS + span * i // max(1, SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)}
    )
    checked = FULL_CHECK_TOKENS
    for p in starts:
        end = min(n, p + SAMPLE_WINDOW)
        ctx = kv_view(cache, 0, p)
        model(mx.array(tokens[p:end], dtype=mx.uint32)[None], cache=ctx)
        mx.eval([c.state for c in ctx])
        judge(check_kv(model, kv_view(cache, p, end), fresh=kv_view(ctx, p, end), first=p))
        checked += end - p
    return f"{checked} of {n} positions (the first {FULL_CHECK_TOKENS} and {len(starts)} windows)"
