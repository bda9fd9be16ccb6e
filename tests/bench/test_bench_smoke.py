"""Keep the benchmark harness from rotting: one tiny measurement each, no timing assertions."""

# bench/ is not an installed package: pytest's `pythonpath = ["."]` (pyproject) finds it
from bench import hydrate, pipeline, run
from bench.shapes import HYBRID_9B, KV28_F16, make_cache
from kvstore.codec import codec


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
    rows = hydrate.measure_one(tmp_path, KV28_F16, 1, reps=1)
    assert [r["regime"] for r in rows] == ["fresh", "reused"]
    assert set(rows[0]["gbps"]) == set(hydrate.ALTERNATIVES)
    assert all(v > 0 for r in rows for v in r["gbps"].values())
    targets = run.targets({"hydrate": {"rows": rows}})
    assert len(targets) == 5 and all(t["ok"] in (True, False) for t in targets)


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
