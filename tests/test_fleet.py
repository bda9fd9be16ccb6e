"""The fleet tier against a real SeaweedFS server: two homes on this machine stand for two boxes."""

# ruff: noqa: F811 (the server fixtures are imported from fleet_fixtures, then requested by name)

from __future__ import annotations

import json
import signal
import struct
import threading
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx
import pytest
from click.testing import CliRunner
from fleet_fixtures import ADMIN_KEY, ADMIN_SECRET, BUCKET, Weed, box, s3, weed  # noqa: F401
from helpers import TWO_PINS, Proc, assert_same_kv, manifest_for, serving

from bench.weed import OTHER_BUCKET
from kvstore import codec
from kvstore.cli import main
from kvstore.errors import RemoteError
from kvstore.keys import entry_key, pack_tokens
from kvstore.ledger import Ledger
from kvstore.manifest import load_manifest
from kvstore.remote import Remote, object_name, verify_object
from kvstore.remote_fetch import WarmFetcher, choose
from kvstore.remote_queue import Uploader, UploadQueue, upload_one
from kvstore.remote_settings import RemoteSettings, RemoteSettingsError, remote_settings
from kvstore.settings import load_settings
from kvstore.store import Store
from kvstore.warm import warm

pytestmark = pytest.mark.slow


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def remote_of(home: Path) -> Remote:
    return Remote(remote_settings(load_settings(home), home))


def queue_counts(home: Path) -> dict:
    q = UploadQueue(home)
    try:
        return q.counts()
    finally:
        q.close()


@pytest.fixture(autouse=True)
def no_environment_left_open():
    """An environment left open would be shared by a forked child (test_reliability_crash)."""
    from kvstore.lmdbenv import ENVS

    before = set(ENVS)
    yield
    assert set(ENVS) <= before, f"LMDB environments left open: {sorted(set(ENVS) - before)}"


