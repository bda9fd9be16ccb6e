"""The daemon as real processes on real sockets: boot warm, restart reuse, one per home, signals,
takeover after kill -9, puts that hydrate, the budget, bad frames, other users, the CLI routing.

One daemon (`shared`) serves most tests; the lifecycle tests start their own short-lived ones.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from helpers import TWO_PINS, Proc, cli, manifest_for, serving, wait_for

from kvstore.errors import DaemonError, ProtocolError
from kvstore.ops import put as put_ops
from kvstore.store.store import Store
from kvstore.wire import daemon_client, protocol
from kvstore.wire.daemon_client import DaemonClient, connect


def entries(home: Path) -> dict[str, dict]:
    with DaemonClient(home) as c:
        return {e["key"]: e for e in c.raw("ls")}


@pytest.fixture(scope="module")
def shared(tmp_path_factory, llama_path):
    root = tmp_path_factory.mktemp("daemon")
    home = root / "home"
    home.mkdir(mode=0o700)
    # short timeouts and a small connection cap, so the limits are testable quickly
    (home / "settings.toml").write_text(
        "header_timeout = 1.0\nidle_timeout = 5.0\nmax_connections = 6\n"
    )
    manifest = manifest_for(root, llama_path, TWO_PINS)
    d = Proc(home, "--manifest", str(manifest), log=root / "daemon.log")
    d.manifest = manifest
    with serving(d):
        yield d


@pytest.fixture(scope="module")
def make_entry(llama_path):
    """A real encoded cache for the tiny llama; entries with other tokens reuse its blob."""
    from mlx_lm import load

    from kvstore.codec import codec
    from kvstore.identity.fingerprint import model_fingerprint, template_hash
    from kvstore.kvcheck.prefill import prefill
    from kvstore.store.entry import entry_key, pack_tokens

    model, _ = load(str(llama_path))
    tokens = list(range(7, 47))
    cache = prefill(model, tokens)
    blob = codec.encode(cache, {"model": str(llama_path), "tokenizer_config": "{}"})
    fp = model_fingerprint(llama_path).digest
    th = template_hash(llama_path)

    def make(label: str, toks: list[int] = tokens, pinned: bool = False):
        fields = dict(tokens=pack_tokens(toks), label=label, pinned=pinned, model=str(llama_path),
                      template_hash=th, classes=codec.cache_classes(cache),
                      extra={"adapter": None, "kv_bits": None, "kv_group_size": 64,
                             "source": "test"})  # fmt: skip
        return entry_key(fp, toks), blob, fields

    return make


# -- boot, restart, one per home, signals ----------------------------------------------------


def test_boot_warms_the_manifest_and_reports_memory(shared):
    w = shared.request("stats")["daemon"]["last_warm"]
    assert (w["warmed"], w["present"], w["failed"], w["models_loaded"]) == (2, 0, 0, 1)
    assert w["rss_before"] > 0 and w["rss_peak"] >= w["rss_after"] > 0
    pins = [e for e in entries(shared.home).values() if e["pinned"]]
    assert sorted(e["label"] for e in pins) == ["classify", "synthesize"]
    assert "warm: loading" in shared.text()


def test_restart_reuses_pins_without_loading_the_model(tmp_path, llama_path):
    home = tmp_path / "h"
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    first = Proc(home, "--manifest", str(manifest), log=tmp_path / "1.log")
    first.wait_ready()
    assert first.wait_warm()["warmed"] == 2
    before = {k: e["created"] for k, e in entries(home).items()}
    assert first.stop()[0] == 0

    second = Proc(home, "--manifest", str(manifest), log=tmp_path / "2.log")
    try:
        second.wait_ready()
        w = second.wait_warm()
        assert (w["warmed"], w["present"], w["models_loaded"]) == (0, 2, 0)
        assert {k: e["created"] for k, e in entries(home).items()} == before
        assert "warm: loading" not in second.text()
    finally:
        assert second.stop()[0] == 0


def test_second_daemon_is_refused_and_the_first_keeps_serving(shared):
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "kvstore", "daemon", "--home", str(shared.home)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0  # daemon/exits.py: a supervisor must not restart it
    assert f"pid {shared.pid}" in r.stderr and "already runs" in r.stderr
    assert time.monotonic() - t < 15
    assert shared.request("ping")["pid"] == shared.pid
    assert daemon_client.socket_path(shared.home).exists()


def test_sigterm_exits_zero_quickly_and_removes_the_socket(tmp_path):
    d = Proc(tmp_path / "h", log=tmp_path / "d.log")
    d.wait_ready()
    sock = daemon_client.socket_path(d.home)
    assert sock.stat().st_mode & 0o777 == 0o600
    assert d.home.stat().st_mode & 0o777 == 0o700
    rc, seconds = d.stop(signal.SIGTERM)
    assert rc == 0 and seconds < 5, d.text()
    assert not sock.exists()
    assert "stopped" in d.text()


def test_kill_9_leaves_a_socket_the_next_daemon_takes_over(tmp_path):
    first = Proc(tmp_path / "h", log=tmp_path / "d.log")
    first.wait_ready()
    first.stop(signal.SIGKILL)
    assert daemon_client.socket_path(first.home).exists()  # stale: nobody listens
    assert connect(first.home) is None
    second = Proc(tmp_path / "h", log=tmp_path / "d.log")
    try:
        second.wait_ready()
        assert second.request("ping")["pid"] == second.pid
    finally:
        assert second.stop()[0] == 0


def test_a_home_too_deep_for_sun_path_serves_on_the_fallback(tmp_path):
    home = tmp_path / ("deep-" * 25) / "home"
    assert len(str(home / "kvstore.sock")) >= daemon_client.SUN_PATH_MAX
    d = Proc(home, log=tmp_path / "d.log")
    try:
        d.wait_ready()
        path = daemon_client.socket_path(home)
        assert path.parent == daemon_client.fallback_dir() and path.exists()
        assert d.request("ping")["pid"] == d.pid
    finally:
        assert d.stop()[0] == 0
    assert not path.exists()


def test_sighup_reconciles(shared):
    before = shared.request("stats")["daemon"]["last_warm"]["at"]
    os.kill(shared.pid, signal.SIGHUP)
    w = shared.next_warm(before)
    assert w["cause"] == "SIGHUP" and w["present"] == 2 and w["warmed"] == 0
    assert "SIGHUP: re-reading" in shared.text()


def test_manifest_edit_rewarms_only_the_changed_pin(shared):
    before = {e["label"]: (k, e["created"]) for k, e in entries(shared.home).items()}
    original = shared.manifest.read_text()
    at = shared.request("stats")["daemon"]["last_warm"]["at"]
    try:
        shared.manifest.write_text(original.replace("You are the writer.", "You are the editor."))
        w = shared.next_warm(at)
        assert w["cause"].startswith("files changed") and (w["warmed"], w["purged"]) == (1, 1)
        after = {e["label"]: (k, e["created"]) for k, e in entries(shared.home).items()}
        assert after["classify"] == before["classify"]  # untouched pin: same key, same created
        assert after["synthesize"][0] != before["synthesize"][0]
        assert before["synthesize"][0] not in entries(shared.home)
        shared.wait_log("pin removed, or its rendered tokens changed")
    finally:
        at = shared.request("stats")["daemon"]["last_warm"]["at"]
        shared.manifest.write_text(original)
        shared.next_warm(at)
    assert {e["label"] for e in entries(shared.home).values()} == {"classify", "synthesize"}


# -- writes through the socket ---------------------------------------------------------------


def test_streamed_put_is_verified_then_hydrates(shared, make_entry, llama_path, monkeypatch):
    from mlx_lm.models.cache import LRUPromptCache

    from kvstore.client import hydrate

    key, blob, fields = make_entry("via-socket")
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 4096)  # many frames even for a tiny blob
    assert len(blob) > 4 * 4096
    with DaemonClient(shared.home) as c:
        with pytest.raises(DaemonError, match="checksum"):  # damaged in flight: refused
            c.raw("put", dict(key=key, fields=fields, nbytes=len(blob), checksum=0, blob=blob))
        with pytest.raises(DaemonError, match="safetensors|header|bytes"):  # not a cache: refused
            put_ops.send(c, key, b"\x00" * 100, fields)
        meta = put_ops.send(c, key, blob, fields)  # streamed in 4 KiB frames
        assert c.raw("ping")["pid"] == shared.pid
    assert meta.key == key and meta.label == "via-socket" and meta.nbytes == len(blob)
    lru = LRUPromptCache(max_size=8)
    report = hydrate(lru, "m", llama_path, home=shared.home)
    assert "via-socket" in report.labels, report
    cache, rest = lru.fetch_nearest_cache("m", list(range(7, 47)) + [99])
    assert cache is not None and rest == [99]
    with DaemonClient(shared.home) as c:
        c.raw("evict", dict(keys=[key]))


def test_put_with_a_key_that_does_not_match_its_tokens_is_refused(shared, make_entry):
    key, blob, fields = make_entry("liar")
    with DaemonClient(shared.home) as c, pytest.raises(DaemonError, match="does not match"):
        put_ops.send(c, key[:16] + bytes(16), blob, fields)
    assert "liar" not in {e["label"] for e in entries(shared.home).values()}


def test_budget_evicts_lru_unpinned_and_never_pins(shared, make_entry):
    pinned_bytes = sum(e["nbytes"] for e in entries(shared.home).values() if e["pinned"])
    settings = shared.home / "settings.toml"
    original = settings.read_text()
    try:
        a, b, c3 = (make_entry(f"lru-{i}", [900 + i] * 40) for i in range(3))
        nbytes = len(a[1])
        settings.write_text(original + f"max_bytes = {pinned_bytes + int(2.5 * nbytes)}\n")
        shared.request("warm")
        with DaemonClient(shared.home) as c:
            put_ops.send(c, *a)
            put_ops.send(c, *b)
            c.raw("touch", dict(keys=[a[0]]))  # a is now more recent than b
            put_ops.send(c, *c3)
        labels = {e["label"] for e in entries(shared.home).values()}
        assert {"lru-0", "lru-2", "classify", "synthesize"} <= labels and "lru-1" not in labels
        shared.wait_log("over the budget")
        from kvstore.home import tombstones  # a later miss on it reads `evicted` (reasons)

        models = {e["model"] for e in entries(shared.home).values()}
        gone = [t for t in tombstones.load(shared.home, models) if t.entry == "lru-1"]
        assert [t.by for t in gone] == ["byte budget"]

        settings.write_text(original + f"max_bytes = {pinned_bytes // 2}\n")  # pins alone exceed
        shared.request("warm")
        with DaemonClient(shared.home) as c:
            put_ops.send(c, *make_entry("lru-3", [777] * 40))
        labels = {e["label"] for e in entries(shared.home).values()}
        assert {"classify", "synthesize"} <= labels  # pins stay, whatever the budget
        assert not labels & {"lru-0", "lru-2", "lru-3"}
        shared.wait_log("pins alone hold")
    finally:
        settings.write_text(original)
        shared.request("warm")
        shared.request("evict", unpinned=True)


def test_touch_record_and_stats(shared):
    key = next(k for k, e in entries(shared.home).items() if e["label"] == "classify")
    with DaemonClient(shared.home) as c:
        assert c.raw("touch", dict(keys=[bytes.fromhex(key)]))["touched"] == 1
        rec = dict(model="m", label="classify", prompt_tokens=100, cached_tokens=90,
                   prefilled_tokens=10, prefill_s=0.01, decode_s=0.2)  # fmt: skip
        assert c.raw("record", dict(records=[rec, rec]))["recorded"] == 2
        with pytest.raises(DaemonError, match="prompt_tokens"):
            c.raw("record", dict(records=[{**rec, "prompt_tokens": None}]))
        stats = c.raw("stats")
    assert entries(shared.home)[key]["hits"] >= 1
    (row,) = [r for r in stats["ledger"]["by_model_label"] if r["label"] == "classify"]
    assert row["calls"] >= 2 and row["cached_ratio"] == pytest.approx(0.9)
    assert stats["daemon"]["watcher"] in ("watchdog", "polling")
    assert stats["settings"]["max_connections"] == 6


# -- bad input ---------------------------------------------------------------------------------


def _raw(home: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(str(daemon_client.socket_path(home)))
    return s


def _wait_not_busy(d: Proc) -> None:
    """Until the daemon takes a connection again (not `busy`: the slots of closed ones freed)."""

    def accepted() -> bool:
        try:
            c = connect(d.home)
        except DaemonError as e:
            assert "busy" in str(e), e
            return False
        assert c is not None, d.text()
        c.close()
        return True

    wait_for(accepted, what=d.text)


def _reply_or_close(s: socket.socket) -> dict | None:
    try:
        return protocol.recv(s, timeout=5)
    except ProtocolError:
        return None


@pytest.mark.parametrize(
    "raw",
    [
        protocol.HEADER.pack(0),
        protocol.HEADER.pack(2**32 - 1),
        protocol.HEADER.pack(100) + b"0123456789",  # truncated: then the write side closes
        protocol.HEADER.pack(4) + b"\xc1\xc1\xc1\xc1",  # not msgpack
        protocol.HEADER.pack(4) + msgpack.packb([1, 2, 3]),  # a list, not a map
    ],
    ids=["zero", "huge", "truncated", "not-msgpack", "not-a-map"],
)
def test_bad_frames_get_an_error_or_a_close_and_the_daemon_serves_on(shared, raw):
    s = _raw(shared.home)
    try:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        reply = _reply_or_close(s)
        assert reply is None or reply["ok"] is False
        assert _reply_or_close(s) is None  # and then it hangs up
    finally:
        s.close()
    assert shared.request("ping")["pid"] == shared.pid


def test_unknown_commands_and_bad_args_are_error_replies_on_a_live_connection(shared):
    s = _raw(shared.home)
    try:
        for msg, match in [
            ({"cmd": "format_disk"}, "unknown command"),
            ({"nocmd": 1}, "unknown command"),
            ({"cmd": "ls", "args": [1]}, "args must be a map"),
            ({"cmd": "evict", "args": {"keys": ["x"]}}, "32-byte keys"),
            ({"cmd": "put", "args": {"key": 5, "blob": b""}}, "must be"),
            ({"cmd": "warm", "args": {"manifest": "/nonexistent.toml"}}, "not found"),
        ]:
            protocol.send(s, msg)
            reply = protocol.recv(s, timeout=5)
            assert reply["ok"] is False and match in reply["error"], reply
        protocol.send(s, {"cmd": "ping"})
        assert protocol.recv(s, timeout=5)["result"]["pid"] == shared.pid
    finally:
        s.close()


def _hold(home, n: int) -> list | None:
    """`n` connections the daemon took (each answered a ping), or None while a slot is still
    held: the daemon frees a timed-out connection's slot just after it replies (seen in CI)."""
    held = []
    try:
        for _ in range(n):
            held.append(DaemonClient(home))
            held[-1].raw("ping")
        return held
    except DaemonError as e:
        assert "too many connections" in str(e), e
        for c in held:
            c.close()
        return None


