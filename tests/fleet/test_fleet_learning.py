"""Fleet-wide learning (issue 32, item 4): a prefix counts as recurring when it recurs across the
fleet, not only on one box. Box A sees a prefix once, box B once: B learns it and uploads it, and
A's next request of it is read through from the fleet; the bucket's seen-markers are signed,
bounded and never block learning when the bucket fails; no box uploads a record the bucket
already holds."""

from __future__ import annotations

import logging
import re
import time

import pytest
from fleet_boxes import box, chat, keyed, queue_counts, remote_of, store_chain
from helpers import Proc, mlx_lm_prefill, serving, wait_for
from mlx_lm import load

from kvstore.fleet import sightings as seen_mod
from kvstore.fleet.remote_settings import box_id
from kvstore.fleet.sightings import MAX_LOOKUPS, Sightings, marker_name
from kvstore.learned.blockstore import BlockStore
from kvstore.learned.chain import chain_hashes
from kvstore.learned.records import slice_record
from kvstore.store.entry import pack_tokens
from kvstore.store.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("environments_closed")]

FP = bytes(range(16))


def listed(s3, part: str) -> list[dict]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket="kvstore")
    return [o for page in pages for o in page.get("Contents", []) if f"/{part}/" in o["Key"]]


@pytest.fixture(scope="module")
def tiny(llama_path):
    model, _ = load(str(llama_path))
    return model, llama_path


# -- the markers ---------------------------------------------------------------------------------


def test_a_marker_from_another_box_is_found_in_few_heads(s3, tmp_path):
    a, b = keyed(box(tmp_path / "a", s3)), keyed(box(tmp_path / "b", s3))
    tokens = chat(256 * 40)
    hashes = chain_hashes(FP, pack_tokens(tokens))
    mine, theirs = Sightings(remote_of(a)), Sightings(remote_of(b))
    try:
        assert theirs.deepest(FP, hashes, 1, 40) == 0  # nobody passed node 1: one HEAD
        assert theirs.counts["heads"] == 1
        assert mine.mark(FP, hashes, range(1, 30)) == seen_mod.MAX_MARKS  # the shallowest 16
        wait_for(lambda: mine.counts["marked"] == seen_mod.MAX_MARKS, 10)
        assert len(listed(s3, "seen")) == seen_mod.MAX_MARKS
        theirs.counts["heads"] = 0
        assert theirs.deepest(FP, hashes, 1, 40) == 16  # bisection, bounded
        assert theirs.counts["heads"] <= MAX_LOOKUPS
        assert theirs.deepest(FP, hashes, 3, 16) == 16  # shallowest, then deepest: 2 HEADs
        # markers are neither entries nor records: no listing of the tier sees them
        remote = remote_of(b)
        assert list(remote.objects()) == [] and list(remote.records()) == []
        # one a day ago no longer counts (a lifecycle rule may expire them)
        old = Sightings(remote_of(b), clock=lambda: time.time() + seen_mod.SEEN_TTL_S + 60)
        assert old.deepest(FP, hashes, 1, 40) == 0
    finally:
        mine.stop(), theirs.stop()


def test_a_marker_without_this_fleets_mac_does_not_count(s3, tmp_path, caplog):
    b = keyed(box(tmp_path / "b", s3))
    hashes = chain_hashes(FP, pack_tokens(chat(600)))
    remote = remote_of(b)
    client = s3.client()
    forged = {1: {}, 2: {"mac": "00" * 32}}  # unsigned, and signed under another key
    for k, meta in forged.items():
        client.put_object(Bucket="kvstore", Key=marker_name(remote, FP, hashes[k]), Body=b"",
                          Metadata=meta)  # fmt: skip
    sightings = Sightings(remote)
    try:
        with caplog.at_level(logging.WARNING):
            assert sightings.deepest(FP, hashes, 1, 2) == 0
            assert sightings.deepest(FP, hashes, 2, 2) == 0
        lines = [r.getMessage() for r in caplog.records if "seen-marker" in r.getMessage()]
        assert len(lines) == 1 and "not signed by this fleet's key" in lines[0], lines
    finally:
        sightings.stop()


