"""The semantic check of learned records fetched from the fleet (issues 34 item 4, 32 item 1),
against a real SeaweedFS server: a box holding the fleet key that scales a LATER record of a
chain by 1.5 and re-seals it is refused by the read-through (the decoding steps drawn over the
whole fetched stretch, over the assembled cache), whether the fetch starts the chain or
continues one this box holds; the request prefills, nothing is stored, the uploader is
quarantined, one log line. A hybrid (state layout) record tampered past its first 64 positions
is refused by `remote pull` (its whole record is compared with this model's prefill)."""

from __future__ import annotations

import dataclasses
import logging

import mlx.core as mx
import pytest
import xxhash
from fleet_boxes import BUCKET, box, chat, keyed, remote_of, store_chain
from helpers import TWO_PINS, assert_same_kv, cli, manifest_for, mlx_lm_prefill
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from kvstore import metrics
from kvstore import tokens as tk
from kvstore.client.learn import Learner
from kvstore.client.persistent import PinnedPromptCache
from kvstore.codec import codec
from kvstore.fleet.learned import push_records
from kvstore.fleet.objects import record_header, seal, verify_record
from kvstore.identity.fingerprint import model_fingerprint
from kvstore.learned.blockstore import BlockStore
from kvstore.learned.chain import cuts
from kvstore.learned.coldtier import LearnTarget
from kvstore.learned.records import kv_layers, slice_record
from kvstore.store.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("environments_closed")]

FP = bytes(range(16))
KEY = "tiny"


def fleet_tokens() -> float:
    return (
        metrics.REGISTRY.get_sample_value("kvstore_prompt_tokens_total", {"source": "fleet"}) or 0
    )


@pytest.fixture(scope="module")
def tiny(llama_path):
    model, _ = load(str(llama_path))
    return model, llama_path


def push(home, fp: bytes = FP) -> int:
    with Store(home) as store:
        return push_records(remote_of(home), store, say=print)["uploaded"]


def reseal_scaled(s3, a, fp: bytes, start: int, lo: int, hi: int) -> None:
    """Box `a`, which holds the fleet key, scales positions [lo, hi) (of the chain) of its
    record that starts at `start` by 1.5 (keys and values, every layer it holds) and re-seals
    it: the MAC and every structural check pass."""
    remote, client = remote_of(a), s3.client()
    rs = remote.settings
    for o in remote.records(fp):
        data = client.get_object(Bucket=BUCKET, Key=o.name)["Body"].read()
        v = verify_record(o.key, data, keys=rs.fleet_keys)
        if v.meta.start != start:
            continue
        cache, _ = codec.decode(v.blob)
        for c in cache:
            pos = start + mx.arange(c.keys.shape[2])[None, None, :, None]
            scale = mx.where((pos >= lo) & (pos < hi), 1.5, 1.0).astype(c.keys.dtype)
            c.keys, c.values = c.keys * scale, c.values * scale
        new = codec.encode(cache)
        meta = dataclasses.replace(v.meta, nbytes=len(new), checksum=xxhash.xxh3_64_intdigest(new))
        body = record_header(meta, v.tokens[: tk.nbytes(start)], v.block) + new
        client.put_object(Bucket=BUCKET, Key=o.name, Body=body + seal(rs, body),
                          Metadata={"box": rs.box_id})  # fmt: skip
        return
    raise AssertionError(f"no record starts at {start}")


def requests_on(b, tiny, request: list[int], n: int = 2) -> tuple[list[list[int]], Learner]:
    """`n` requests of the same prompt on box `b` (the first's KV is not kept: each misses)."""
    model, path = tiny
    rests = []
    learner = Learner(b)
    submit, learner.jobs = learner.writer.submit, []  # type: ignore[attr-defined]
    learner.writer.submit = lambda job: learner.jobs.append(job.what) or submit(job)  # type: ignore[method-assign]
    learner.add_target(KEY, LearnTarget(fingerprint=FP, model=str(path), model_obj=model,
                                        extra={}))  # fmt: skip
    try:
        for _ in range(n):
            lru = PinnedPromptCache(max_size=4)
            lru.learner = learner
            rests.append(lru.fetch_nearest_cache(KEY, request)[1])
        learner.drain(5.0)
    finally:
        learner.close(timeout=5.0)
    return rests, learner


