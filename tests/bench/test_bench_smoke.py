"""Keep the benchmark harness from rotting: one tiny measurement each, checked for consistency
(no timing thresholds)."""

# bench/ is not an installed package: pytest's `pythonpath = ["."]` (pyproject) finds it
import pytest

from bench import hydrate, pipeline, run
from bench.shapes import HYBRID_9B, KV28_F16, make_cache
from kvstore.codec import codec
from kvstore.store.store import Store


def test_tiers_carry_the_motivating_prompt_totals():
    tiers = pipeline.tiers(1.0)
    totals = {}
    for name, tier in tiers.items():
        total, transcript = 0, 0
        for i, c in enumerate(tier["calls"]):
            if tier["chain"] and i:
                transcript += tier["tool_call"] + c["suffix"]
            else:
                transcript = c["static"] + c["suffix"]
            total += transcript
        totals[name] = (len(tier["calls"]), total)
    assert totals == {"standard": (4, 8880), "agentic": (4, 5749), "research": (12, 21989)}
    plan = pipeline._decode_plan(tiers["agentic"], {"prefill_tps": 2000, "decode_tps": 500})
    assert plan[:3] == [50, 50, 50] and plan[3] >= 50


def test_hybrid_shape_round_trips_with_its_byte_count():
    cache = make_cache(HYBRID_9B, 8)
    blob = codec.encode(cache)
    expected = HYBRID_9B.fixed_bytes + 8 * HYBRID_9B.bytes_per_token
    assert expected <= len(blob) < expected + 64 * 1024  # header and scalars on top
    decoded, _ = codec.decode(blob)
    assert [type(c).__name__ for c in decoded] == codec.cache_classes(cache)


def test_hydrate_measurement_and_targets(tmp_path):
    """Every alternative timed on the one entry stored (the hydrate alternative itself asserts it
    hydrated exactly that one entry), the figures derived from the timings, and each target's
    verdict the comparison of its figure with its threshold."""
    rows = hydrate.measure_one(tmp_path, KV28_F16, 1, reps=2)
    tokens = KV28_F16.tokens_for(hydrate.MB)
    expected = KV28_F16.fixed_bytes + tokens * KV28_F16.bytes_per_token
    assert [r["regime"] for r in rows] == ["fresh", "reused"]
    for r in rows:
        assert (r["shape"], r["size_mb"], r["tokens"]) == (KV28_F16.name, 1, tokens)
        assert expected <= r["nbytes"] < expected + 64 * 1024  # the entry's blob, header on top
        stats = r["stats"]
        assert set(stats) == set(r["gbps"]) == set(hydrate.ALTERNATIVES)
        for name, st in stats.items():
            assert st["n"] == 2 and 0 < st["min"] <= st["median"] <= st["max"], (name, st)
            assert r["gbps"][name] == pytest.approx(r["nbytes"] / st["median"] / 1e9)
        lpc = stats["load_prompt_cache"]["median"]
        assert r["kvstore_vs_load_prompt_cache"] == pytest.approx(lpc / stats["kvstore"]["median"])
        hydrated = stats["kvstore.client.hydrate"]["median"]
        assert r["hydrate_vs_load_prompt_cache"] == pytest.approx(lpc / hydrated)
    with Store(tmp_path, readonly=True) as store:
        assert list(store.metas()) == []  # the measured entry is deleted afterwards

    targets = run.targets({"hydrate": {"rows": rows}})
    fresh, reused = rows
    figures = [
        (reused["hydrate_vs_load_prompt_cache"], 1),
        (fresh["kvstore_vs_load_prompt_cache"], 1),
        (fresh["gbps"]["kvstore"], 4),
        (reused["kvstore_vs_load_prompt_cache"], 1),
        (reused["gbps"]["kvstore"], 4),
    ]
    assert len(targets) == len(figures)
    for t, (figure, threshold) in zip(targets, figures, strict=True):
        assert t["measured"] == round(figure, 2), t
        assert t["ok"] is (figure >= threshold), t


def test_fleet_targets():
    fleet = {
        "n": 4,
        "boxes_2_to_n_prefill_s": 0,
        "boxes_2_to_n_models_loaded": 0,
        "local": {"total_prefill_s": 8.0},
        "fleet": {"total_prefill_s": 2.0},
    }
    zero, ratio = run.targets({"fleet": fleet})
    assert zero["ok"] is True and ratio["measured"] == 0.25
    fleet["boxes_2_to_n_prefill_s"] = 0.5  # a box that prefilled misses the target
    assert run.targets({"fleet": fleet})[0]["ok"] is False
