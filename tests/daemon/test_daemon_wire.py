"""The daemon's side of the typed wire: ping says the protocol and its operations, errors carry
codes, and the CLI's no-daemon path runs the very operation the daemon's handler runs."""

from __future__ import annotations

import json
import shutil
import socket
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from helpers import TWO_PINS, Proc, cli, manifest_for, serving

from kvstore.daemon.commands import Commands
from kvstore.home.ledger import Ledger
from kvstore.home.settings import load_settings
from kvstore.learned.blockstore import BlockStore
from kvstore.ops import entries
from kvstore.ops import stats as stats_ops
from kvstore.store.store import Store
from kvstore.wire import daemon_client, protocol
from kvstore.wire.codes import ErrorCode
from kvstore.wire.messages import OPS, PROTOCOL_VERSION, EvictRequest, StatsRequest


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A daemon with no manifest: nothing to warm."""
    root = tmp_path_factory.mktemp("wire")
    d = Proc(root / "home", log=root / "daemon.log")
    with serving(d, warm=False):
        yield d


def test_ping_answers_the_protocol_version_and_the_operations(bare):
    reply = bare.request("ping")
    assert reply["protocol"] == PROTOCOL_VERSION and reply["ops"] == list(OPS)
    client = daemon_client.connect(bare.home)
    assert client is not None
    with client:
        assert client.info.protocol == PROTOCOL_VERSION
        assert "put_blocks" in client.info.ops and "format_disk" not in client.info.ops


def test_unknown_ops_and_bad_arguments_reply_with_codes(bare):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(str(daemon_client.socket_path(bare.home)))
    try:
        for msg, code, words in [
            ({"cmd": "format_disk"}, ErrorCode.UNKNOWN_OP, "unknown command"),
            ({"cmd": "ls", "args": [1]}, ErrorCode.BAD_ARGUMENT, "args must be a map"),
            # the validator bug the issue names: True was taken for to_size=1
            ({"cmd": "evict", "args": {"to_size": True}}, ErrorCode.BAD_ARGUMENT, "must be"),
            ({"cmd": "warm", "args": {"manifest": "/nonexistent.toml"}}, ErrorCode.REFUSED,
             "not found"),
            ({"cmd": "put", "args": {"key": b"k" * 32, "fields": {}, "nbytes": True,
                                     "checksum": 0, "blob": b""}}, ErrorCode.BAD_ARGUMENT,
             "'nbytes' must be"),
        ]:  # fmt: skip
            protocol.send(s, msg)
            reply = protocol.recv(s, timeout=5)
            assert reply["ok"] is False and reply["code"] == code.value, reply
            assert words in reply["error"], reply
    finally:
        s.close()


class _Inline:
    """The writer, run inline (the test is the writer thread)."""

    current = None

    def submit(self, name, fn, reported=False):
        f: Future = Future()
        f.set_result(fn())
        return f


def _commands(store: Store, home) -> Commands:
    control = SimpleNamespace(
        home=home,
        started=time.time(),
        manifests=[],
        fixed_manifests=frozenset(),
        watcher_mode=lambda: "off",
    )
    upkeep = SimpleNamespace(blocks=BlockStore(store), last_warm=None, deferred={})
    return Commands(
        store,
        _Inline(),
        upkeep,
        Ledger(home),
        SimpleNamespace(paused=None),
        load_settings(home),
        control=control,
    )


def test_cli_without_a_daemon_and_the_daemon_run_one_evict_and_one_stats(
    llama_path, kv_home, tmp_path, monkeypatch
):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    cli("warm", "--manifest", str(manifest), code=0)
    twin = tmp_path / "twin"  # the same store, for the daemon's side
    shutil.copytree(kv_home, twin)
    replies: dict[str, list] = {"evict": [], "stats": []}
    evict, stats = entries.evict, stats_ops.stats

    def spy_evict(*a, **kw):
        out = evict(*a, **kw)
        replies["evict"].append(out.reply().to_wire())
        return out

    def spy_stats(*a, **kw):
        out = stats(*a, **kw)
        replies["stats"].append(out)
        return out

    monkeypatch.setattr(entries, "evict", spy_evict)
    monkeypatch.setattr(stats_ops, "stats", spy_stats)

    local = json.loads(cli("stats", "--json", code=0).output)
    with Store(kv_home) as store:
        daemon = _commands(store, kv_home).cmd_stats(StatsRequest(), None).to_wire()
    assert len(replies["stats"]) == 2  # one function, both callers
    assert replies["stats"][0].store == replies["stats"][1].store
    assert replies["stats"][0].learned == replies["stats"][1].learned
    assert local == json.loads(json.dumps(replies["stats"][0].to_local_json()))
    assert {k: v for k, v in daemon.items() if k != "daemon"} == {
        **replies["stats"][0].to_local_json(),
        "learned": replies["stats"][0].learned,
    }

    out = cli("evict", "--label", "classify", code=0).output
    with Store(twin) as store:
        daemon = _commands(store, twin).cmd_evict(EvictRequest(label="classify"), None).to_wire()
    assert len(replies["evict"]) == 2
    assert replies["evict"][0] == replies["evict"][1] == daemon
    assert daemon["evicted"] == 1 and "evicted 1 entry" in out
