"""Learned prefixes through a real daemon: what `learn` wants, `put_blocks` acknowledged, shared
records stored once, growing conversations, both budgets, the snapshot cap, /metrics."""

from __future__ import annotations

import socket
import urllib.request

import mlx.core as mx
import pytest
from click.testing import CliRunner
from helpers import Proc, serving
from mlx_lm.models.cache import KVCache

from kvstore.cli.main import main
from kvstore.codec import codec
from kvstore.learned.blockstore import BlockStore
from kvstore.learned.records import slice_record
from kvstore.ops import put as put_ops
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store
from kvstore.wire.daemon_client import DaemonClient


def kv(n: int) -> list:
    c = KVCache()
    x = mx.arange(n * 8, dtype=mx.float32).reshape(1, 1, n, 8) / 1000
    c.update_and_fetch(x, -x)
    return [c]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fp_of(name: str) -> bytes:
    return name.encode().ljust(16, b".")[:16]


def learn(d: Proc, fp: bytes, tokens: list[int], sliceable: bool = True) -> dict:
    return d.request("learn", fingerprint=fp, tokens=pack_tokens(tokens), sliceable=sliceable,
                     model="tiny", label="t", extra={})  # fmt: skip


def send(d: Proc, fp: bytes, tokens: list[int], want: list) -> dict:
    cache = kv(len(tokens))
    recs = [{"start": s, "end": e, "blob": slice_record(cache, s, e)} for s, e in want]
    return d.request("put_blocks", fingerprint=fp, tokens=pack_tokens(tokens), records=recs,
                     label="t", model="tiny", extra={})  # fmt: skip


def prompt(shared: int, tail: int, seed: int) -> list[int]:
    return list(range(1, shared + 1)) + [100_000 + seed * 1000 + i for i in range(tail)]


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn")
    port = free_port()
    d = Proc(root / "home", "--metrics-port", str(port), log=root / "daemon.log")
    d.port = port
    with serving(d, warm=False):
        yield d


def test_shared_prefix_wanted_once_acknowledged_and_served(daemon):
    fp = fp_of("shared")
    assert learn(daemon, fp, prompt(800, 50, 1))["want"] == []  # seen once
    reply = learn(daemon, fp, prompt(800, 70, 2))
    assert reply == {"want": [[0, 256], [256, 512], [512, 768], [768, 800]], "snapshot_at": [],
                     "paused": None, "paused_by": None}  # fmt: skip
    # a second process learning the same prefix within 30 s is not asked: one copy
    assert learn(daemon, fp, prompt(800, 30, 3))["want"] == []
    before = metric(daemon.port, "kvstore_learned_records")
    ack = send(daemon, fp, prompt(800, 70, 2), reply["want"])
    assert ack["stored"] == 4 and ack["bytes"] > 0
    assert metric(daemon.port, "kvstore_learned_records") == before + 4
    assert metric(daemon.port, 'kvstore_store_written_bytes_total{kind="learned"}') >= ack["bytes"]
    assert learn(daemon, fp, prompt(800, 90, 4))["want"] == []  # stored
    # a client reads it back through a read-only store; a corrupt record ends the chain before it
    request = prompt(800, 5, 9)
    with Store(daemon.home, readonly=True) as ro:
        blocks = BlockStore(ro)
        chain = blocks.lookup(fp, request)
        assert blocks.served(chain, request) == 800 and len(blocks.read_blobs(chain)) == 4
    with Store(daemon.home) as rw:
        b = BlockStore(rw)
        rw._write(lambda t: t.put(chain[2].key, b"garbage", db=b._db(b"bblob")))
    with Store(daemon.home, readonly=True) as ro:
        blocks = BlockStore(ro)
        chain = blocks.lookup(fp, request)
        assert [m.end for m in chain] == [256, 512]  # never the garbage
        assert len(blocks.read_blobs(chain)) == 2


