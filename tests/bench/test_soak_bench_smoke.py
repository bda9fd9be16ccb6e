"""bench.soak at its smallest: a real daemon and `kvstore serve` with learning on, a few dozen
requests from two clients; it runs and reports serve's anonymous memory (no thresholds: the
figure means something only over thousands of requests)."""

import sys

import pytest

from bench import run, soak

pytestmark = pytest.mark.slow


def test_soak_runs_and_reports_serves_anonymous_memory():
    res = soak.run(True, requests_=24, warmup=8, clients=2, control=True)
    assert res["errors"] == 0 and res["requests"] == 24
    assert 0 < res["cached_share"] <= 1
    if sys.platform == "linux":
        assert len(res["serve_rss_anon"]) == 7 and all(v > 0 for v in res["serve_rss_anon"])
        assert isinstance(res["bytes_per_request"], float)
    row, control = run.own_targets("soak", {"soak": res})
    assert row["unit"] == "B/request" and "anonymous memory" in row["target"]
    assert "plain mlx_lm.server" in control["target"] and control["ok"] is None
    assert res["control"]["errors"] == 0 and res["control"]["requests"] == 24