def test_silent_connections_time_out_and_the_cap_holds(shared):
    s = _raw(shared.home)
    t = time.monotonic()
    reply = _reply_or_close(s)  # header_timeout = 1 s in this home
    assert (reply is None or "timed out" in reply["error"]) and time.monotonic() - t < 4
    s.close()
    held = wait_for(lambda: _hold(shared.home, 6), what=shared.text)
    try:
        extra = _raw(shared.home)
        reply = _reply_or_close(extra)
        extra.close()
        assert reply is not None and "too many connections" in reply["error"]
    finally:
        for c in held:
            c.close()
    _wait_not_busy(shared)  # the daemon frees the held connections' slots as it sees them close
    assert shared.request("ping")["pid"] == shared.pid


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch to another uid")
def test_another_uid_is_refused_before_anything_is_read(shared):
    sock = daemon_client.socket_path(shared.home)
    home_mode, sock_mode = shared.home.stat().st_mode & 0o777, sock.stat().st_mode & 0o777
    os.chmod(shared.home, 0o711)  # let the other user reach the socket: the uid check must hold
    os.chmod(sock, 0o666)
    try:
        pid = os.fork()
        if pid == 0:  # child: only sockets and os._exit, nothing that minds the fork
            code = 3
            try:
                os.chdir(sock.parent)  # as root: the pytest temp dirs above it are 0700
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(5)
                s.connect(sock.name)
            except OSError:
                os._exit(2)  # could not even connect: the test would prove nothing
            try:
                s.sendall(protocol.pack({"cmd": "ping"}))
                code = 0 if s.recv(1) == b"" else 1  # 0: closed without a word
            except ConnectionError:
                code = 0  # reset: closed with our frame unread
            except OSError:
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        os.chmod(shared.home, home_mode)
        os.chmod(sock, sock_mode)
    assert os.waitstatus_to_exitcode(status) == 0
    shared.wait_log("refused a connection from another user")


