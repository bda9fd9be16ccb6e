"""The read-through's prefill rate (its cost rule and deadline: kvstore.fleet.reads): a fresh
home's ledger has none at a long-running server's first ask, and the server must learn it from
the ledger once its own prefills are there (bench.fleet_readthrough found it never did: on a slow
link every fetch went ahead and waited for fetch_deadline, not the expected prefill)."""

from __future__ import annotations

from kvstore.fleet import reads as fleetread
from kvstore.home.ledger import Ledger

MODEL = "/models/tiny"


def prefilled(tokens: int, seconds: float) -> dict:
    return {"model": MODEL, "label": "serve", "prompt_tokens": tokens, "cached_tokens": 0,
            "prefilled_tokens": tokens, "generated_tokens": 1, "prefill_s": seconds}  # fmt: skip


def test_a_fresh_homes_prefill_rate_is_read_again_once_the_ledger_has_one(tmp_path, monkeypatch):
    reads = fleetread.FleetReads(tmp_path, writer=None)  # type: ignore[arg-type]
    assert reads.prefill_rate(MODEL) is None  # nothing prefilled on this box yet
    Ledger(tmp_path).append([prefilled(1000, 2.0)])  # the daemon records the server's prefills
    assert reads.prefill_rate(MODEL) is None  # within RATE_S of the last read: not read again
    monkeypatch.setattr(fleetread, "RATE_S", 0.0)
    assert reads.prefill_rate(MODEL) == 500.0
    Ledger(tmp_path).append([prefilled(1000, 0.5)])
    assert reads.prefill_rate(MODEL) == 500.0  # once known, kept: no ledger read per request
