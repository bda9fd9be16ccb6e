"""How far one cache's KV is from another's: the relative RMS difference per layer (live KV only,
quantized KV dequantized), against a tolerance of 8 unit roundoffs of the KV dtype. Rounding a whole
tiny llama from float32 to float16 / bfloat16 moves its KV by 7.6e-4 / 6.1e-3 (0.8 roundoff), a
RoPE base override by 0.73; 8 roundoffs (float16 7.8e-3, bfloat16 6.3e-2, float32 9.5e-7) is ten
times the first and under a tenth of the second (`python -m bench.canary_noise`).

The one driver (kvstore.kvcheck.check) judges by it, for the upgrade canary, the import check and
the fleet check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.mlxlm import temporal_order

ROUNDOFFS = 8  # the tolerance, in unit roundoffs of the KV dtype (see the module docstring)


def _live(c: Any) -> tuple[list, float]:
    """A layer's live arrays as float32 (quantized KV dequantized) and its roundoff."""
    import mlx.core as mx

    name = type(c).__name__
    if name == "CacheList":
        parts = [_live(x) for x in c.caches]
        return [a for p, _ in parts for a in p], max((r for _, r in parts), default=0.0)
    if name == "QuantizedKVCache":
        out = [
            mx.dequantize(*q, group_size=c.group_size, bits=c.bits)[..., : c.offset, :]
            for q in (c.keys, c.values)
        ]
        return [a.astype(mx.float32) for a in out], _roundoff(c.keys[1].dtype) + 2.0**-c.bits
    if name == "RotatingKVCache" and getattr(c, "keys", None) is not None:
        # the window in time order, as much of it as every way of filling it keeps (a buffer
        # filled in one pass holds max_size - 1 + S, one filled token by token max_size)
        n = min(c.offset, c.max_size - 1)
        arrays = [
            temporal_order(c, v)[..., -n:, :] if n else v[..., :0, :] for v in (c.keys, c.values)
        ]
        return [a.astype(mx.float32) for a in arrays], _roundoff(arrays[0].dtype)
    live = {
        "KVCache": lambda: c.offset,
        "ChunkedKVCache": lambda: c.offset - c.start_position,
    }.get(name)
    if live is not None and getattr(c, "keys", None) is not None:
        n = live()
        arrays = [c.keys[..., :n, :], c.values[..., :n, :]]
    else:
        from mlx.utils import tree_flatten

        slots = getattr(c, "cache", None)  # ArraysCache: conv and recurrent state
        arrays = [v for _, v in tree_flatten(slots if slots is not None else c.state)]
        arrays = [v for v in arrays if isinstance(v, mx.array)]
    roundoff = max((_roundoff(a.dtype) for a in arrays), default=0.0)
    return [a.astype(mx.float32) for a in arrays], roundoff


def _roundoff(dtype: Any) -> float:
    import mlx.core as mx

    return {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-23}.get(dtype, 0.0)


@dataclass
class LayerDifference:
    """One layer of stored vs fresh KV, judged as the canary judges it."""

    layer: int
    cls: str
    difference: float  # relative RMS difference, stored vs fresh
    tolerance: float
    max_abs: float = 0.0
    position: int | None = None  # first sequence position over the tolerance (KV layers)
    layout: str | None = None  # the layers differ in class or shape: no number compares them

    @property
    def ok(self) -> bool:
        return self.layout is None and self.difference <= self.tolerance

    def describe(self) -> str:
        if self.layout is not None:
            return f"layer {self.layer}: {self.layout}"
        where = f", from position {self.position}" if self.position is not None else ""
        return (
            f"layer {self.layer} ({self.cls}){where}: relative RMS difference "
            f"{self.difference:.3g} over tolerance {self.tolerance:.3g} "
            f"(max abs diff {self.max_abs:.3g})"
        )


_SEQUENCE_AXIS = ("KVCache", "QuantizedKVCache", "ChunkedKVCache")  # live KV: [B, H, T, D]


def layer_differences(stored: list, fresh: list, *, first: int = 0) -> list[LayerDifference]:
    """Each layer's difference and tolerance; `first` is the position the KV starts at (a
    window compared at a later position), for naming the first position that differs."""
    import mlx.core as mx

    if len(stored) != len(fresh):
        return [_layout(0, "", f"{len(stored)} layers, the model makes {len(fresh)}")]
    out = []
    for i, (a, b) in enumerate(zip(stored, fresh)):
        cls = type(a).__name__
        if cls != type(b).__name__:
            out.append(_layout(i, cls, f"{cls} stored, the model makes {type(b).__name__}"))
            continue
        (xs, ra), (ys, rb) = _live(a), _live(b)
        if [x.shape for x in xs] != [y.shape for y in ys]:
            shapes = [tuple(x.shape) for x in xs], [tuple(y.shape) for y in ys]
            out.append(_layout(i, cls, f"{cls} shapes {shapes[0]} stored, {shapes[1]} fresh"))
            continue
        num = sum(mx.sum((x - y) ** 2).item() for x, y in zip(xs, ys))
        den = sum(mx.sum(y**2).item() for y in ys)
        d = LayerDifference(
            i,
            cls,
            (num / den) ** 0.5 if den else (0.0 if num == 0 else float("inf")),
            ROUNDOFFS * max(ra, rb),
            max((mx.max(mx.abs(x - y)).item() for x, y in zip(xs, ys) if x.size), default=0.0),
        )
        if not d.ok and cls in _SEQUENCE_AXIS and xs and xs[0].ndim == 4:
            pn = sum(mx.sum((x - y) ** 2, axis=(0, 1, 3)) for x, y in zip(xs, ys))
            pd = sum(mx.sum(y**2, axis=(0, 1, 3)) for y in ys)
            rel = mx.sqrt(pn / mx.maximum(pd, 1e-30)).tolist()
            over = [t for t, r in enumerate(rel) if r > d.tolerance]
            start = getattr(a, "start_position", 0) if cls == "ChunkedKVCache" else 0
            d.position = first + start + over[0] if over else None
        out.append(d)
    return out


def _layout(layer: int, cls: str, what: str) -> LayerDifference:
    return LayerDifference(layer, cls, float("inf"), 0.0, layout=what)


@dataclass(frozen=True)
class KVVerdict:
    """Stored KV against a model's own, per layer (`layers`), judged: `ok` when the largest
    difference is within the largest tolerance (a layout that differs is never ok); `over` names
    the layers past their own tolerance (the import's stricter reading)."""

    layers: list[LayerDifference]
    prefilled: int = 0  # tokens the check prefilled (0: the fresh KV was given)
    prefill_seconds: float = 0.0
    skipped: int = 0  # layers left out of the comparison (a state-only snapshot's emptied ones)

    @property
    def difference(self) -> float:
        layout = any(d.layout for d in self.layers)
        return float("inf") if layout else max((d.difference for d in self.layers), default=0.0)

    @property
    def tolerance(self) -> float:
        layout = any(d.layout for d in self.layers)
        return 0.0 if layout else max((d.tolerance for d in self.layers), default=0.0)

    @property
    def ok(self) -> bool:
        return self.difference <= self.tolerance

    @property
    def over(self) -> list[LayerDifference]:
        return [d for d in self.layers if not d.ok]


def kv_difference(stored: list, fresh: list) -> tuple[float, float]:
    """(largest per-layer relative RMS difference, the tolerance for these layers)."""
    v = KVVerdict(layer_differences(stored, fresh))
    return v.difference, v.tolerance
