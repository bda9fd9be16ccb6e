"""Learned block records on the fleet tier (a real SeaweedFS server): `remote push` uploads one
object per record, `remote pull` stores another box's records after verifying each in full, and
the pulled chain exports as the KV of a fresh prefill."""

from __future__ import annotations

import json

import pytest
from fleet_boxes import box, queue_counts, remote_of, store_chain
from helpers import (
    TWO_PINS,
    Proc,
    assert_same_kv,
    cli,
    manifest_for,
    mlx_lm_prefill,
    serving,
    wait_for,
)
from mlx_lm import load
from mlx_lm.models.cache import load_prompt_cache

from kvstore.errors import RemoteError
from kvstore.fleet.objects import blob_end, verify_record
from kvstore.identity.fingerprint import model_fingerprint
from kvstore.learned.blockstore import BlockStore
from kvstore.learned.chain import cuts
from kvstore.learned.records import slice_record
from kvstore.store.entry import pack_tokens
from kvstore.store.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("environments_closed")]


def learn(home, model, model_path, fp: bytes, tokens: list[int], start: int = 0) -> None:
    store_chain(home, mlx_lm_prefill(model, tokens), tokens, fp, model_path, start)


def test_learned_records_push_and_pull_verified(s3, llama_path, tmp_path):
    a, b = box(tmp_path / "a", s3), box(tmp_path / "b", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    fp = model_fingerprint(str(llama_path)).digest
    model, _ = load(str(llama_path))
    tokens = [(7 * i) % 500 + 3 for i in range(600)]
    learn(a, model, llama_path, fp, tokens[:300])  # a turn, then the next turn's own records
    learn(a, model, llama_path, fp, tokens, start=300)

    r = cli("remote", "push", "--home", a, code=0)
    assert "0 uploaded, 0 already there" in r.output  # no entries: plain push line unchanged
    assert "learned records: 4 uploaded, 0 already there" in r.output
    assert (
        "learned records: 0 uploaded, 4 already there"
        in cli("remote", "push", "--home", a, code=0).output
    )
    remote = remote_of(a)
    objs = list(remote.records(fp))
    assert len(objs) == 4 and list(remote.objects()) == []  # entry listings never see records

    # every object verifies alone; a flipped byte or another record's key is refused
    data, _ = remote.fetch(objs[0].key, name=objs[0].name)
    v = verify_record(objs[0].key, data, unsigned=True)
    meta, chain_tokens, block = v.meta, v.tokens, v.block
    assert block == 256 and len(chain_tokens) == 4 * meta.end
    bad = bytearray(data)
    bad[blob_end(data) - 3] ^= 0xFF
    with pytest.raises(RemoteError, match="checksum"):
        verify_record(objs[0].key, bad, unsigned=True)
    with pytest.raises(RemoteError, match="do not hash to its key"):
        verify_record(objs[1].key[:16] + objs[0].key[16:][::-1], data, unsigned=True)

    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=0)
    assert "0 fetched and 4 learned records, 2 not on the remote, 0 failed" in r.output, r.output
    assert "and 4 learned" not in cli("remote", "pull", "--manifest", manifest, "--home", b).output
    with Store(b, readonly=True) as sb:
        blocks = BlockStore(sb)
        chain = blocks.lookup(fp, tokens)
        assert [m.end for m in chain] == [256, 300, 512, 600]
        assert {m.extra.model for m in chain} == {str(llama_path)}
        assert {m.extra.origin for m in chain} == {"remote"}
    listed = json.loads(cli("ls", "--learned", "--json", "--home", b, code=0).output)
    (end,) = [x for x in listed if x["chain_end"]]
    out = tmp_path / "pulled.safetensors"
    cli("export", end["key"], out, "--home", b, code=0)
    cache = load_prompt_cache(str(out))
    assert_same_kv(cache, mlx_lm_prefill(model, tokens))

    # with a daemon running, pull's records go through it (put_blocks: the one writer)
    c = box(tmp_path / "c", s3)
    with serving(Proc(c, log=tmp_path / "c.log"), warm=False) as d:
        r = cli("remote", "pull", "--manifest", manifest, "--home", c, code=0)
        assert "0 fetched and 4 learned records" in r.output, r.output
        assert "put_blocks 'learned'" in d.text()
    with Store(c, readonly=True) as sc:
        assert BlockStore(sc).stored_end(fp, tokens) == 600
    # the janitor deletes records too: a retired model's go with its entries
    r = cli("remote", "gc", "--model", fp.hex(), "--home", a, code=0)
    assert "4 objects deleted" in r.output and list(remote.records()) == []


