"""Learned block records on the fleet tier (a real SeaweedFS server): `remote push` uploads one
object per record, `remote pull` stores another box's records after verifying each in full, and
the pulled chain exports as the KV of a fresh prefill."""

from __future__ import annotations

import json

import pytest
from fleet_boxes import box, remote_of
from helpers import TWO_PINS, Proc, assert_same_kv, cli, manifest_for, mlx_lm_prefill, serving
from mlx_lm import load
from mlx_lm.models.cache import load_prompt_cache

from kvstore.codec.blocks import slice_record
from kvstore.errors import RemoteError
from kvstore.fleet.objects import verify_record
from kvstore.identity.fingerprint import model_fingerprint
from kvstore.store.blocks import BlockStore
from kvstore.store.chain import cuts
from kvstore.store.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("environments_closed")]


def learn(home, model, model_path, fp: bytes, tokens: list[int], start: int = 0) -> None:
    cache = mlx_lm_prefill(model, tokens)
    rows = [(s, e, slice_record(cache, s, e)) for s, e in cuts(start, len(tokens))]
    with Store(home) as store:
        BlockStore(store).put_records(fp, tokens, rows, label="learned",
                                      extra={"model": str(model_path)})  # fmt: skip


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
    meta, chain_tokens, block, _ = verify_record(objs[0].key, data)
    assert block == 256 and len(chain_tokens) == 4 * meta.end
    bad = bytearray(data)
    bad[-3] ^= 0xFF
    with pytest.raises(RemoteError, match="checksum"):
        verify_record(objs[0].key, bad)
    with pytest.raises(RemoteError, match="do not hash to its key"):
        verify_record(objs[1].key[:16] + objs[0].key[16:][::-1], data)

    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=0)
    assert "0 fetched and 4 learned records, 2 not on the remote, 0 failed" in r.output, r.output
    assert "and 4 learned" not in cli("remote", "pull", "--manifest", manifest, "--home", b).output
    with Store(b, readonly=True) as sb:
        blocks = BlockStore(sb)
        chain = blocks.lookup(fp, tokens)
        assert [m.end for m in chain] == [256, 300, 512, 600]
        assert {m.extra["model"] for m in chain} == {str(llama_path)}
        assert {m.extra["origin"] for m in chain} == {"remote"}
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