def refused_once(caplog, learner, uploader: str) -> None:
    """One log line, one verdict sent (the uploader's quarantine), the uploader quarantined
    here, and no record sent to be stored."""
    lines = [r.getMessage() for r in caplog.records if "fleet" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "not what this box's model computes" in lines[0] and "drawn positions" in lines[0]
    assert [j for j in learner.jobs if "record hits" not in j] == ["fleet check verdict"]
    assert uploader in learner.fleet.quarantined()


@pytest.mark.parametrize("scaled", [(256, 512), (300, 310)], ids=["record", "stretch"])
def test_a_later_record_tampered_is_refused(s3, tiny, tmp_path, caplog, scaled):
    """The chain [0, 600) fetched from 0: its second record [256, 512) scaled (whole, or ten
    positions of it) is refused, though its first record is honest."""
    tokens = chat(600, seed=41)
    a = tmp_path / "a"
    store_chain(box(a, s3), mlx_lm_prefill(tiny[0], tokens), tokens, FP, tiny[1])
    assert push(keyed(a)) == 3
    reseal_scaled(s3, a, FP, 256, *scaled)
    b = keyed(box(tmp_path / "b", s3))
    request = tokens + chat(30, seed=9)
    before = fleet_tokens()
    with caplog.at_level(logging.INFO):
        rests, learner = requests_on(b, tiny, request)
    assert rests == [request, request]  # prefilled, as without the fleet: output unchanged
    assert fleet_tokens() == before
    refused_once(caplog, learner, remote_of(a).settings.box_id)
    with Store(b) as store:
        assert BlockStore(store).stored_end(FP, tokens) == 0


def test_a_tampered_record_continuing_a_local_chain_is_refused(s3, tiny, tmp_path, caplog):
    """Box B holds [0, 256) of the chain; the fleet's [256, 512), scaled, continues it: the
    steps run over B's own records and the fetched one, and refuse it."""
    model, path = tiny
    tokens = chat(600, seed=43)
    honest = mlx_lm_prefill(model, tokens)
    a = tmp_path / "a"
    store_chain(box(a, s3), honest, tokens, FP, path)
    assert push(keyed(a)) == 3
    reseal_scaled(s3, a, FP, 256, 256, 512)
    b = keyed(box(tmp_path / "b", s3))
    store_chain(b, honest, tokens[:256], FP, path)  # B learned the first block itself
    request = tokens + chat(30, seed=9)
    before = fleet_tokens()
    with caplog.at_level(logging.INFO):
        rests, learner = requests_on(b, tiny, request)
    assert rests == [request[256:]] * 2  # B's own block, the rest prefilled
    assert fleet_tokens() == before
    refused_once(caplog, learner, remote_of(a).settings.box_id)
    with Store(b) as store:
        assert BlockStore(store).stored_end(FP, tokens) == 256


def test_an_honest_chain_continuing_a_local_one_is_served(s3, tiny, tmp_path, caplog):
    """The same without the tamper: the fetched records pass their steps and are served."""
    model, path = tiny
    tokens = chat(600, seed=45)
    honest = mlx_lm_prefill(model, tokens)
    a = tmp_path / "a"
    store_chain(box(a, s3), honest, tokens, FP, path)
    assert push(keyed(a)) == 3
    b = keyed(box(tmp_path / "b", s3))
    store_chain(b, honest, tokens[:256], FP, path)
    request = tokens + chat(30, seed=9)
    before = fleet_tokens()
    with caplog.at_level(logging.INFO):
        rests, _ = requests_on(b, tiny, request, n=1)
    assert rests == [request[512:]]
    assert fleet_tokens() - before == 256


def hybrid_chain(home, model, model_path, fp: bytes, tokens: list[int]) -> None:
    """A hybrid box's learned records of `tokens`: its KV layers only, cut at 256."""
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    layers = kv_layers(cache)
    assert layers, "the tiny qwen3_5 keeps state layers"
    rows = [(s, e, slice_record(cache, s, e, layers=layers)) for s, e in cuts(0, len(tokens))]
    with Store(home) as store:
        BlockStore(store).put_records(fp, tokens, rows, label="learned",
                                      extra={"model": str(model_path)})  # fmt: skip


@pytest.mark.parametrize("start", [0, 256], ids=["first", "later"])
def test_a_hybrid_record_tampered_past_64_is_refused_by_pull(
    s3, hybrid_path, tmp_path, start
):  # fmt: skip
    model, _ = load(str(hybrid_path))
    fp = model_fingerprint(str(hybrid_path)).digest
    manifest = str(manifest_for(tmp_path, hybrid_path, TWO_PINS))
    tokens = chat(400, seed=47)
    a = keyed(box(tmp_path / "a", s3))
    hybrid_chain(a, model, hybrid_path, fp, tokens)
    assert push(a, fp) == 2
    b, c = keyed(box(tmp_path / "b", s3)), keyed(box(tmp_path / "c", s3))
    r = cli("remote", "pull", "--manifest", manifest, "--home", c, code=0)  # honest: taken
    assert "and 2 learned records" in r.output and "refused" not in r.output, r.output

    reseal_scaled(s3, a, fp, start, start + 100, start + 144)
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=1)
    assert "refused learned record" in r.output and "not what this box's model computes" in (
        r.output
    ), r.output
    assert f"every object of {remote_of(a).settings.box_id} is quarantined" in r.output
    with Store(b) as store:
        assert BlockStore(store).stored_end(fp, tokens) <= start  # the tampered one: not stored