def test_stage_prompts_sharing_a_preamble_share_its_records(daemon):
    fp = fp_of("stages")
    s1, s2 = prompt(600, 300, 1), prompt(600, 300, 2)
    learn(daemon, fp, s1)
    w1 = learn(daemon, fp, s1)["want"]
    assert w1 == [[0, 256], [256, 512], [512, 768], [768, 900]]
    send(daemon, fp, s1, w1)
    learn(daemon, fp, s2)  # shares 600 with s1 -> [512, 600) is learned as a branch point
    w2 = learn(daemon, fp, s2)["want"]
    assert w2 == [[512, 768], [768, 900]]  # the preamble's [0, 512) is not sent again
    send(daemon, fp, s2, w2)
    with Store(daemon.home, readonly=True) as ro:
        blocks = BlockStore(ro)
        mine = [m for m in blocks.records() if m.key.startswith(fp)]
        assert len(mine) == 6
        assert BlockStore(ro).stored_end(fp, s2) == 900 == blocks.stored_end(fp, s1)


def test_a_growing_conversation_stores_only_new_records(daemon):
    fp = fp_of("chat")
    turn1 = prompt(0, 300, 1)
    turn2 = turn1 + [7] * 200
    turn3 = turn2 + [8] * 300
    assert learn(daemon, fp, turn1)["want"] == []
    w2 = learn(daemon, fp, turn2)["want"]
    assert w2 == [[0, 256], [256, 500]]
    send(daemon, fp, turn2, w2)
    w3 = learn(daemon, fp, turn3)["want"]
    assert w3 == [[500, 512], [512, 768], [768, 800]]
    send(daemon, fp, turn3, w3)
    with Store(daemon.home, readonly=True) as ro:
        mine = [m for m in BlockStore(ro).records() if m.key.startswith(fp)]
        assert sum(m.ntokens for m in mine) == 800  # every token stored once


def test_stats_and_ls_with_learned_data(daemon):
    fp, p = fp_of("stats"), prompt(0, 600, 5)
    learn(daemon, fp, p)
    send(daemon, fp, p, learn(daemon, fp, p)["want"])
    stats = daemon.request("stats")
    learned = stats["learned"]
    assert learned["records"] >= 3 and learned["bytes"] > 0 and learned["paused"] is None
    assert set(learned) >= {"records", "bytes", "budget", "written_today", "write_budget",
                            "paused", "snapshots"}  # fmt: skip
    assert stats["entries"] == 0 and daemon.request("ls") == []
    r = CliRunner().invoke(main, ["stats", "--home", str(daemon.home)])
    assert r.exit_code == 0 and "learned " in r.output, r.output


def test_snapshots_of_state_layouts_are_capped_per_chain(daemon):
    fp = fp_of("hybrid")
    base = prompt(400, 0, 0)
    learn(daemon, fp, base + [1] * 10, sliceable=False)
    assert learn(daemon, fp, base + [2] * 10, sliceable=False)["snapshot_at"] == [400]
    with DaemonClient(daemon.home) as c:
        for n in (100, 200, 300):
            toks = base[:n]
            put_ops.send(c, entry_key(fp, toks), codec.encode(kv(n)), {"tokens": pack_tokens(toks),
                  "label": "learned", "pinned": False, "extra": {"learned": True}})  # fmt: skip
    with Store(daemon.home, readonly=True) as ro:
        assert sorted(m.ntokens for m in ro.metas(fp)) == [200, 300]  # the shallowest went
    assert daemon.request("stats")["learned"]["snapshots"] >= 2


