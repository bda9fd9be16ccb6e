"""The upgrade canary: does the installed mlx / mlx-lm still compute the KV that is stored?

The fingerprint covers the mlx-lm source that computes the KV, but not mlx's compiled kernels; a
release can change the KV with no source change we hash. So after an upgrade, one short pin per
model is prefilled again and compared with its stored entry. The comparison is the relative RMS
difference per layer (live KV only, quantized KV dequantized), against a tolerance of 8 unit
roundoffs of the KV dtype: rounding a whole tiny llama from float32 to float16 / bfloat16 moves its
KV by 7.6e-4 / 6.1e-3 (0.8 roundoff), a RoPE base override by 0.73; 8 roundoffs (float16 7.8e-3,
bfloat16 6.3e-2, float32 9.5e-7) is ten times the first and under a tenth of the second
(`python -m bench.canary_noise`).

`kvstore verify --deep` runs it on demand; the daemon after an upgrade (daemon.canary). The
versions a home's daemon last ran with are kept in HOME/runtime.json.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.settings import write_atomically

log = logging.getLogger("kvstore")

RUNTIME_NAME = "runtime.json"  # the mlx / mlx-lm versions the home's daemon last ran with
ROUNDOFFS = 8  # the tolerance, in unit roundoffs of the KV dtype (see the module docstring)


@dataclass
class CanaryResult:
    model: str
    label: str  # the pin re-prefilled
    key: str
    tokens: int
    difference: float  # largest per-layer relative RMS difference, stored vs fresh
    tolerance: float
    error: str | None = None  # the check itself failed (load, decode): not a verdict on the KV

    @property
    def ok(self) -> bool:
        return self.error is None and self.difference <= self.tolerance


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
    live = {
        "KVCache": lambda: c.offset,
        "ChunkedKVCache": lambda: c.offset - c.start_position,
        "RotatingKVCache": lambda: min(c.offset, c.max_size),  # the window, in buffer order
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


def kv_difference(stored: list, fresh: list) -> tuple[float, float]:
    """(largest per-layer relative RMS difference, the tolerance for these layers)."""
    import mlx.core as mx

    if [type(c).__name__ for c in stored] != [type(c).__name__ for c in fresh]:
        return float("inf"), 0.0
    worst, tolerance = 0.0, 0.0
    for a, b in zip(stored, fresh):
        (xs, ra), (ys, rb) = _live(a), _live(b)
        if [x.shape for x in xs] != [y.shape for y in ys]:
            return float("inf"), 0.0
        num = sum(mx.sum((x - y) ** 2).item() for x, y in zip(xs, ys))
        den = sum(mx.sum(y**2).item() for y in ys)
        worst = max(worst, (num / den) ** 0.5 if den else (0.0 if num == 0 else float("inf")))
        tolerance = max(tolerance, ROUNDOFFS * max(ra, rb))
    return worst, tolerance


def check_plan(plan: Any, store: Any, model: Any = None) -> CanaryResult | None:
    """Re-prefill the shortest present pin of a planned model (kvstore.warm.ModelPlan) and compare
    it with its stored entry. None when the model has no pin stored. Loads the model (with the
    plan's overrides) unless given one; the caller releases it."""
    from kvstore.warm import load_model, prefill_pin

    present = [pp for pp in plan.pins if pp.present]
    if not present:
        return None
    pp = min(present, key=lambda p: len(p.pin.tokens))
    result = CanaryResult(plan.spec.path, pp.pin.name, pp.key.hex(), len(pp.pin.tokens), 0.0, 0.0)
    try:
        _, stored = store.load(pp.key)
        model = model if model is not None else load_model(plan)
        fresh = prefill_pin(model, plan, pp.pin.tokens)
    except (KVStoreError, KeyError, ValueError, RuntimeError) as e:
        result.error = str(e)
        return result
    result.difference, result.tolerance = kv_difference(stored, fresh)
    return result


def check_manifest(manifest: Any, store: Any, *, home: Path) -> list[CanaryResult]:
    """The canary for every model of a manifest, one model loaded at a time."""
    from kvstore.warm import plan_model, release_model

    out = []
    for spec in manifest.models:
        try:
            plan = plan_model(spec, store, home=home)
        except KVStoreError as e:
            out.append(CanaryResult(spec.path, "", "", 0, 0.0, 0.0, error=str(e)))
            continue
        result = check_plan(plan, store)
        release_model()
        if result is not None:
            out.append(result)
    return out


def describe(result: CanaryResult) -> str:
    if result.error:
        return f"{result.model}: canary pin {result.label!r} could not be checked: {result.error}"
    verdict = "matches" if result.ok else "DIFFERS from"
    return (
        f"{result.model}: pin {result.label!r} ({result.tokens} tokens) re-prefilled {verdict} "
        f"its stored KV (relative RMS difference {result.difference:.3g}, tolerance "
        f"{result.tolerance:.3g})"
    )


def stored_versions(home: Path) -> dict | None:
    try:
        data = json.loads((home / RUNTIME_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save_versions(home: Path, versions: dict) -> None:
    path = home / RUNTIME_NAME
    try:
        write_atomically(path, json.dumps(versions, sort_keys=True).encode())
    except OSError as e:
        log.warning("cannot record the mlx versions in %s: %s", path, e)
