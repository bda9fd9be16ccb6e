"""Learned block records as codec blobs: which caches can be cut into records, cutting one,
checking one's header, and assembling a cache from a chain of them.

A record holds every layer's KV of positions [start, end) as a KVCache (or QuantizedKVCache) with
offset = end - start, in the codec's ordinary layout, so it is validated like any entry. mlx is
imported inside the functions: `kvstore.learned.blockstore` imports this module's `inspect` lazily.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import CodecError

RECORD_CLASSES = ("KVCache", "QuantizedKVCache")


def sliceable(cache: list) -> bool:
    """Every layer is a KVCache or QuantizedKVCache, or a RotatingKVCache that never wrapped
    (its positions are still in order): such a cache can be cut into records and trimmed."""
    for c in cache:
        name = type(c).__name__
        if name in RECORD_CLASSES:
            continue
        if name == "RotatingKVCache" and c.offset <= c.max_size:
            continue
        return False
    return bool(cache)


def kv_layers(cache: list) -> list[int]:
    """The layers of a state layout whose KV can be cut into records (KVCache,
    QuantizedKVCache); [] when there are none, or when every layer can be (then the whole cache
    is sliceable)."""
    out = [i for i, c in enumerate(cache) if type(c).__name__ in RECORD_CLASSES]
    return out if len(out) < len(cache) else []


def state_part(cache: list, layers: list[int]) -> list:
    """The cache with `layers` emptied (a KVCache holding nothing): what a state-only snapshot
    stores; its KV layers are block records."""
    from mlx_lm.models.cache import KVCache

    keep = set(layers)
    return [KVCache() if i in keep else c for i, c in enumerate(cache)]


def slice_record(cache: list, start: int, end: int, *, layers: list[int] | None = None) -> bytes:
    """Every layer's KV positions [start, end) as one record blob (or only `layers`': a state
    layout's cuttable layers)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from kvstore.codec import codec

    if layers is not None:
        cache = [cache[i] for i in layers]
    if not sliceable(cache):
        raise CodecError("slice_record: the cache has layers that cannot be sliced")
    out = []
    for c in cache:
        if c.offset < end:
            raise CodecError(f"slice_record: a layer holds {c.offset} positions, not {end}")
        if type(c).__name__ == "QuantizedKVCache":
            b = QuantizedKVCache(group_size=c.group_size, bits=c.bits)
            b.keys = tuple(x[..., start:end, :] for x in c.keys)
            b.values = tuple(x[..., start:end, :] for x in c.values)
        else:  # KVCache, and a RotatingKVCache inside its window, stored as plain KV
            b = KVCache()
            b.keys, b.values = c.keys[..., start:end, :], c.values[..., start:end, :]
        b.offset = end - start
        out.append(b)
    return codec.encode(out)


def inspect(blob: bytes, ntokens: int, *, name: str = "record") -> list[str]:
    """Validate a record blob's header without building arrays: every layer a KVCache or
    QuantizedKVCache holding `ntokens` positions. Returns its classes; raises CodecError."""
    from kvstore.codec import codec

    classes, states = codec.validate(blob, name=name)
    for i, (cls, st) in enumerate(zip(classes, states, strict=True)):
        if cls not in RECORD_CLASSES:
            raise CodecError(f"{name}: layer {i} is {cls}; records hold {RECORD_CLASSES}")
        if st[2] != ntokens:
            raise CodecError(f"{name}: layer {i} holds {st[2]} positions, not {ntokens}")
    return list(classes)


def assemble(blobs: list[bytes], metas: list[Any], served: int, template: list) -> list:
    """A prompt cache of `served` tokens from a chain of records (the last one trimmed), built in
    the template's classes (template = make_prompt_cache(model)): KV layers become KVCache, or
    QuantizedKVCache where the records are quantized (plain parts are quantized to match, which
    is exact); rotating layers keep the template's max_size and keep. Evaluated. `metas` are
    kvstore.learned.blockstore.BlockMeta (start, end), not imported here: the store imports the
    codec."""
    import mlx.core as mx

    from kvstore.codec import codec
    from kvstore.codec.cache_state import rebuild

    if len(blobs) != len(metas) or not metas:
        raise CodecError("assemble: one blob per record, at least one")
    if metas[0].start != 0 or not metas[-1].start < served <= metas[-1].end:
        raise CodecError(f"assemble: {served} tokens are not served by this chain")
    layers: list[list[Any]] = [[] for _ in template]
    for blob, m in zip(blobs, metas, strict=True):
        cache, _ = codec.decode(blob, name=f"record {m.key.hex()}", checksum=m.checksum)
        if len(cache) != len(template):
            raise CodecError(f"record {m.key.hex()}: {len(cache)} layers, the model has "
                             f"{len(template)}")  # fmt: skip
        take = min(m.end, served) - m.start
        for i, c in enumerate(cache):
            layers[i].append((c, take))
    out = []
    for t, parts in zip(template, layers, strict=True):
        quant = next((c for c, _ in parts if type(c).__name__ == "QuantizedKVCache"), None)
        if quant is not None:
            gs, bits = quant.group_size, quant.bits
            ks, vs = [], []
            for c, take in parts:
                if type(c).__name__ == "KVCache":
                    k = mx.quantize(c.keys[..., :take, :], group_size=gs, bits=bits)
                    v = mx.quantize(c.values[..., :take, :], group_size=gs, bits=bits)
                else:
                    k = tuple(x[..., :take, :] for x in c.keys)
                    v = tuple(x[..., :take, :] for x in c.values)
                ks.append(k)
                vs.append(v)
            keys = tuple(mx.concatenate([k[j] for k in ks], axis=-2) for j in range(3))
            values = tuple(mx.concatenate([v[j] for v in vs], axis=-2) for j in range(3))
            layer = rebuild("QuantizedKVCache", [list(keys), list(values), served, gs, bits])
        else:
            keys = mx.concatenate([c.keys[..., :take, :] for c, take in parts], axis=-2)
            values = mx.concatenate([c.values[..., :take, :] for c, take in parts], axis=-2)
            if type(t).__name__ == "RotatingKVCache":
                if served > t.max_size:
                    raise CodecError("assemble: more tokens than the rotating window holds")
                layer = rebuild("RotatingKVCache", [keys, values, served, t.keep, t.max_size,
                                                    served])  # fmt: skip
            else:
                layer = rebuild("KVCache", [keys, values, served])
        out.append(layer)
    mx.eval([codec.cache_api.state(c) for c in out])
    return out