def wait_for(cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def big_entry(store: Store, fp: bytes, tokens: int, seed: int = 0) -> bytes:
    """A real KVCache of `tokens` tokens (8 heads x 128, float16: 4 KiB a token), stored."""
    from mlx_lm.models.cache import KVCache

    mx.random.seed(seed)
    c = KVCache()
    kv = [mx.random.normal((1, 8, tokens, 128)).astype(mx.float16) for _ in range(2)]
    c.update_and_fetch(*kv)
    mx.eval(c.keys, c.values)
    ids = [(seed * 7919 + i) % 30000 for i in range(tokens)]
    key = entry_key(fp, ids)
    blob = codec.encode([c], {})
    store.put(key, blob, tokens=pack_tokens(ids), label=f"big{seed}", model="m",
              classes=codec.cache_classes([c]))  # fmt: skip
    return key


# -- box A warms, box B warms from the remote -------------------------------------------------


def test_box_b_warms_from_the_remote_with_no_prefill(s3, llama_path, tmp_path):
    a, b = box(tmp_path / "a", s3), box(tmp_path / "b", s3)
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    with serving(Proc(a, "--manifest", str(manifest), log=tmp_path / "a.log")) as d:
        assert d.wait_warm()["warmed"] == 2
        wait_for(lambda: len(list(remote_of(a).objects())) == 2, what="box A's uploads")
        d.wait_log("remote: entry")
        assert "pin 'classify' of" in d.text() and ": prefilled" in d.text()
    with serving(Proc(b, "--manifest", str(manifest), log=tmp_path / "b.log")) as d:
        w = d.wait_warm()
        assert (w["warmed"], w["fetched"], w["models_loaded"]) == (0, 2, 0), d.text()
        assert f"warm: pin 'classify' of {llama_path}: fetched" in d.text()
    assert "loading" not in (tmp_path / "b.log").read_text()  # the model never loaded on B
    with Store(a, readonly=True) as sa, Store(b, readonly=True) as sb:
        keys = sa.keys()
        assert sorted(keys) == sorted(sb.keys())
        for k in keys:
            assert sa.read_blob(k) == sb.read_blob(k)
            assert_same_kv(sa.load(k)[1], sb.load(k)[1])
        assert sb.check() == []
    from mlx_lm.server import LRUPromptCache

    from client.hydrate import hydrate

    lru = LRUPromptCache()  # an app on box B hydrates what came from A, and gets A's KV
    assert hydrate(lru, "m", llama_path, home=b).entries == 2
    with Store(a, readonly=True) as sa:
        for m in sa.metas():
            cache, rest = lru.fetch_nearest_cache("m", m.token_ids())
            assert rest == []
            assert_same_kv(cache, sa.load(m.key)[1])


def test_cli_warm_push_pull_and_status(s3, llama_path, tmp_path):
    a, b, c = (box(tmp_path / n, s3) for n in "abc")
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    r = cli("warm", "--manifest", manifest, "--home", str(a))
    assert "2 warmed" in r.output and "prefilled" in r.output  # no pin was on the remote
    status = json.loads(cli("remote", "status", "--json", "--home", str(a)).output)
    assert status["reachable"] and status["objects"] == 0 and status["queue"]["queued"] == 2
    assert status["settings"]["secret_access_key"] == "(set)"
    r = cli("remote", "push", "--home", str(a))
    assert r.exit_code == 0 and "2 uploaded, 0 already there" in r.output
    assert "1 uploaded" not in cli("remote", "push", "--home", str(a)).output  # idempotent
    rows = json.loads(cli("remote", "ls", "--json", "--home", str(a)).output)
    assert len(rows) == 2 and all(r["local"] for r in rows)
    r = cli("remote", "pull", "--manifest", manifest, "--home", str(b))
    assert r.exit_code == 0 and "2 fetched, 0 not on the remote, 0 failed" in r.output
    assert "0 warmed, 2 present" in cli("warm", "--manifest", manifest, "--home", str(b)).output
    with mock.patch("kvstore.warm.load_model", side_effect=AssertionError("model loaded")):
        r = cli("warm", "--manifest", manifest, "--home", str(c))
    assert r.exit_code == 0 and "0 warmed, 0 present, 0 failed, 2 fetched" in r.output, r.output
    assert r.output.count("fetched ") >= 2
    with Store(a, readonly=True) as sa, Store(c, readonly=True) as sc:
        assert all(sa.read_blob(k) == sc.read_blob(k) for k in sa.keys())
    d = box(tmp_path / "d", s3)  # with a daemon running, pull stores through it (the one writer)
    with serving(Proc(d, log=tmp_path / "d.log"), warm=False) as daemon:
        r = cli("remote", "pull", "--manifest", manifest, "--home", str(d))
        assert r.exit_code == 0 and "2 fetched" in r.output, r.output
        assert daemon.text().count("request put") == 2
    with Store(a, readonly=True) as sa, Store(d, readonly=True) as sd:
        assert sorted(sd.keys()) == sorted(sa.keys()) and sd.check() == []


# -- failures stay local ----------------------------------------------------------------------


def test_server_killed_mid_upload_then_restarted(tmp_path, llama_path):
    server = Weed(tmp_path / "weed").start()
    try:
        home = box(tmp_path / "a", server, part_size=5 * 2**20, multipart_threshold=5 * 2**20)
        with Store(home) as store:
            # 5.5 MiB: two parts of a multipart upload; and a small one that goes up in one piece
            keys = [big_entry(store, b"\1" * 16, n, seed=n) for n in (1400, 16)]
            rs = remote_settings(load_settings(home), home)
            queue = UploadQueue(home)
            queue.add(keys)
            real, parts = Store.read_blob_range, []

            def kill_after_first_part(self, key, offset, size):
                if key == keys[0]:
                    parts.append(offset)
                    if offset > 0:  # the first part is up: the server dies under the second
                        server.kill()
                return real(self, key, offset, size)

            worker = Uploader(Remote(rs), store, queue)
            with mock.patch.object(Store, "read_blob_range", kill_after_first_part):
                worker.start()
                wait_for(lambda: server.proc is None and worker._cause == "unreachable",
                         what="the upload to fail")  # fmt: skip
            assert worker.stop()
            assert keys[0] in queue.pending() and len(parts) == 2  # kept for later
            queue.close()
            server.start()  # same data and ports
            queue = UploadQueue(home)  # a restarted daemon: the queue is on disk
            worker = Uploader(Remote(rs), store, queue)
            worker.start()
            wait_for(lambda: not queue.pending(), what="the queue to drain")
            assert worker.stop()
            assert queue.counts() == {"queued": 0, "uploaded": 2}
            names = [o["Key"] for o in server.client().list_objects_v2(Bucket=BUCKET)["Contents"]]
            assert sorted(names) == sorted(object_name(rs, k) for k in keys)  # once each
            for k in keys:
                data, _ = Remote(rs).fetch(k)
                assert verify_object(k, data)[1] == store.read_blob(k)  # nothing lost
            assert upload_one(Remote(rs), store, queue, keys[0]) == "exists"
            queue.close()
    finally:
        server.stop(signal.SIGKILL)  # its data is this test's: no need to wait for a drain


def test_wrong_secret_is_one_line_and_local_warm_goes_on(s3, llama_path, tmp_path, caplog):
    home = box(tmp_path / "a", s3, secret="not-the-secret")
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    with Store(home) as store:
        q = UploadQueue(home)
        fetcher = WarmFetcher(remote_of(home), q)
        report = warm(load_manifest(manifest), store, home=home, fetch=fetcher)
        assert [p.status for p in report.pins] == ["warmed", "warmed"]  # prefilled locally
        assert report.pins[0].remote == "remote failed (credentials)"
        assert report.pins[1].remote == "remote unavailable (credentials)"
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and "credentials refused" in errors[0], errors
        assert "not-the-secret" not in caplog.text
        q.add(store.keys())
        with pytest.raises(RemoteError) as e:
            upload_one(fetcher.remote, store, q, store.keys()[0])
        assert e.value.cause == "credentials"
        assert len(q.pending()) == 2 and store.check() == []
        q.close()
    r = cli("remote", "push", "--home", str(home))
    assert (
        r.exit_code == 1 and "credentials refused" in r.output and "not-the-secret" not in r.output
    )


def test_unreachable_remote_and_missing_bucket(s3, llama_path, tmp_path):
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    down = box(tmp_path / "down", s3, endpoint="http://127.0.0.1:9", bucket="kvstore")
    r = cli("warm", "--manifest", manifest, "--home", str(down))
    assert r.exit_code == 0 and "2 warmed" in r.output and "remote failed (unreachable)" in r.output
    # with a key that may see every bucket (a bucket-scoped key is refused with 403 instead)
    nob = box(tmp_path / "nob", s3, key=ADMIN_KEY, secret=ADMIN_SECRET, bucket="no-such-bucket")
    r = cli("remote", "status", "--home", str(nob))
    assert "reachable      no" in r.output and "no such bucket" in r.output
    cli("warm", "--manifest", manifest, "--home", str(nob))
    r = cli("remote", "push", "--home", str(nob))
    assert r.exit_code == 1 and "no such bucket" in r.output


def test_a_corrupt_object_is_never_stored(s3, llama_path, tmp_path, caplog):
    a, b = box(tmp_path / "a", s3), box(tmp_path / "b", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    cli("warm", "--manifest", manifest, "--home", str(a))
    cli("remote", "push", "--home", str(a))
    rs = remote_settings(load_settings(a), a)
    with Store(a, readonly=True) as sa:
        metas = {m.label: m for m in sa.metas()}
    client = s3.client()
    name = object_name(rs, metas["classify"].key)
    data = bytearray(client.get_object(Bucket=BUCKET, Key=name)["Body"].read())
    data[-100] ^= 0xFF  # one flipped bit of KV
    client.put_object(Bucket=BUCKET, Key=name, Body=bytes(data))
    other = object_name(rs, metas["synthesize"].key)
    data = bytearray(client.get_object(Bucket=BUCKET, Key=other)["Body"].read())
    struct.pack_into("<H", data, 4, 2)  # a future format version's object under our key
    client.put_object(Bucket=BUCKET, Key=other, Body=bytes(data))
    with Store(b) as sb:
        q = UploadQueue(b)
        report = warm(load_manifest(manifest), sb, home=b, fetch=WarmFetcher(remote_of(b), q))
        q.close()
        assert {p.name: (p.status, p.remote) for p in report.pins} == {
            "classify": ("warmed", "remote failed (corrupt)"),
            "synthesize": ("warmed", "remote failed (version)"),
        }
        assert "blob checksum mismatch" in caplog.text and "format version 2" in caplog.text
        with Store(a, readonly=True) as sa:  # B holds its own prefill, A's: never the bad bytes
            assert all(sb.read_blob(m.key) == sa.read_blob(m.key) for m in metas.values())
        assert sb.check() == []


def test_two_daemons_racing_on_one_key_end_with_one_object(s3, llama_path, tmp_path):
    a, b = box(tmp_path / "a", s3), box(tmp_path / "b", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    for h in (a, b):
        cli("warm", "--manifest", manifest, "--home", str(h))
    outcomes, gate = [], threading.Barrier(2)

    def upload(home: Path) -> None:
        with Store(home, readonly=True) as store:
            meta = [m for m in store.metas() if m.label == "classify"][0]

            def read(offset, size):  # both have seen "absent" before either creates
                gate.wait(timeout=10)
                return store.read_blob_range(meta.key, offset, size)

            outcomes.append(remote_of(home).upload(meta, read))

    threads = [threading.Thread(target=upload, args=(h,)) for h in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["exists", "uploaded"]
    assert len(s3.client().list_objects_v2(Bucket=BUCKET)["Contents"]) == 1


def test_the_janitor(s3, tmp_path):
    home = box(tmp_path / "a", s3, max_bytes=2**20)
    with Store(home) as store:
        old = [big_entry(store, b"\1" * 16, 32, seed=s) for s in range(2)]  # 128 KiB each
        time.sleep(1.1)  # object times have a second's resolution
        new = [big_entry(store, b"\2" * 16, 32, seed=s) for s in range(2, 4)]
    rs = remote_settings(load_settings(home), home)
    assert "4 uploaded" in cli("remote", "push", "--home", str(home)).output
    r = cli("remote", "gc", "--older-than", "1h", "--home", str(home))
    assert "0 objects deleted" in r.output  # all fresh, and within max_bytes
    r = cli("remote", "gc", "--model", (b"\1" * 16).hex(), "--dry-run", "--home", str(home))
    assert r.output.count("would delete") == 2
    assert len(list(Remote(rs).objects())) == 4
    box(home, s3, max_bytes=300 * 2**10)  # room for two: the oldest go first
    r = cli("remote", "gc", "--home", str(home))
    assert "2 objects deleted" in r.output
    assert sorted(o.key for o in Remote(rs).objects()) == sorted(new)
    cli("remote", "gc", "--model", (b"\2" * 16).hex(), "--home", str(home))
    assert list(Remote(rs).objects()) == []
    r = cli("remote", "push", "--model", "m", "--home", str(home))  # gc forgot them: up again
    assert "4 uploaded" in r.output
    assert len(old) == 2


# -- the cost rule ----------------------------------------------------------------------------


def test_cost_rule():
    kw = dict(nbytes=10 * 2**20, tokens=1000, deadline=30.0)
    assert choose(prefill_tps=100.0, fetch_bps=100 * 2**20, **kw).fetch  # 0.1s vs 10s
    slow = choose(prefill_tps=10_000.0, fetch_bps=2**20, **kw)  # 10s vs 0.1s
    assert not slow.fetch and "remote slower" in slow.reason
    assert choose(prefill_tps=None, fetch_bps=2**20, **kw).fetch  # never measured: fetch
    assert choose(prefill_tps=10.0, fetch_bps=None, **kw).fetch
    late = choose(prefill_tps=1.0, fetch_bps=2**10, **kw)  # 10240s: past the deadline
    assert not late.fetch and "fetch_deadline" in late.reason


def test_a_slower_remote_is_not_used(s3, llama_path, tmp_path):
    a, b = box(tmp_path / "a", s3), box(tmp_path / "b", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    cli("warm", "--manifest", manifest, "--home", str(a))
    cli("remote", "push", "--home", str(a))
    ledger = Ledger(b)  # B measured a fast prefill for this model; its link to the remote is slow
    fast = dict(prompt_tokens=10**6, cached_tokens=0, prefilled_tokens=10**6, prefill_s=1.0)
    ledger.append([dict(model=str(llama_path), label="classify", decode_s=0.0, **fast)])
    q = UploadQueue(b)
    q.measured("fetch_bps", 1e5)  # ~1 s for a pin B prefills in well under a millisecond
    with Store(b) as sb:
        fetcher = WarmFetcher(remote_of(b), q, ledger=Ledger(b))
        report = warm(load_manifest(manifest), sb, home=b, fetch=fetcher)
    assert report.models_loaded == 1 and [p.status for p in report.pins] == ["warmed"] * 2
    assert all(p.remote.startswith("remote slower") for p in report.pins)
    q.measured("fetch_bps", 1e12)  # now the remote is fast: it is used
    q.measured("fetch_bps", 1e12)
    with Store(b) as sb:
        sb.delete(sb.keys())
        report = warm(
            load_manifest(manifest),
            sb,
            home=b,
            fetch=WarmFetcher(remote_of(b), q, ledger=Ledger(b)),
        )
    assert report.models_loaded == 0 and report.fetched == 2
    q.close()
    with pytest.raises(RemoteError) as e:  # a transfer running past fetch_deadline is dropped
        remote_of(b).fetch(bytes.fromhex(report.pins[0].key), deadline=0.0)
    assert e.value.cause == "slow" and "fetch_deadline" in str(e.value)


# -- settings ---------------------------------------------------------------------------------


def test_settings_refuse_readable_credentials_and_never_show_the_secret(s3, tmp_path):
    home = box(tmp_path / "a", s3)
    (home / "s3.toml").chmod(0o644)
    with pytest.raises(RemoteSettingsError, match="chmod 600"):
        remote_settings(load_settings(home), home)
    r = cli("remote", "status", "--home", str(home))
    assert r.exit_code == 1 and "lets others read" in r.output
    (home / "s3.toml").chmod(0o600)
    out = (
        cli("stats", "--home", str(home)).output
        + cli("remote", "status", "--home", str(home)).output
    )
    assert "remote" in out and s3.endpoint in out
    from fleet_fixtures import SECRET_KEY

    assert SECRET_KEY not in out
    assert SECRET_KEY not in repr(remote_settings(load_settings(home), home))
    (home / "settings.toml").write_text(
        '[remote]\nendpoint = "http://x"\nbucket = "b"\nbogus = 1\n'
    )
    with pytest.raises(RemoteSettingsError, match="unknown \\[remote\\] setting"):
        remote_settings(load_settings(home), home)
    assert RemoteSettings("http://x", "b").shown()["secret_access_key"] is None


def test_a_key_scoped_to_the_bucket_works_there_and_nowhere_else(s3, llama_path, tmp_path):
    # the boxes' key (bench.weed) holds Read/Write/List on the kvstore bucket only
    ok = box(tmp_path / "ok", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    cli("warm", "--manifest", manifest, "--home", str(ok))
    assert "2 uploaded" in cli("remote", "push", "--home", str(ok)).output
    elsewhere = box(tmp_path / "elsewhere", s3, bucket=OTHER_BUCKET)
    cli("warm", "--manifest", manifest, "--home", str(elsewhere))
    r = cli("remote", "push", "--home", str(elsewhere))
    assert r.exit_code == 1 and "credentials refused" in r.output


def test_local_puts_never_wait_on_a_silent_remote(tmp_path):
    import socket

    from kvstore.remote_queue import start_uploader

    silent = socket.socket()  # accepts connections (the backlog) and never answers a byte
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    try:
        home = tmp_path / "a"
        home.mkdir(mode=0o700)
        rs = RemoteSettings(f"http://127.0.0.1:{port}", BUCKET, read_timeout=1.0,
                            access_key_id="k", secret_access_key="s")  # fmt: skip
        with Store(home) as store:
            worker = start_uploader(Remote(rs), store, home)
            try:
                big_entry(store, b"\1" * 16, 16, seed=1)
                wait_for(lambda: worker.queue.pending() and worker.is_alive(), what="a queued key")
                time.sleep(0.2)  # the worker is now inside its request to the silent remote
                t = time.perf_counter()
                key = big_entry(store, b"\1" * 16, 16, seed=2)
                assert time.perf_counter() - t < 0.5  # committed and queued, not uploaded
                assert key in worker.queue.pending() and store.get_meta(key) is not None
                assert not worker.stop(timeout=0.1)  # still in flight: the daemon says so
            finally:
                silent.close()
                worker.stop(timeout=10)
            assert not worker.is_alive() and len(worker.queue.pending()) == 2  # kept
            worker.queue.close()
    finally:
        silent.close()


def make_tls(d: Path) -> tuple[Path, Path, Path]:
    """A private CA and a certificate it signed for 127.0.0.1 (openssl, as a LAN would)."""
    import subprocess

    d.mkdir()

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
         "-days", "2", "-subj", "/CN=kvstore test CA")  # fmt: skip
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=127.0.0.1")  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    ossl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")  # fmt: skip
    return d / "server.pem", d / "server.key", d / "ca.pem"


def test_tls_with_a_private_ca(tmp_path, llama_path):
    tls = make_tls(tmp_path / "tls")
    server = Weed(tmp_path / "weed", tls=tls).start()
    try:
        assert server.endpoint.startswith("https://")
        manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
        home = box(tmp_path / "a", server, ca_bundle=str(tls[2]))
        cli("warm", "--manifest", manifest, "--home", str(home))
        assert "2 uploaded" in cli("remote", "push", "--home", str(home)).output
        untrusting = box(tmp_path / "b", server)  # no ca_bundle: the system store lacks our CA
        r = cli("remote", "pull", "--manifest", manifest, "--home", str(untrusting))
        assert r.exit_code == 1 and "set [remote] ca_bundle" in r.output
    finally:
        server.stop(signal.SIGKILL)


def test_a_daemon_keeps_its_queue_while_the_remote_is_down_and_resumes_after_restart(
    tmp_path, llama_path
):
    server = Weed(tmp_path / "weed").start()
    server.kill()  # its ports are known; nothing answers there now
    try:
        home = box(tmp_path / "a", server)
        manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
        with serving(Proc(home, "--manifest", manifest, log=tmp_path / "d1.log")) as d:
            w = d.wait_warm()
            assert (w["warmed"], w["failed"]) == (2, 0)  # the local warm is unaffected
            d.wait_log("remote: upload paused")
        text = (tmp_path / "d1.log").read_text()
        assert text.count("upload paused") == 1  # one line per cause, not one per retry
        assert queue_counts(home) == {"queued": 2, "uploaded": 0}
        server.start()
        with serving(Proc(home, "--manifest", manifest, log=tmp_path / "d2.log")) as d:
            assert d.wait_warm()["present"] == 2
            wait_for(lambda: len(list(remote_of(home).objects())) == 2, what="the queue")
        assert queue_counts(home) == {"queued": 0, "uploaded": 2}
    finally:
        server.stop(signal.SIGKILL)


def test_without_boto3_a_warm_is_local_and_says_why(s3, llama_path, tmp_path):
    import sys

    home = box(tmp_path / "a", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    with mock.patch.dict(sys.modules, {"boto3": None}):  # as on a box without the fleet extra
        r = CliRunner().invoke(main, ["warm", "--manifest", manifest, "--home", str(home)])
    assert r.exit_code == 0 and "2 warmed" in r.output
    assert "needs boto3: pip install 'kvstore[fleet]'" in r.output
