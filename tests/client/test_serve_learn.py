"""Learned prefixes through real processes: a `kvstore daemon` and `kvstore serve` subprocesses.

Two requests share a system prompt; the daemon learns it and acknowledges its KV within seconds,
so a `kill -9` of the server loses nothing: after a restart, with no manifest, the first request
is served the shared prefix from the store. SIGTERM drains what is queued. A request diverging
inside the stored prefix is served up to the divergence and answers as a cold server does.
`/metrics` counts the tokens by source.
"""

from __future__ import annotations

import signal
import time

import pytest
from helpers import SYSTEM, Proc, Serve, serving, shared_tokens, wait_learned

pytestmark = pytest.mark.slow


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _answer(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


@pytest.fixture
def daemon(kv_home, tmp_path):
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False) as d:
        yield d


def _records_used_since(home, t: float, timeout: float = 15.0) -> bool:
    """Some learned record's last_used is at or after `t` (the daemon took a touch_blocks)."""
    from kvstore.learned.blockstore import BlockStore
    from kvstore.store.store import Store

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with Store(home, readonly=True) as store:
            if any(m.last_used >= t for m in BlockStore(store).records()):
                return True
        time.sleep(0.2)
    return False


def test_a_learned_prefix_survives_kill_9_and_serves_the_first_request(
    llama_path, kv_home, tmp_path, daemon
):
    log = tmp_path / "serve.log"
    shared = shared_tokens(llama_path, "My invoice was charged twice.", "Where is my parcel?")
    assert shared >= 200
    s = Serve(kv_home, llama_path, log)
    try:
        s.wait_ready()
        assert s.get("/metrics")[0] == 200
        s.chat("My invoice was charged twice.")
        s.chat("Where is my parcel?")
        wait_learned(daemon)  # acknowledged: the KV is in the store
        time.sleep(1.0)
    finally:
        s.stop(signal.SIGKILL)
    restarted = time.time()
    s = Serve(kv_home, llama_path, log)
    try:
        s.wait_ready()
        # the learned chain was read into memory before /health said 200: the first request is
        # served it without a read from the store on its path, and it still counts as `store`
        text = log.read_text()
        start = text.rindex("learned chain read into memory")
        first = s.chat("How do I reset my password?")
        assert _cached(first) >= 0.99 * shared, log.read_text()
        assert "from the store in" not in log.read_text()[start:], log.read_text()[start:]
        assert s.metric("store") >= 0.99 * shared
        # and the request that used it touched its records, as a restore on its path would
        assert _records_used_since(kv_home, restarted), log.read_text()
        before = s.metric("prefill")
        s.chat("Is the blue shirt in stock?")
        assert s.metric("prefill") > before  # the new user turn is prefilled
    finally:
        s.stop()


