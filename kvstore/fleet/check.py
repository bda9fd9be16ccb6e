"""The semantic check before first use: KV another box computed is compared with what this box's
own model computes for the same tokens before it is stored here. The first CHECK_TOKENS positions
are re-prefilled and compared with the object's first positions (kvstore.warm.kvdiff, the upgrade
canary's comparison and tolerance); all of it when shorter, and the whole entry for caches that
cannot be cut (final-state layouts) or whose KV is quantized. A mismatch quarantines every object
of that uploader (kvstore.fleet.queue.UploadQueue.quarantine) until `kvstore remote release`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.codec import codec

if TYPE_CHECKING:
    from kvstore.warm.plan import ModelPlan

CHECK_TOKENS = 64  # positions re-prefilled per object


@dataclass
class Verdict:
    ok: bool
    what: str  # "first 64 of 148 tokens: difference 1.2e-4, tolerance 7.8e-3"
    seconds: float


class SemanticCheck:
    """One model plan's check, its model loaded at the first object (then kept for the rest)."""

    def __init__(self, plan: ModelPlan):
        self.plan = plan
        self._model: Any = None
        self.load_seconds = 0.0

    def __call__(self, token_ids: list[int], blob: bytes | memoryview) -> Verdict:
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        from kvstore.warm.kvdiff import kv_difference
        from kvstore.warm.warm import load_model, prefill_pin

        if self._model is None:
            t = time.perf_counter()
            self._model = load_model(self.plan)
            self.load_seconds = time.perf_counter() - t
        t = time.perf_counter()
        stored, _ = codec.decode(blob, name="fetched object")
        n = len(token_ids)
        if n > CHECK_TOKENS and can_trim_prompt_cache(stored) and not self._quantized():
            trim_prompt_cache(stored, n - CHECK_TOKENS)
            n = CHECK_TOKENS
        fresh = prefill_pin(self._model, self.plan, token_ids[:n])
        diff, tol = kv_difference(stored, fresh)
        what = f"first {n} of {len(token_ids)} tokens: difference {diff:.3g}, tolerance {tol:.3g}"
        return Verdict(diff <= tol, what, time.perf_counter() - t)

    def _quantized(self) -> bool:
        return self.plan.spec.identity.kv_bits is not None

    def close(self) -> None:
        self._model = None