def test_budgets_evict_learned_never_pins_and_pause_said_once(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "settings.toml").write_text(
        "learned_max_bytes = 60000\nlearn_write_bytes_per_day = 150000\n"
    )
    d = Proc(home, log=tmp_path / "daemon.log")
    with serving(d, warm=False):
        fp = fp_of("budget")
        pin = list(range(5, 105))
        with DaemonClient(home) as c:
            put_ops.send(c, entry_key(fp, pin), codec.encode(kv(100)), {"tokens": pack_tokens(pin),
                  "label": "pin", "pinned": True})  # fmt: skip
        paused = None
        for i in range(12):
            p = [i * 10_000 + t for t in range(300)]
            learn(d, fp, p)
            reply = learn(d, fp, p)
            if reply["paused"]:
                paused = reply["paused"]
                break
            send(d, fp, p, reply["want"])
            learned = d.request("stats")["learned"]
            assert learned["bytes"] <= 60000  # the learned budget holds
        assert paused and "learn_write_bytes_per_day" in paused
        assert learn(d, fp, [1] * 300)["paused"] == paused
        stats = d.request("stats")
        assert stats["learned"]["paused"] == paused
        assert [m["label"] for m in d.request("ls")] == ["pin"]  # the pin was never evicted
        assert "evicted learned record" in d.text()
    assert d.text().count("learning paused") == 1, d.text()


def test_touch_blocks_marks_restored_records_used(daemon):
    fp = fp_of("touch")
    learn(daemon, fp, prompt(300, 10, 1))
    want = learn(daemon, fp, prompt(300, 20, 2))["want"]
    assert want == [[0, 256], [256, 300]]
    send(daemon, fp, prompt(300, 20, 2), want)
    with Store(daemon.home, readonly=True) as ro:
        chain = BlockStore(ro).lookup(fp, prompt(300, 5, 3))
    assert [m.hits for m in chain] == [0, 0]
    keys = [m.key for m in chain]
    reply = daemon.request("touch_blocks", fingerprint=fp, keys=keys + [fp + b"\0" * 16])
    assert reply == {"touched": 2}  # a key nothing holds is not an error (evicted meanwhile)
    with Store(daemon.home, readonly=True) as ro:
        after = BlockStore(ro).lookup(fp, prompt(300, 5, 3))
    assert [m.hits for m in after] == [1, 1]
    assert all(a.last_used > b.last_used for a, b in zip(after, chain, strict=True))
    with pytest.raises(Exception, match="record keys"):  # another model's keys are refused
        daemon.request("touch_blocks", fingerprint=fp_of("other"), keys=keys)


def test_a_pin_of_a_learned_prefix_drops_its_records_once_stored(daemon):
    """One copy: a pin put covering learned records drops them (leaf first; a record another
    chain extends stays), and the prefix is not learned again while the pin holds it."""
    fp = fp_of("adopt")
    a, b = prompt(800, 40, 1), prompt(800, 60, 2)
    learn(daemon, fp, a)
    send(daemon, fp, b, learn(daemon, fp, b)["want"])  # [0, 800) in 4 records
    other = prompt(600, 300, 3)  # shares [0, 600): branches inside [512, 800)
    learn(daemon, fp, other)
    send(daemon, fp, other, learn(daemon, fp, other)["want"])  # [512, 600)... of its own
    with Store(daemon.home, readonly=True) as ro:
        before = {m.key for m in BlockStore(ro).records() if m.key.startswith(fp)}
        chain = BlockStore(ro).lookup(fp, a)
    assert [(m.start, m.end) for m in chain] == [(0, 256), (256, 512), (512, 768), (768, 800)]
    pin = a[:780]  # the pinned system prompt; the learned prefix runs 20 tokens past it
    with DaemonClient(daemon.home) as c:
        put_ops.send(c, entry_key(fp, pin), codec.encode(kv(780)), {"tokens": pack_tokens(pin),
              "label": "system", "pinned": True})  # fmt: skip
    with Store(daemon.home, readonly=True) as ro:
        blocks = BlockStore(ro)
        after = {m.key for m in blocks.records() if m.key.startswith(fp)}
        assert after == before - {chain[2].key, chain[3].key}  # [0, 512) is the other's too
        assert blocks.stored_end(fp, other) == len(other)  # the other chain still serves
    assert learn(daemon, fp, prompt(800, 70, 4))["want"] == []  # the pin holds it: no 2nd copy
