"""bench.firstreq at its smallest: per model class (plain attention, the hybrid), one start of a
real daemon and `kvstore serve`, three rounds of the four pinned stages; its figures and
bench.run's rows are consistent (no timing thresholds)."""

import pytest

from bench import firstreq, run
from bench.stages import STAGES

pytestmark = pytest.mark.slow


def test_firstreq_reports_each_pinned_stage_against_its_target():
    res = firstreq.run(True, restarts=1, requests=3)
    assert list(res["models"]) == ["tiny llama", "tiny qwen3_5"]
    for r in (s for m in res["models"].values() for s in m["stages"].values()):
        assert r["first_ms"] > 0 and r["steady_ms"] > 0
        assert r["cached_first"] > 0  # the first request after the start is served its pin
        # the warm-up left nothing more cached than its pin (later turns may share a token or two
        # of their opening code with an earlier transcript)
        assert r["cached_first"] <= r["cached_steady"] < r["cached_first"] + 8
    rows = [t for t in run.targets({"firstreq": res}) if "first request" in t["target"]]
    assert len(rows) == 2 * len(STAGES) and all(isinstance(t["ok"], bool) for t in rows)
    assert sum("tiny qwen3_5" in t["target"] for t in rows) == len(STAGES)  # beside the plain rows
