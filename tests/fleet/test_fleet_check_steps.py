"""The semantic check's steps at positions drawn at random (kvstore.fleet.check, no server): past
the first 64 positions of a cuttable entry, a few positions the checking box draws get one
decoding step of the stored token over the stored KV before it, compared with the stored K/V
there. A bulk change past 64 (as a box holding the fleet key could seal) is refused; honest KV
passes; the draw spreads over the whole entry and cannot be known in advance."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import mlx_lm_prefill
from mlx_lm import load as mlx_load

from kvstore.fleet import check as fleet_check
from kvstore.identity.model import ModelIdentity
from kvstore.learned.records import slice_record

TOKENS = [(7 * i) % 500 + 3 for i in range(900)]


def scaled(cache: list, lo: int, hi: int, factor: float = 1.5) -> list:
    """`cache` with positions [lo, hi) of every layer's keys and values multiplied by `factor`."""
    for c in cache:
        pos = mx.arange(c.keys.shape[2])[None, None, :, None]
        scale = mx.where((pos >= lo) & (pos < hi), factor, 1.0).astype(c.keys.dtype)
        c.keys, c.values = c.keys * scale, c.values * scale
        mx.eval(c.keys, c.values)
    return cache


@pytest.fixture(scope="module")
def llama(llama_path):
    model, _ = mlx_load(str(llama_path))
    return model, ModelIdentity(str(llama_path))


def test_draws_spread_over_the_whole_entry_past_the_prefix_and_differ_each_time():
    k = fleet_check.SPOT_CHECKS
    edges = [64 + (900 - 64) * i // k for i in range(k + 1)]  # k equal stretches of [64, 900)
    draws = [fleet_check.spot_positions(900) for _ in range(20)]
    for d in draws:
        assert len(d) == k and all(lo <= p < hi for p, lo, hi in zip(d, edges, edges[1:])), d
    assert len({tuple(d) for d in draws}) > 1  # not a fixed set an uploader could avoid
    assert fleet_check.spot_positions(64) == [] and fleet_check.spot_positions(66) == [64, 65]


def test_honest_kv_passes_with_steps_and_is_left_as_it_was(llama):
    model, identity = llama
    stored = mlx_lm_prefill(model, TOKENS)
    before = [mx.array(c.keys) for c in stored]
    v = fleet_check.check_cache(model, identity, TOKENS, stored)
    assert v.ok, v.what
    assert "first 64 of 900 tokens" in v.what and "8 drawn positions stepped" in v.what
    assert all(c.offset == 900 for c in stored)
    assert all(mx.array_equal(b, c.keys).item() for b, c in zip(before, stored))


def test_a_bulk_tamper_past_the_first_64_positions_is_refused(llama):
    model, identity = llama
    stored = scaled(mlx_lm_prefill(model, TOKENS), 100, 867)
    for _ in range(5):  # whatever the draw
        v = fleet_check.check_cache(model, identity, TOKENS, stored)
        assert not v.ok and "first 64 of 900 tokens: difference 0" in v.what, v.what
        assert "drawn positions stepped, position " in v.what
    # a step after the changed stretch sees it too: it attends to every position before it
    v = fleet_check.check_cache(model, identity, TOKENS, stored, positions=[880])
    assert not v.ok and "position 880" in v.what, v.what
    v = fleet_check.check_cache(model, identity, TOKENS, stored, positions=[70, 90])
    assert v.ok, v.what  # before the change: what the prefix check alone saw


def test_a_learned_chains_first_record_is_stepped_past_64(llama):
    model, identity = llama
    tokens = TOKENS[:300]
    honest = mlx_lm_prefill(model, tokens)
    assert fleet_check.check_record(model, identity, tokens, slice_record(honest, 0, 300)).ok
    forged = slice_record(scaled(mlx_lm_prefill(model, tokens), 100, 300), 0, 300)
    v = fleet_check.check_record(model, identity, tokens, forged)
    assert not v.ok and "drawn positions stepped, position " in v.what, v.what


def test_a_state_layout_is_still_re_prefilled_whole(hybrid_path):
    """A hybrid cache cannot be cut: its whole entry is re-prefilled, which sees a change past
    64 with no step."""
    model, _ = mlx_load(str(hybrid_path))
    identity = ModelIdentity(str(hybrid_path))
    tokens = TOKENS[:200]
    stored = mlx_lm_prefill(model, tokens)
    assert fleet_check.check_cache(model, identity, tokens, stored).ok
    for c in stored:
        if getattr(c, "keys", None) is not None:
            scaled([c], 100, 200)
    v = fleet_check.check_cache(model, identity, tokens, stored)
    assert not v.ok and "first 200 of 200 tokens" in v.what and "stepped" not in v.what


def test_verify_deep_judges_an_entry_by_its_steps(llama):
    """`kvstore verify --deep`'s judge of a manifest's pin: the same check (kvstore.cli.admin)."""
    from kvstore.cli.admin import _entry_judge
    from kvstore.warm.importfit import ImportMismatch

    model, identity = llama

    class Meta:
        key = b"k"

        @staticmethod
        def token_ids() -> list[int]:
            return TOKENS

    judge = _entry_judge({b"k"})
    assert "drawn positions stepped" in judge(model, identity, Meta, mlx_lm_prefill(model, TOKENS))
    with pytest.raises(ImportMismatch, match="drawn positions stepped, position"):
        judge(model, identity, Meta, scaled(mlx_lm_prefill(model, TOKENS), 100, 867))