def test_sigterm_drains_and_a_diverging_request_answers_as_a_cold_server(
    llama_path, kv_home, tmp_path, daemon
):
    log = tmp_path / "serve.log"
    s = Serve(kv_home, llama_path, log)
    try:
        s.wait_ready()
        s.chat("My invoice was charged twice.")
        s.chat("Where is my parcel?")
    finally:
        assert s.stop(signal.SIGTERM) == 0, log.read_text()
    assert "learn queue drained" in log.read_text()
    wait_learned(daemon)
    # diverge inside the stored prefix: the second copy of the system prompt changes a word
    half = len(SYSTEM) // 2
    changed = SYSTEM[: half + 40] + SYSTEM[half + 40 :].replace("Billing", "Payments", 1)
    shared = shared_tokens(llama_path, "x", "y")
    s = Serve(kv_home, llama_path, log)
    try:
        s.wait_ready()
        warm = s.chat("My card was charged twice.", system=changed)
        divergence = shared_tokens(llama_path, "x", "My card was charged twice.", changed)
        assert 0 < divergence < shared
        assert _cached(warm) == divergence, log.read_text()  # served up to it, not a token less
    finally:
        s.stop()
    cold = Serve(tmp_path / "cold-home", llama_path, tmp_path / "cold.log", "--no-learn")
    try:
        cold.wait_ready()
        ref = cold.chat("My card was charged twice.", system=changed)
        assert _cached(ref) == 0
    finally:
        cold.stop()
    assert _answer(warm) == _answer(ref)
    assert warm["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]


def test_health_waits_for_the_warm_up_and_no_learn_reports_nothing(
    llama_path, kv_home, tmp_path, daemon
):
    log = tmp_path / "serve.log"
    s = Serve(kv_home, llama_path, log, "--no-learn")
    try:
        s.wait_ready()
        assert "warm-up request through the server" in log.read_text()
        assert "kvstore: ready" in log.read_text()
        s.chat("My invoice was charged twice.")
        s.chat("Where is my parcel?")
        assert s.metric("prefill") > 0
        time.sleep(1.0)
    finally:
        s.stop()
    learned = daemon.request("stats").get("learned") or {}
    assert not learned.get("records") and not learned.get("snapshots")


def test_a_hybrid_model_learns_a_snapshot_at_the_shared_boundary(
    hybrid_path, kv_home, tmp_path, daemon
):
    """qwen3_5 (state layers): the daemon asks for a snapshot at the shared boundary; the next
    request crossing it splits its prefill there and sends it; a restarted server is served it."""
    log = tmp_path / "serve.log"
    shared = shared_tokens(hybrid_path, "My invoice was charged twice.", "Where is my parcel?")
    s = Serve(kv_home, hybrid_path, log)
    try:
        s.wait_ready()
        s.chat("My invoice was charged twice.")
        s.chat("Where is my parcel?")
        time.sleep(1.0)  # the daemon's reply to that report names the boundary
        s.chat("How do I reset my password?")  # crosses the boundary: split and sent
        learned = wait_learned(daemon)
        assert learned.get("snapshots"), learned
    finally:
        assert s.stop() == 0, log.read_text()
    s = Serve(kv_home, hybrid_path, log)
    try:
        s.wait_ready()
        first = s.chat("Is the blue shirt in stock?")
        assert _cached(first) >= 0.99 * shared, log.read_text()
    finally:
        s.stop()


def test_serve_says_once_that_a_corrupt_learned_record_ends_its_chain(
    llama_path, kv_home, tmp_path, daemon
):
    """Every learned record's bytes flipped behind the daemon's back: a restarted server serves
    none of them, prefills and says so once per record; `verify` names them and `verify --repair`
    drops them through the daemon, so they leave the learned budget's count."""
    from helpers import cli

    from kvstore.learned.blockstore import BlockStore
    from kvstore.store.store import Store

    log = tmp_path / "serve.log"
    s = Serve(kv_home, llama_path, log)
    try:
        s.wait_ready()
        s.chat("My invoice was charged twice.")
        s.chat("Where is my parcel?")
        wait_learned(daemon)
    finally:
        assert s.stop() == 0, log.read_text()
    with Store(kv_home) as store:  # another process writing: LMDB's own lock orders it
        blocks = BlockStore(store)
        keys = [m.key for m in blocks.records()]
        for k in keys:
            raw = bytearray(store._read(lambda t, k=k: bytes(t.get(k, db=blocks._db(b"bblob")))))
            raw[len(raw) // 2] ^= 0x01
            store._write(lambda t, k=k, v=bytes(raw): t.put(k, v, db=blocks._db(b"bblob")))
    assert keys
    log = tmp_path / "serve2.log"
    s = Serve(kv_home, llama_path, log)
    try:
        s.wait_ready()
        assert _cached(s.chat("How do I reset my password?")) == 0, log.read_text()
        s.chat("Is the blue shirt in stock?")
    finally:
        assert s.stop() == 0, log.read_text()
    said = [ln for ln in log.read_text().splitlines() if "is corrupt" in ln]
    assert len(said) == 1 and any(k.hex() in said[0] for k in keys), log.read_text()
    result = cli("verify", "--home", kv_home)
    assert result.exit_code == 1
    assert all(f"bad learned record {k.hex()}" in result.output for k in keys), result.output
    result = cli("verify", "--repair", "--home", kv_home)
    assert f"{len(keys)} learned records of {len(keys)} failed (deleted)" in result.output
    learned = daemon.request("stats")["learned"]
    assert learned["records"] == 0 and learned["bytes"] == 0, learned