# -- the CLI goes through the daemon -------------------------------------------------------------


def test_cli_warm_evict_and_import_go_through_the_daemon(shared, tmp_path, llama_path):
    home = ["--home", str(shared.home)]
    r = cli("warm", "--manifest", shared.manifest, *home)
    assert r.exit_code == 0, r.output
    assert "0 warmed, 2 present" in r.output
    shared.wait_log("request warm")

    key = next(k for k, e in entries(shared.home).items() if e["label"] == "synthesize")
    with Store(shared.home, readonly=True) as store:
        ids = store.get_meta(bytes.fromhex(key)).token_ids()
    out = tmp_path / "synth.safetensors"
    assert cli("export", key, out, *home).exit_code == 0
    r = cli("evict", key[32:48], *home)  # the prefix hash part
    assert r.exit_code == 0 and "evicted 1 entry" in r.output, r.output
    shared.wait_log("evicted " + key)
    assert key not in entries(shared.home)

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(ids))
    r = cli(
        "import",
        out,
        "--model",
        llama_path,
        "--tokens",
        tokens,
        "--label",
        "synthesize",
        "--pin",
        *home,
    )
    assert r.exit_code == 0, r.output
    shared.wait_log("request put")
    assert entries(shared.home)[key]["pinned"]
    # the daemon holds no stale state: a warm now finds the pin present again
    r = cli("warm", "--manifest", shared.manifest, *home)
    assert r.exit_code == 0 and "0 warmed, 2 present" in r.output, r.output