def test_a_chains_records_checked_in_any_order_cost_one_prefill(hybrid_path):
    """check_record's full check of a hybrid's records keeps this model's own cache of the chain
    (SemanticCheck keeps them): a record inside a chain already run is compared with it as it
    is, one past it continues it; a record tampered anywhere past 64 is refused."""
    from kvstore.fleet.check import check_record
    from kvstore.identity.model import ModelIdentity

    model, _ = load(str(hybrid_path))
    identity = ModelIdentity(str(hybrid_path))
    tokens = chat(900, seed=49)
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    layers = kv_layers(cache)
    records = {s: (e, slice_record(cache, s, e, layers=layers)) for s, e in cuts(0, 900)}
    ends: dict = {}
    ran = []
    for s in (256, 0, 512, 768):  # the order a listing gives them
        e, blob = records[s]
        v = check_record(model, identity, tokens[:e], blob, ends=ends)
        assert v.ok, v.what
        ran.append(v.prefilled)
    assert ran == [512, 0, 256, 132]  # the chain's 900 tokens run once
    e, blob = records[768]
    v = check_record(model, identity, tokens[:e], blob, ends={})
    assert v.ok and v.prefilled == 900 and "prefilled from 0" in v.what, v.what

    for c in (cache[i] for i in layers):
        pos = mx.arange(c.keys.shape[2])[None, None, :, None]
        c.keys = mx.where(pos == 530, c.keys * 1.5, c.keys)
    forged = slice_record(cache, 512, 768, layers=layers)
    v = check_record(model, identity, tokens[:768], forged, ends=ends)
    assert not v.ok and "positions 512-767, all of them, in this model's cache" in v.what, v.what


def test_a_hybrids_learned_snapshot_is_pulled_and_served_whole(s3, hybrid_path, tmp_path):
    """A hybrid box's learned chain as its learner stores it (a state-only snapshot at the
    prompt's end, its KV layers as records) is pulled by box B, every part checked (the
    snapshot's state layers against a prefill, the records whole), and B's store serves the
    whole cache of it; before, the snapshot's emptied KV layers failed the check and its honest
    uploader was quarantined."""
    from kvstore.learned.blockstore import load_entry
    from kvstore.learned.records import state_part
    from kvstore.store.entry import entry_key, pack_tokens

    model, _ = load(str(hybrid_path))
    fp = model_fingerprint(str(hybrid_path)).digest
    manifest = str(manifest_for(tmp_path, hybrid_path, TWO_PINS))
    tokens = chat(400, seed=53)
    a = keyed(box(tmp_path / "a", s3))
    hybrid_chain(a, model, hybrid_path, fp, tokens)
    cache = mlx_lm_prefill(model, tokens)
    layers = kv_layers(cache)
    key = entry_key(fp, tokens)
    with Store(a) as store:
        store.put(key, codec.encode(state_part(cache, layers)), tokens=pack_tokens(tokens),
                  label="learned", model=str(hybrid_path),
                  classes=codec.cache_classes(cache),
                  extra={"learned": True, "kv_layers": layers, "kv_block": 256})  # fmt: skip
    r = cli("remote", "push", "--home", a, code=0)
    assert "learned records: 2 uploaded" in r.output, r.output
    b = keyed(box(tmp_path / "b", s3))
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=0)
    assert "1 fetched and 2 learned records" in r.output and "refused" not in r.output, r.output
    with Store(b) as store:
        meta, whole = load_entry(store, key)
    assert meta.extra.uploader == remote_of(a).settings.box_id
    assert_same_kv(whole, cache)