def test_a_dead_bucket_costs_one_lookup_then_learning_is_local(tmp_path, caplog, monkeypatch):
    from bench.weed import Weed, free_port_pairs

    monkeypatch.setattr(seen_mod, "LOOKUP_S", 1.0)
    dead = Weed.__new__(Weed)
    dead.endpoint = f"http://127.0.0.1:{free_port_pairs(1)[0]}"  # nothing listens there
    home = keyed(box(tmp_path / "b", dead, connect_timeout=0.5, read_timeout=0.5))
    hashes = chain_hashes(FP, pack_tokens(chat(600)))
    sightings = Sightings(remote_of(home))
    try:
        with caplog.at_level(logging.DEBUG, logger="kvstore"):
            t = time.monotonic()
            assert sightings.deepest(FP, hashes, 1, 2) == 0
            assert time.monotonic() - t < 1.5
            heads = sightings.counts["heads"]
            assert sightings.deepest(FP, hashes, 1, 2) == 0  # the breaker: not asked
            assert sightings.mark(FP, hashes, range(1, 3)) == 0
            assert sightings.counts["heads"] == heads
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(lines) == 1 and "fleet-wide learning off" in lines[0], lines
    finally:
        sightings.stop()


# -- two daemons sharing a bucket --------------------------------------------------------------


def cache_on(home, tiny):
    """A library cache on box `home` whose misses read through from the fleet."""
    from kvstore.client.learn import Learner
    from kvstore.client.persistent import PinnedPromptCache
    from kvstore.learned.coldtier import LearnTarget

    model, path = tiny
    lru = PinnedPromptCache(max_size=4)
    learner = Learner(home)
    learner.add_target("tiny", LearnTarget(fingerprint=FP, model=str(path), model_obj=model,
                                           extra={}))  # fmt: skip
    lru.learner = learner
    return lru, learner


def learn(d: Proc, tokens: list[int], model: str) -> dict:
    return d.request("learn", fingerprint=FP, tokens=pack_tokens(tokens), sliceable=True,
                     model=model, label="chat", extra={})  # fmt: skip


def put_blocks(d: Proc, tokens: list[int], want: list, kv: list, model: str) -> dict:
    recs = [{"start": s, "end": e, "blob": slice_record(kv, s, e)} for s, e in want]
    return d.request("put_blocks", fingerprint=FP, tokens=pack_tokens(tokens), records=recs,
                     label="chat", model=model, extra={"model": model})  # fmt: skip


def uploaded_lines(d: Proc) -> list[str]:
    return re.findall(r"learned record ([0-9a-f]+) uploaded", d.text())


def test_a_prefix_seen_once_on_each_of_two_boxes_is_learned_and_served_fleet_wide(
    s3, tiny, tmp_path
):
    model, path = tiny
    a, b = keyed(box(tmp_path / "a", s3)), keyed(box(tmp_path / "b", s3))
    shared = chat(600)  # a system prompt: two whole blocks and some
    da, db = Proc(a, log=tmp_path / "a.log"), Proc(b, log=tmp_path / "b.log")
    with serving(da, warm=False), serving(db, warm=False):
        for d in (da, db):
            d.wait_log("(upload True")  # the fleet tier is up (after the socket)
        assert learn(da, shared + chat(40, seed=1), str(path))["want"] == []  # A: seen once
        wait_for(lambda: len(listed(s3, "seen")) == 2, 10, da.text)  # nodes 1 and 2, marked
        request_b = shared + chat(40, seed=2)
        reply = learn(db, request_b, str(path))  # B: seen once here, once on A
        assert reply["want"] == [[0, 256], [256, 512]], db.text()
        assert "512 tokens recur across the fleet" in db.text()
        put_blocks(db, request_b, reply["want"], mlx_lm_prefill(model, request_b), str(path))
        wait_for(lambda: len(listed(s3, "blocks")) == 2, 20, db.text)
        remote = remote_of(b)
        assert {remote.uploader(o["Key"]) for o in listed(s3, "blocks")} == {box_id(b)}
        # A's later request of the prefix: read through from the fleet, stored through A's daemon
        request_a = shared + chat(40, seed=3)
        lru, learner = cache_on(a, tiny)
        try:
            _, rest = lru.fetch_nearest_cache("tiny", request_a)
            assert rest == request_a[512:]  # the two blocks B learned, from the fleet
            assert learner.drain(20.0)[1] == 0
        finally:
            learner.close(timeout=5.0)
        with Store(a, readonly=True) as store:
            blocks = BlockStore(store)
            wait_for(lambda: blocks.stored_end(FP, request_a) == 512, 10, da.text)
        # A learns the rest of its exact prefix ([512, 600)) and uploads only that
        reply = learn(da, request_a, str(path))
        assert reply["want"] == [[512, 600]], da.text()
        put_blocks(da, request_a, reply["want"], mlx_lm_prefill(model, request_a), str(path))
        wait_for(lambda: len(listed(s3, "blocks")) == 3, 20, da.text)
        time.sleep(1.0)  # the upload worker's sweep and queue have run
    # each record went up once: B's two, A's one; A never uploaded one the bucket held
    assert len(uploaded_lines(db)) == 2 and len(uploaded_lines(da)) == 1, (da.text(), db.text())
    assert queue_counts(a)["records_uploaded"] == 1