# -- review fixes: failures are logged, puts are checked, to_size=0, busy, repair, shutdown ----


_BROKEN_WARM = """
import sys
import kvstore.ops.warm as warm_ops
def broken(manifest, *args, **kwargs):
    raise RuntimeError("the warm broke")
warm_ops.warm = broken
from kvstore.cli.main import main
main(["daemon", *sys.argv[1:]])
"""


def test_a_failing_boot_reconcile_is_logged_and_the_daemon_serves_on(tmp_path, llama_path):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    d = Proc(tmp_path / "h", "--manifest", str(manifest), log=tmp_path / "d.log",
             code=_BROKEN_WARM)  # fmt: skip
    try:
        d.wait_ready()
        d.wait_log(f"reconcile: warming {manifest} failed")
        line = next(x for x in d.text().splitlines() if "reconcile: warming" in x)
        assert " ERROR " in line, d.text()
        assert "RuntimeError: the warm broke" in d.text()  # with its traceback
        assert d.request("ping")["pid"] == d.pid
        assert d.request("ls") == []
        # a reload nobody waits on fails the same way, and is logged again
        d.request("warm")
        assert d.text().count(f"reconcile: warming {manifest} failed") >= 2
    finally:
        rc, _ = d.stop()
    assert rc == 0, d.text()


