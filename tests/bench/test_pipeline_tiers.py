"""bench.pipeline calibrates each tier to the cold prefill share the seed measured for it (not one
45% for all), and its table sets end-to-end model time beside the seed's change."""

import pytest

# bench/ is not an installed package: pytest's `pythonpath = ["."]` (pyproject) finds it
from bench import pipeline


@pytest.mark.parametrize("name", ["standard", "agentic", "research"])
def test_each_tier_is_calibrated_to_its_own_seed_share(name):
    rates = {"prefill_tps": 3000.0, "decode_tps": 1000.0}  # agentic: its tool calls fit
    tier = pipeline.tiers(1.0)[name]
    plan = pipeline._decode_plan(tier, rates)
    static_s = pipeline.static_tokens(tier) / rates["prefill_tps"]
    dynamic_s = sum(c["suffix"] for c in tier["calls"]) / rates["prefill_tps"]
    decode_s = sum(plan) / rates["decode_tps"]
    share = static_s / (static_s + dynamic_s + decode_s)
    assert share == pytest.approx(pipeline.SEED_SHARES[name], abs=0.01)
    assert pipeline.SEED_SHARES == {"standard": 0.44, "agentic": 0.47, "research": 0.17}


def test_rows_and_table_set_model_time_beside_the_seeds_change():
    def result(prefill, decode):
        return {"tiers": {"research": {"calls": 12, "prompt_tokens": 100, "prefilled": 100,
                                       "pinned_prefilled": 0, "prefill_s": prefill,
                                       "decode_s": decode, "decode_tokens": 5}}}  # fmt: skip

    runs = {"cold": [result(2.0, 8.0), result(4.0, 8.0)], "kvstore": [result(0.2, 7.8)] * 2}
    row = pipeline._median_rows(runs, "research")
    assert row["cold"]["model_s"] == 11.0 and row["kvstore"]["model_s"] == 8.0
    assert row["model_time_change"] == pytest.approx(8.0 / 11.0 - 1)
    assert row["seed_change"] == -0.24 and row["seed_share"] == 0.17
    res = {"models": {"hybrid": {"arch": "qwen3_5", "tiers": {"research": row}}}}
    # at equal decode only the prefill saved counts: (3.0 - 0.2) / 11
    assert row["model_time_change_equal_decode"] == pytest.approx(-2.8 / 11)
    assert (
        "| hybrid (qwen3_5) | research | 27% (17%) | 11.00 | 8.00 | -27% | **-25%** | -24% |"
        in (pipeline.table(res))
    )
