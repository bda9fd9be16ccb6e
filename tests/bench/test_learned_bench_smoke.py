"""Keep bench/learned.py from rotting: the whole module at its smallest size (a real daemon and
`kvstore serve`, a 3-turn chat, a 300-token restored prefix), figures sane, targets computed."""

import math

import pytest

# bench/ is not an installed package: pytest's `pythonpath = ["."]` (pyproject) finds it
from bench import learned, run

pytestmark = pytest.mark.slow


def test_learned_bench_at_its_smallest_size():
    res = learned.run(True, turns=3, prefix=300)

    r = res["restart"]["llama"]
    assert r["stages_min_served_fraction"] > 0.9
    assert all(s["shared_tokens"] > 500 for s in r["stages"].values())
    chat = r["chat_next_turn"]
    assert chat["cached_tokens"] >= 0.9 * chat["prev_prompt_tokens"] > 0
    b = r["bytes"]
    assert b["kind"] == "block records" and b["kv_bytes_per_token"] == 1024
    assert 0.9 < b["stored_over_final_kv"] < 2
    assert 0.9 < b["written_per_learned_token_over_kv"] < 2
    assert r["spawn_to_first_answer_s"] > r["spawn_to_ready_s"] > 0

    h = res["restart"]["qwen3_5"]
    assert h["chat_next_turn"]["served_over_prev_prompt"] == 1
    hb = h["bytes"]
    assert hb["kind"].startswith("KV records + state-only snapshots")
    assert hb["stored_over_final_kv"] <= 1.1 and hb["written_over_added"] <= 1.15
    (row,) = res["hybrid_shapes"]["rows"]
    assert row["after_over_added"] <= 1.15 and row["after_bytes"] < row["before_bytes"]

    s = res["restore"]
    assert s["restored_exact"]
    for k in ("restore_over_memory_copy", "ttft_store_over_memory", "prefill_over_restore"):
        assert s[k] > 0 and math.isfinite(s[k]), k
    assert s["prefill_over_restore"] > 1  # reading 300 tokens beats computing them
    assert res["report"]["request_path_ms"] > 0

    assert "peer" not in res  # vllm-mlx side by side: bench/peer.py (tests/bench/test_peer_bench)

    targets = run.learned_targets(res)
    assert len(targets) >= 9
    assert all(t["ok"] in (True, False, None) for t in targets)
    served = next(t for t in targets if "3 stages" in t["target"])
    assert served["ok"] is True
