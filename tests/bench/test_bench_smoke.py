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


def test_first_generate_bench_runs_and_its_figures_follow_from_its_timings(tmp_path):
    """One fresh process of bench.firstcall (it asserts the pin hydrated), and the ratio of the
    first call's TTFT over the median of calls 2-10 per process, medians over processes."""
    from bench import firstcall
    from bench.timing import in_fresh_process

    model, home = firstcall._setup(tmp_path)
    res = in_fresh_process(firstcall.calls, model, home, 1)
    assert len(res["ttft_s"]) == firstcall.CALLS and all(t > 0 for t in res["ttft_s"])
    assert len(res["pin_ttft_s"]) == len(firstcall.PIN_ONLY_LETTERS)
    runs = [
        {"load_s": 0.05, "ttft_s": [0.03, *([0.01] * 9)], "pin_ttft_s": [0.015, 0.01, 0.02]},
        {"load_s": 0.07, "ttft_s": [0.01, 0.02, *([0.01] * 8)], "pin_ttft_s": [0.01] * 3},
        {"load_s": 0.06, "ttft_s": [0.02, *([0.01] * 9)], "pin_ttft_s": [0.02] * 3},
    ]
    out = firstcall.summarize({"warm": runs, "no warm": runs[:1]})
    assert out["warm"]["ratios"] == pytest.approx([3.0, 1.0, 2.0])
    assert out["warm"]["first_over_steady"] == pytest.approx(2.0)
    assert out["warm"]["load_s"] == pytest.approx(0.06)
    assert out["warm"]["pin_ratios"] == pytest.approx([2.0, 1.0, 1.0])
    assert out["warm"]["first_over_pin_steady"] == pytest.approx(1.0)
    assert out["warm"]["pin_steady_s"] == pytest.approx(0.015)
    (row,) = run.restart_targets({"firstcall": out})
    assert row["measured"] == 2.0 and row["ok"] is False
    out["warm"]["first_over_steady"] = 1.05
    assert run.restart_targets({"firstcall": out})[0]["ok"] is True


def test_restart_targets_take_each_sizes_own_threshold():
    """First hydrate: >= 1.0x up to 64 MB, >= 1.1x from 235 MB; long-lived from 16 MB only."""

    def cold(size, x):
        return {"shape": "kv28-f16", "size_mb": size, "kvstore_vs_load_prompt_cache": x,
                "cpu_ratio": 1.0, "pairwise": {"median": x, "min": x, "max": x}}  # fmt: skip

    rows = [cold(1, 1.02), cold(64, 0.99), cold(235, 1.05), cold(1024, 1.12)]
    verdicts = [t["ok"] for t in run.restart_targets({"coldstart": {"rows": rows}})]
    assert verdicts == [True, False, False, True]
    hyd = [
        {"regime": reg, "size_mb": size, "shape": "kv28-f16", "hydrate_vs_load_prompt_cache": x}
        for reg, size, x in [("reused", 4, 0.5), ("reused", 16, 1.2), ("fresh", 64, 0.5),
                             ("reused", 64, 0.9)]
    ]  # fmt: skip
    got = run.restart_targets({"hydrate": {"rows": hyd}})
    assert [(t["measured"], t["ok"]) for t in got] == [(1.2, True), (0.9, False)]


def test_startup_times_each_command_in_fresh_processes_round_robin():
    """bench.startup through the fresh-process harness: every command run `reps` times after the
    untimed round, each ratio the command's median over the baseline's."""
    import sys

    from bench import startup

    res = startup.measure(sys.executable, "kvstore", reps=2)
    for name in ("import lmdb, click", "kvstore ls (empty home)", "kvstore --help"):
        assert res[name]["n"] == 2 and res[name]["median"] > 0
    base = res["import lmdb, click"]["median"]
    assert res["ratios"]["kvstore --help"] == pytest.approx(res["kvstore --help"]["median"] / base)


def test_worker_names_a_bench_function_by_its_importable_module():
    from bench import firstcall
    from bench.timing import worker

    assert worker(firstcall.calls, "m", 1) == [
        "-m", "bench.timing", "bench.firstcall:calls", "m", "1"
    ]  # fmt: skip


def test_canary_tolerance_sits_between_rounding_and_a_real_change():
    """bench.canary_noise's rows: float rounding of a whole tiny llama within the tolerance, a
    RoPE base override beyond it (what the upgrade canary's tolerance is chosen by)."""
    from bench import canary_noise

    rows = run.own_targets("canary_noise", {"canary_noise": canary_noise.run()})
    assert len(rows) == 4 and all(r["ok"] is True for r in rows), rows


def test_reasons_and_fleet_trust_rows_follow_from_their_measures():
    from bench import fleet_trust, reasons

    attr = reasons.attribution(lambda ids: "text")
    assert set(attr) == {f"{w}: {q} ms" for w in ("diverged", "served") for q in ("median", "p99")}
    res = {"attribution_ms": attr, "explain_s": [0.9, 0.7, 0.8], "records": 10, "prompt_tokens": 2,
           "pins": 1, "learned": 1}  # fmt: skip
    rows = run.targets({"reasons": res})
    assert [r["measured"] for r in rows] == [
        round(attr["diverged: median ms"], 4), round(attr["served: median ms"], 4), 0.8
    ]  # fmt: skip
    (seal,) = fleet_trust.seal_costs((64,))
    assert 0 < seal["verify_s"] and 0 < seal["seal_s"] and seal["tokens"] == 64
    check = {"model": "m", "tokens": 148, "prefill_s": 0.01, "check_s": 0.005}
    start = {"pins": 8, "tokens": 100, "pending_s": 0.2, "passed_s": 0.02}
    rows = run.targets({"fleet_trust": {"seal": [seal], "check": [check], "start": start}})
    assert [r["measured"] for r in rows] == [round(seal["verify_keyed_s"], 4), 0.005, 0.2]
    assert all(r["ok"] is None for r in rows)  # context: no target is set for them


def test_each_first_hydrate_row_is_printed_beside_its_fresh_page_floor():
    """The guard (issue 33 item 5): the plain model's rows and the hybrid's, each over its floor."""
    rows = [
        {"shape": shape, "size_mb": 64, "kvstore_vs_load_prompt_cache": 1.0, "cpu_ratio": 1.0,
         "pairwise": {"median": 1.0, "min": 1.0, "max": 1.0},
         "stats": {"kvstore": {"median": 0.030}, "load_prompt_cache": {"median": 0.030},
                   "fresh pages": {"median": 0.020}}}
        for shape in ("kv28-f16", "qwen3.5-9b-hybrid")
    ]  # fmt: skip
    got = run.restart_targets({"coldstart": {"rows": rows}})
    floors = [t for t in got if "over its floor" in t["target"]]
    assert [t["measured"] for t in floors] == [1.5, 1.5] and all(t["ok"] is None for t in floors)
    assert "qwen3.5-9b-hybrid, 64 MB" in floors[1]["target"]