def test_writer_logs_a_failed_job_nobody_waits_on(caplog):
    import threading

    from kvstore.daemon.writer import Writer

    w, stopping = Writer(), threading.Event()

    def boom():
        raise RuntimeError("job broke")

    def stop():
        stopping.set()

    unwaited = w.submit("unwaited", boom)
    waited = w.submit("waited", boom, reported=True)
    w.submit("stop", stop)
    with caplog.at_level("ERROR", logger="kvstore.daemon"):
        w.run(stopping)
    with pytest.raises(RuntimeError, match="job broke"):  # the future still has it
        unwaited.result(0)
    with pytest.raises(RuntimeError):
        waited.result(0)
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == ["writer: job unwaited failed"]
    assert errors[0].exc_info is not None


def test_reconcile_logs_a_failing_manifest_and_warms_the_next(tmp_path, llama_path, monkeypatch,
                                                               caplog):  # fmt: skip
    import threading

    import kvstore.daemon.upkeep as upkeep_mod
    from kvstore.warm.warm import WarmReport

    bad = manifest_for(tmp_path, llama_path, TWO_PINS, name="bad.toml")
    good = manifest_for(tmp_path, llama_path, TWO_PINS, name="good.toml")
    warmed = []

    def fake_warm(manifest, store, **kwargs):
        if manifest.path == bad:
            raise OSError("disk on fire")
        warmed.append(manifest.path)
        return WarmReport()

    monkeypatch.setattr(upkeep_mod.warm_ops, "warm", fake_warm)
    home = tmp_path / "home"
    home.mkdir()
    with Store(home) as store:
        up = upkeep_mod.Upkeep(store, home, {"max_bytes": 2**30}, threading.Event())
        with caplog.at_level("ERROR", logger="kvstore.daemon"):
            reports = up.reconcile([bad, good], cause="test")
    assert warmed == [good] and len(reports) == 1
    (rec,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert str(bad) in rec.getMessage() and rec.exc_info is not None


def test_put_whose_kv_does_not_cover_its_tokens_is_refused(shared, make_entry):
    for n, held in ((39, "holds 40 tokens"), (41, "holds 40 tokens")):
        key, blob, fields = make_entry(f"cover-{n}", list(range(7, 7 + n)))  # a 40-token blob
        with DaemonClient(shared.home) as c, pytest.raises(DaemonError, match=held):
            put_ops.send(c, key, blob, fields)
    labels = {e["label"] for e in entries(shared.home).values()}
    assert not labels & {"cover-39", "cover-41"}


@pytest.mark.parametrize(
    "field, value",
    [
        ("label", 5),
        ("model", b"/models/x"),
        ("pinned", 1),
        ("template_hash", "abcd"),
        ("classes", "KVCache"),
        ("classes", ["KVCache", 3]),
        ("extra", [1, 2]),
        ("extra", {1: "int key"}),
        ("extra", {"nested": {2: "int key"}}),
        ("extra", {"ext": msgpack.ExtType(5, b"x")}),
        ("hits", 1000),
    ],
)
def test_put_with_a_badly_typed_field_is_refused_naming_it(shared, make_entry, field, value):
    key, blob, fields = make_entry("typed")
    with DaemonClient(shared.home) as c:
        with pytest.raises(DaemonError, match=f"field '{field}'"):
            put_ops.send(c, key, blob, {**fields, field: value})
        assert c.raw("ping")["pid"] == shared.pid
    assert "typed" not in {e["label"] for e in entries(shared.home).values()}


def test_evict_to_size_zero_evicts_every_unpinned_entry(shared, make_entry):
    with DaemonClient(shared.home) as c:
        for i in range(2):
            put_ops.send(c, *make_entry(f"zero-{i}", [600 + i] * 40))
        res = c.raw("evict", dict(to_size=0))
    assert res["evicted"] == 2
    left = entries(shared.home).values()
    assert {e["label"] for e in left} == {"classify", "synthesize"} and all(
        e["pinned"] for e in left
    )
    with DaemonClient(shared.home) as c:
        put_ops.send(c, *make_entry("zero-cli", [650] * 40))
    r = cli("evict", "--to-size", "0", "--home", shared.home)
    assert r.exit_code == 0 and "evicted 1 entry" in r.output, r.output


def test_receive_stream_fills_one_buffer():
    from kvstore.daemon.connection import Connection

    a, b = socket.socketpair()
    try:
        conn = Connection(a, {"max_frame_bytes": 2**20, "header_timeout": 2.0,
                              "idle_timeout": 2.0})  # fmt: skip
        for part in (b"abc", b"defg", b"h"):
            protocol.send(b, {"data": part})
        got = conn.receive_stream(8)
        assert isinstance(got, bytearray) and got == b"abcdefgh"
        protocol.send(b, {"data": b"12345"})
        with pytest.raises(ProtocolError, match="next `data` bytes"):
            conn.receive_stream(4)  # more than announced
    finally:
        a.close()
        b.close()


def test_a_busy_daemon_is_an_error_not_no_daemon(shared):
    held = [DaemonClient(shared.home) for _ in range(6)]  # max_connections = 6 in this home
    try:
        for c in held:
            c.raw("ping")
        with pytest.raises(DaemonError, match="is busy \\(too many connections\\); try again"):
            connect(shared.home)
        # the CLI refuses rather than writing the store beside the daemon
        r = cli("evict", "--all", "--home", shared.home)
        assert r.exit_code == 1 and "busy" in r.output, r.output
    finally:
        for c in held:
            c.close()
    _wait_not_busy(shared)
    assert {"classify", "synthesize"} <= {e["label"] for e in entries(shared.home).values()}
    c = connect(shared.home)
    assert c is not None
    c.close()


def test_verify_repair_goes_through_the_daemon(shared):
    from kvstore.store.entry import entry_key, pack_tokens

    key = entry_key(bytes([0xCD]) * 16, [1, 2])
    with Store(shared.home) as store:  # damage made behind the daemon's back
        store.put(key, b"\x00" * 100, tokens=pack_tokens([1, 2]), label="garbage")
    home = ["--home", str(shared.home)]
    r = cli("verify", *home)  # a plain verify reads directly
    assert r.exit_code == 1 and f"bad entry {key.hex()}" in r.output, r.output
    assert "request repair" not in shared.text()
    r = cli("verify", "--repair", *home)
    assert r.exit_code == 1 and f"bad entry {key.hex()}" in r.output, r.output
    assert "(deleted)" in r.output
    shared.wait_log("request repair")
    shared.wait_log(f"repair: deleted entry {key.hex()}")
    assert key.hex() not in entries(shared.home)
    r = cli("verify", "--repair", *home)
    assert r.exit_code == 0 and "entries ok" in r.output, r.output


_SLOW_LS = """
import sys, time
from kvstore.daemon.commands import Commands
from kvstore.wire.messages import LsReply
def slow_ls(self, req, conn):
    self.store._read(lambda txn: print("inside the read", flush=True) or time.sleep(30))
    return LsReply()
Commands.cmd_ls = slow_ls
from kvstore.cli.main import main
main(["daemon", *sys.argv[1:]])
"""


def test_shutdown_never_closes_the_store_under_a_busy_connection(tmp_path):
    d = Proc(tmp_path / "h", log=tmp_path / "d.log", code=_SLOW_LS)
    d.wait_ready()
    s = _raw(d.home)
    try:
        protocol.send(s, {"cmd": "ls"})
        d.wait_log("inside the read")  # the connection thread is stuck inside a read
        rc, seconds = d.stop(signal.SIGTERM)
    finally:
        s.close()
    assert rc == 0 and seconds < 5, d.text()
    assert "1 connection thread still busy" in d.text()
    assert "stopped" in d.text()