def test_a_daemon_uploads_the_records_it_learns_write_behind(s3, llama_path, tmp_path):
    """Records move like entries: each record a daemon with [remote] stores (put_blocks, as
    `kvstore serve` and learning apps send them) goes up on its own within seconds, and one
    stored before the daemon started is swept up at its start; no `remote push` is run. A
    record evicted before its upload is dropped from the queue, not retried."""
    from kvstore.wire.daemon_client import connect

    a = box(tmp_path / "a", s3)
    fp = model_fingerprint(str(llama_path)).digest
    model, _ = load(str(llama_path))
    tokens = [(5 * i) % 500 + 3 for i in range(600)]
    learn(a, model, llama_path, fp, tokens[:300])  # before the daemon: 2 records to sweep
    remote = remote_of(a)
    with serving(Proc(a, log=tmp_path / "a.log"), warm=False) as d:
        wait_for(lambda: len(list(remote.records(fp))) == 2, what="the swept records")
        cache = mlx_lm_prefill(model, tokens)
        client = connect(a)
        try:
            rows = [{"start": s, "end": e, "blob": slice_record(cache, s, e)}
                    for s, e in cuts(300, 600)]  # fmt: skip
            args = dict(fingerprint=fp, tokens=pack_tokens(tokens), records=rows,
                        label="learned", model=str(llama_path), extra={})  # fmt: skip
            client.raw("put_blocks", args)
        finally:
            client.close()
        wait_for(lambda: len(list(remote.records(fp))) == 4, what="the learned records uploaded")
        assert d.text().count("remote: learned record") == 4
    assert queue_counts(a) == {"queued": 0, "uploaded": 0, "records_queued": 0,
                               "records_uploaded": 4}  # fmt: skip
    status = json.loads(cli("remote", "status", "--json", "--home", a, code=0).output)
    assert status["records"] == 4 and status["records_bytes"] > 0
    r = cli("remote", "push", "--home", a, code=0)
    assert "learned records: 0 uploaded, 4 already there" in r.output
    # the chain a fresh box pulls is the prefill's KV, as after a push
    b = box(tmp_path / "b", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    assert "and 4 learned records" in cli("remote", "pull", "--manifest", manifest,
                                          "--home", b).output  # fmt: skip
    with Store(b, readonly=True) as sb:
        assert BlockStore(sb).stored_end(fp, tokens) == 600


def test_a_record_evicted_before_its_upload_leaves_the_queue(s3, llama_path, tmp_path):
    from kvstore.fleet.queue import UploadQueue, upload_one_record

    a = box(tmp_path / "a", s3)
    fp = model_fingerprint(str(llama_path)).digest
    model, _ = load(str(llama_path))
    learn(a, model, llama_path, fp, [(3 * i) % 500 + 3 for i in range(300)])
    with Store(a) as store:
        blocks = BlockStore(store)
        keys = [m.key for m in sorted(blocks.records(), key=lambda m: m.end)]
        queue = UploadQueue(a)
        try:
            assert queue.sweep(store) == 2 and sorted(queue.pending("record")) == sorted(keys)
            blocks.delete(keys[:1])  # the chain's first record: the second is cut off here
            remote = remote_of(a)
            assert [upload_one_record(remote, blocks, queue, k) for k in keys] == ["gone", "gone"]
            assert queue.counts()["records_queued"] == 0 and list(remote.records()) == []
        finally:
            queue.close()
