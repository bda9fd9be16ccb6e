"""Read-through on a request's miss (issue 32): a prefix box A learned and uploaded is served on
box B from the fleet, verified and checked against B's model, stored through B's daemon; and
every fault (a MAC that fails, a quarantined uploader, a truncated or vanished object, a bucket
that hangs or dies mid-chain, no fleet key) is one log line and a prefill, nothing stored."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time

import pytest
from fleet_boxes import FLEET_KEY, box, chat, keyed, queue_counts, remote_of, store_chain
from helpers import Proc, assert_same_kv, mlx_lm_prefill, serving, wait_for
from mlx_lm import load

from kvstore import metrics
from kvstore.client.learn import Learner
from kvstore.client.persistent import PinnedPromptCache
from kvstore.fleet.learned import push_records
from kvstore.learned.blockstore import BlockStore
from kvstore.learned.coldtier import LearnTarget
from kvstore.store.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("environments_closed")]

FP = bytes(range(16))
KEY = "tiny"


def sample(name: str, labels: dict | None = None) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture(scope="module")
def tiny(llama_path):
    model, _ = load(str(llama_path))
    return model, llama_path


def uploaded(home, s3, tiny, tokens: list[int], kv_of: list[int] | None = None) -> None:
    """Box `home` learned `tokens` (records [0,256), [256,512), [512, len)) and pushed them
    (`kv_of`: the KV of other tokens, filed as theirs: a faulty box)."""
    model, path = tiny
    store_chain(box(home, s3), mlx_lm_prefill(model, kv_of or tokens), tokens, FP, path)
    keyed(home)
    with Store(home) as store:
        counts = push_records(remote_of(home), store, say=print)
    assert counts["uploaded"] == 3


def cache_on(home, tiny) -> tuple[PinnedPromptCache, Learner]:
    model, path = tiny
    lru = PinnedPromptCache(max_size=4)
    learner = Learner(home)
    learner.add_target(KEY, LearnTarget(fingerprint=FP, model=str(path), model_obj=model,
                                        extra={}))  # fmt: skip
    lru.learner = learner
    return lru, learner


def test_a_miss_is_read_through_from_the_fleet(s3, tiny, tmp_path, caplog):
    tokens = chat(600)
    uploaded(tmp_path / "a", s3, tiny, tokens)
    b = keyed(box(tmp_path / "b", s3))
    request = tokens + chat(30, seed=9)
    before = sample("kvstore_prompt_tokens_total", {"source": "fleet"})
    trips = sample("kvstore_fleet_round_trips_total")
    lru, learner = cache_on(b, tiny)
    try:
        with caplog.at_level(logging.INFO, logger="kvstore.client"):
            cache, rest = lru.fetch_nearest_cache(KEY, request)
        assert rest == request[512:]  # two whole blocks from the fleet; the rest prefills
        assert_same_kv(cache, mlx_lm_prefill(tiny[0], tokens[:512]))
        assert sample("kvstore_prompt_tokens_total", {"source": "fleet"}) - before == 512
        # one HEAD (the longest first) and two GETs
        assert sample("kvstore_fleet_round_trips_total") - trips == 3
        assert "512 tokens of a request fetched from the fleet" in caplog.text
        # no ledger here: the check's own prefill is this box's measured rate from now on
        assert learner.fleet.prefill_rate(str(tiny[1])) > 0
        # in memory now: the next request of that prefix asks nothing
        cache, rest = lru.fetch_nearest_cache(KEY, request)
        assert rest == request[-1:] or len(rest) < len(request) - 511
        assert sample("kvstore_fleet_round_trips_total") - trips == 3
    finally:
        learner.close(timeout=5.0)
    with Store(b) as store:  # no daemon here: the client never writes the store itself
        assert BlockStore(store).stored_end(FP, tokens) == 0
    visible(b, request, lru)


def visible(b, request: list[int], lru) -> None:
    """The fleet's tokens in the call's line, the ledger, `kvstore explain` and `remote status`
    (the call's record reads them from its fetch's record in the store tier, taken once)."""
    from dataclasses import asdict

    from helpers import cli

    from kvstore.client.callstats import StatsRecorder
    from kvstore.explain import explain, render
    from kvstore.home.ledger import Ledger, validate

    rec = StatsRecorder("tiny", send=False, verbose=False)
    call = rec.record(label="chat", prompt_tokens=len(request), cached_tokens=512, prefill_s=0.1,
                      decode_s=0.1, prompt=request,
                      fleet_tokens=lru.fetch_record(request).fleet)  # fmt: skip
    assert call.fleet_tokens == 512 and "512 from cache (512 from the fleet)" in call.line()
    again = rec.record(label="chat", prompt_tokens=len(request), cached_tokens=512,
                       prefill_s=0.1, decode_s=0.1, prompt=request,
                       fleet_tokens=lru.fetch_record(request).fleet)  # fmt: skip
    assert again.fleet_tokens == 0  # the next call of that prompt: memory's
    row = asdict(call)
    row["reasons"] = list(row["reasons"])
    Ledger(b).append(validate([row]))
    assert "512 from the fleet" in render(explain(b))
    status = cli("remote", "status", "--home", b, code=0).output
    assert "read-through   512 tokens fetched" in status, status
    assert sample("kvstore_fleet_fetch_bytes_total") > 0


def test_read_through_stores_through_the_daemon(s3, tiny, tmp_path):
    tokens = chat(600, seed=5)
    uploaded(tmp_path / "a", s3, tiny, tokens)
    b = keyed(box(tmp_path / "b", s3))
    request = tokens + chat(30, seed=9)
    with serving(Proc(b, log=tmp_path / "b.log"), warm=False):
        lru, learner = cache_on(b, tiny)
        try:
            _, rest = lru.fetch_nearest_cache(KEY, request)
            assert rest == request[512:]
            assert learner.drain(20.0)[1] == 0
        finally:
            learner.close(timeout=5.0)
        with Store(b, readonly=True) as store:
            blocks = BlockStore(store)
            wait_for(lambda: blocks.stored_end(FP, tokens) == 512, timeout=10)
            chain = blocks.lookup(FP, tokens)
            assert {m.extra.origin for m in chain[:2]} == {"remote"}
    # the bucket holds them: not queued for upload, nor swept in at the next start
    with serving(Proc(b, log=tmp_path / "b2.log"), warm=False):
        pass
    counts = queue_counts(b)
    assert counts["records_queued"] == counts["records_uploaded"] == 0, counts


def two_requests(b, tiny, request: list[int]) -> tuple[list[list[int]], Learner]:
    """Two requests of the same prompt on box `b` (the first's KV is not kept: each misses)."""
    rests = []
    lru, learner = cache_on(b, tiny)
    try:
        for _ in range(2):
            lru = PinnedPromptCache(max_size=4)
            lru.learner = learner
            rests.append(lru.fetch_nearest_cache(KEY, request)[1])
        learner.drain(5.0)
    finally:
        learner.close(timeout=5.0)
    return rests, learner


def object_names(s3) -> list[str]:
    listed = s3.client().list_objects_v2(Bucket="kvstore").get("Contents", [])
    return sorted(o["Key"] for o in listed)


FAULTS = ["mac", "quarantined", "truncated", "vanished", "no_key", "mismatch"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_is_one_line_and_a_prefill(s3, tiny, tmp_path, caplog, monkeypatch, fault):
    tokens = chat(600, seed=11)
    a = tmp_path / "a"
    uploaded(a, s3, tiny, tokens, kv_of=chat(600, seed=12) if fault == "mismatch" else None)
    b = box(tmp_path / "b", s3)
    if fault != "no_key":
        keyed(b, secrets.token_hex(32) if fault == "mac" else FLEET_KEY)
    if fault == "quarantined":
        from kvstore.fleet.queue import UploadQueue
        from kvstore.fleet.remote_settings import box_id

        q = UploadQueue(b)
        q.quarantine(box_id(a), "test: its KV was not this model's")
        q.close()
    if fault == "truncated":
        # every object cut in half: the chain's first one is refused whatever the order
        client = s3.client()
        for name in object_names(s3):
            data = client.get_object(Bucket="kvstore", Key=name)["Body"].read()
            client.put_object(Bucket="kvstore", Key=name, Body=data[: len(data) // 2])
    if fault == "vanished":  # the lookup finds the chain's end; then its objects are deleted
        from kvstore.fleet.objects import Remote

        head = Remote.head

        def head_then_delete(self, key, *, name=None):
            size = head(self, key, name=name)
            s3.clear()
            return size

        monkeypatch.setattr(Remote, "head", head_then_delete)
    request = tokens + chat(30, seed=9)
    fleet = sample("kvstore_prompt_tokens_total", {"source": "fleet"})
    with caplog.at_level(logging.INFO):
        rests, learner = two_requests(b, tiny, request)
    assert rests == [request, request]  # served by prefill, as without the fleet
    assert sample("kvstore_prompt_tokens_total", {"source": "fleet"}) == fleet
    # nothing sent to be stored (a mismatch sends its verdict: the uploader's quarantine)
    assert learner.writer.sent + learner.writer.dropped == (fault == "mismatch")
    lines = [r.getMessage() for r in caplog.records if "fleet" in r.getMessage()]
    assert len(lines) == 1, lines  # one line, not one per request
    word = {"mac": "MAC", "quarantined": "quarantined", "truncated": "bytes",
            "vanished": "NoSuchKey", "no_key": "no fleet_key",
            "mismatch": "not what this box's model computes"}[fault]  # fmt: skip
    assert word in lines[0]


def asked(b, tokens: list[int], tps: float | None):
    from kvstore.fleet.readthrough import Ask

    return Ask(FP, tokens, 256, frozenset({0}), 0, tps)


def test_only_when_fetching_beats_prefilling(s3, tiny, tmp_path):
    from kvstore.fleet.readthrough import ReadThrough

    tokens = chat(600, seed=21)
    uploaded(tmp_path / "a", s3, tiny, tokens)
    b = keyed(box(tmp_path / "b", s3))
    reader = ReadThrough(remote_of(b))
    request = tokens + [1]
    got = reader.read(asked(b, request, None))  # nothing measured: fetch, and measure
    assert got is not None and got[1] == 512 and reader.estimate.rtt is not None
    trips, slower = sample("kvstore_fleet_round_trips_total"), "kvstore_fleet_reads_total"
    n = sample(slower, {"outcome": "slower"})
    # a box that prefills far faster than one round trip: the bucket is not even asked
    assert reader.read(asked(b, request, 1e12)) is None
    assert sample("kvstore_fleet_round_trips_total") == trips
    assert sample(slower, {"outcome": "slower"}) == n + 1
    # a slow link (1 KiB/s): the lookup answers, the records are not fetched
    reader.estimate.bps = 1024.0
    assert reader.read(asked(b, request, 2000.0)) is None
    assert sample("kvstore_fleet_round_trips_total") == trips + 1  # the HEAD only
    assert sample(slower, {"outcome": "slower"}) == n + 2
    # a prefix the fleet lacks is asked once, then remembered for MISS_S
    other = chat(600, seed=22)
    assert reader.read(asked(b, other, None)) is None
    after = sample("kvstore_fleet_round_trips_total")
    assert after > trips + 1
    assert reader.read(asked(b, other, None)) is None
    assert sample("kvstore_fleet_round_trips_total") == after


@pytest.fixture
def own_weed(tmp_path):
    """A SeaweedFS server of this test's own: it is stopped and killed."""
    from bench.weed import Weed

    server = Weed(tmp_path / "weed").start()
    try:
        yield server
    finally:
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


def test_a_bucket_that_hangs_or_dies_mid_chain(own_weed, tiny, tmp_path, caplog, monkeypatch):
    from kvstore.fleet.objects import Remote

    tokens = chat(600, seed=31)
    uploaded(tmp_path / "a", own_weed, tiny, tokens)
    b = keyed(box(tmp_path / "b", own_weed, read_timeout=1.0, fetch_deadline=1.5))
    request = tokens + chat(30, seed=9)
    fetch, calls = Remote.fetch, []

    def fault_then_fetch(self, key, **kw):
        calls.append(key)
        if len(calls) == 1:
            os.kill(own_weed.proc.pid, signal.SIGSTOP)  # the bucket hangs mid-chain
        return fetch(self, key, **kw)

    monkeypatch.setattr(Remote, "fetch", fault_then_fetch)
    abandoned = sample("kvstore_fleet_abandoned_fetches_total")
    with caplog.at_level(logging.INFO):
        t = time.monotonic()
        rests, _ = two_requests(b, tiny, request)
        took = time.monotonic() - t
    assert rests == [request, request]  # prefilled, as without the fleet
    assert took < 6.0  # the first waited for its deadline at most, the second not at all
    assert sample("kvstore_fleet_abandoned_fetches_total") == abandoned + 1
    assert sample("kvstore_fleet_breaker_open") == 1
    assert len(calls) == 1  # the open breaker: the second request did not ask
    lines = [r.getMessage() for r in caplog.records if "fleet" in r.getMessage()]
    assert len(lines) == 1 and "deadline" in lines[0], lines
    os.kill(own_weed.proc.pid, signal.SIGCONT)

    # killed mid-fetch: unreachable, one line, prefilled (a new process: its breaker closed)
    calls.clear()

    def kill_then_fetch(self, key, **kw):
        calls.append(key)
        if len(calls) == 1:
            own_weed.kill()
        return fetch(self, key, **kw)

    monkeypatch.setattr(Remote, "fetch", kill_then_fetch)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rests, learner = two_requests(b, tiny, request)
    assert rests == [request, request]
    assert len(calls) == 1
    lines = [r.getMessage() for r in caplog.records if "fleet" in r.getMessage()]
    assert len(lines) == 1 and "unreachable" in lines[0], lines
    assert learner.writer.sent + learner.writer.dropped == 0


def test_kvstore_serve_reads_through_what_another_box_learned(s3, llama_path, tmp_path):
    from helpers import Serve, cached_tokens, shared_tokens, wait_learned

    a, b = keyed(box(tmp_path / "a", s3)), keyed(box(tmp_path / "b", s3))
    for home in (a, b):  # blocks of 64: the tiny chat template's shared prefix holds several
        path = home / "settings.toml"
        path.write_text("block_tokens = 64\n" + path.read_text())
    shared = shared_tokens(llama_path, "My invoice was charged twice.", "Where is my parcel?")
    with serving(Proc(a, log=tmp_path / "a.log"), warm=False) as d:
        s = Serve(a, llama_path, tmp_path / "serve-a.log")
        try:
            s.wait_ready()
            s.chat("My invoice was charged twice.")
            s.chat("Where is my parcel?")
            wait_learned(d)
        finally:
            s.stop()
        remote = remote_of(a)
        wait_for(lambda: len(list(remote.records())) >= shared // 64, timeout=30)
    with serving(Proc(b, log=tmp_path / "b.log"), warm=False):
        s = Serve(b, llama_path, tmp_path / "serve-b.log")
        try:
            s.wait_ready()
            reply = s.chat("How do I reset my password?")  # box B's first request
            fetched = shared // 64 * 64
            assert cached_tokens(reply) >= fetched, (tmp_path / "serve-b.log").read_text()
            assert s.metric("fleet") == fetched
            text = (tmp_path / "serve-b.log").read_text()
            assert f"from cache ({fetched} from the fleet)" in text  # the request's line
        finally:
            s.stop()