def test_a_record_the_bucket_holds_is_not_uploaded_again(s3, tiny, tmp_path):
    model, path = tiny
    tokens = chat(600, seed=7)
    kv = mlx_lm_prefill(model, tokens)
    a, b = keyed(box(tmp_path / "a", s3)), keyed(box(tmp_path / "b", s3))
    for home in (a, b):  # both boxes learned the same chain on their own
        store_chain(home, kv, tokens, FP, path)
    da = Proc(a, log=tmp_path / "a.log")
    with serving(da, warm=False):
        wait_for(lambda: len(uploaded_lines(da)) == 3, 20, da.text)
    db = Proc(b, log=tmp_path / "b.log")
    exists = lambda: re.findall(r"learned record [0-9a-f]+ exists", db.text())  # noqa: E731
    with serving(db, warm=False):
        wait_for(lambda: len(exists()) == 3, 20, db.text)
    assert uploaded_lines(db) == []  # a HEAD each, no PUT
    assert queue_counts(b)["records_uploaded"] == 3  # done: never asked again
    assert {remote_of(b).uploader(o["Key"]) for o in listed(s3, "blocks")} == {box_id(a)}


def test_remote_gc_deletes_markers_that_no_longer_count(s3, tmp_path, monkeypatch):
    from helpers import cli

    b = keyed(box(tmp_path / "b", s3))
    hashes = chain_hashes(FP, pack_tokens(chat(800)))
    sightings = Sightings(remote_of(b))
    try:
        sightings.mark(FP, hashes, range(1, 4))
        wait_for(lambda: sightings.counts["marked"] == 3, 10)
    finally:
        sightings.stop()
    out = cli("remote", "gc", "--home", b, code=0).output
    assert "seen-marker" not in out and len(listed(s3, "seen")) == 3  # a day: they still count
    monkeypatch.setattr(seen_mod, "SEEN_TTL_S", -1.0)
    assert "would delete 3 seen-markers" in cli("remote", "gc", "--dry-run", "--home", b).output
    assert "deleted 3 seen-markers" in cli("remote", "gc", "--home", b, code=0).output
    assert listed(s3, "seen") == []


def test_kvstore_serve_on_two_boxes_learns_what_each_saw_once(s3, llama_path, tmp_path):
    from helpers import Serve, cached_tokens, shared_tokens

    a, b = keyed(box(tmp_path / "a", s3)), keyed(box(tmp_path / "b", s3))
    for home in (a, b):  # blocks of 64: the tiny chat template's shared prefix holds several
        path = home / "settings.toml"
        path.write_text("block_tokens = 64\n" + path.read_text())
    shared = shared_tokens(llama_path, "My invoice was charged twice.", "Where is my parcel?")
    nodes = shared // 64

    def one_chat(home, text: str, n: int, then=lambda: None) -> dict:
        """One chat by a new `kvstore serve` on box `home`; `then()` before it stops."""
        s = Serve(home, llama_path, tmp_path / f"serve-{home.name}-{n}.log")
        try:
            s.wait_ready()
            reply = s.chat(text) | {"fleet": s.metric("fleet")}
            then()
            return reply
        finally:
            s.stop()

    da, db = Proc(a, log=tmp_path / "a.log"), Proc(b, log=tmp_path / "b.log")
    with serving(da, warm=False), serving(db, warm=False):
        for d in (da, db):
            d.wait_log("(upload True")
        # box A: seen once; its markers written
        one_chat(
            a,
            "My invoice was charged twice.",
            1,
            lambda: wait_for(lambda: len(listed(s3, "seen")) >= nodes, 20, da.text),
        )
        assert listed(s3, "blocks") == []  # nothing learned on one sighting
        # box B: seen once here, once on A: learned and uploaded
        one_chat(
            b,
            "Where is my parcel?",
            1,
            lambda: wait_for(lambda: len(listed(s3, "blocks")) >= nodes, 30, db.text),
        )
        assert f"{nodes * 64} tokens recur across the fleet" in db.text()
        reply = one_chat(a, "How do I reset my password?", 2)  # a new process on box A
        assert cached_tokens(reply) >= nodes * 64 and reply["fleet"] == nodes * 64, reply
