"""The fleet tier fails local-only, against a real SeaweedFS server: a server killed mid-upload,
wrong or missing credentials, an unreachable or silent endpoint, untrusted TLS, corrupt objects."""

from __future__ import annotations

import signal
import socket
import struct
import time
from pathlib import Path
from unittest import mock

import pytest
from fleet_boxes import (
    ADMIN_KEY,
    ADMIN_SECRET,
    BUCKET,
    Weed,
    big_entry,
    box,
    queue_counts,
    remote_of,
)
from helpers import TWO_PINS, Proc, cli, manifest_for, serving, wait_for

from kvstore.errors import RemoteError
from kvstore.fleet.fetch import WarmFetcher
from kvstore.fleet.objects import Remote, blob_end, object_name, verify_object
from kvstore.fleet.queue import Uploader, UploadQueue, upload_one
from kvstore.fleet.remote_settings import RemoteSettings, remote_settings
from kvstore.home.settings import load_settings
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store

# the server fixtures (weed, s3) come from this plugin: one session server for both fleet files
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("environments_closed")]


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
            assert queue.counts() == {
                "queued": 0,
                "uploaded": 2,
                "records_queued": 0,
                "records_uploaded": 0,
            }
            names = [o["Key"] for o in server.client().list_objects_v2(Bucket=BUCKET)["Contents"]]
            assert sorted(names) == sorted(object_name(rs, k) for k in keys)  # once each
            for k in keys:
                data, _ = Remote(rs).fetch(k)
                assert verify_object(k, data, unsigned=True)[1] == store.read_blob(
                    k
                )  # nothing lost
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
    data[blob_end(data) - 100] ^= 0xFF  # one flipped bit of KV
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


def test_local_puts_never_wait_on_a_silent_remote(tmp_path):
    import socket

    from kvstore.fleet.queue import start_uploader

    silent = socket.socket()  # accepts connections (the backlog) and never answers a byte
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    try:
        home = tmp_path / "a"
        home.mkdir(mode=0o700)
        rs = RemoteSettings(f"http://127.0.0.1:{port}", BUCKET, read_timeout=5.0,
                            access_key_id="k", secret_access_key="s")  # fmt: skip
        with Store(home) as store:
            worker = start_uploader(Remote(rs), store, home)
            held = []
            try:
                big_entry(store, b"\1" * 16, 16, seed=1)
                wait_for(lambda: worker.queue.pending() and worker.is_alive(), what="a queued key")
                silent.settimeout(60)
                held.append(silent.accept()[0])  # the worker is inside its request to it now
                t = time.perf_counter()
                key = big_entry(store, b"\1" * 16, 16, seed=2)
                assert time.perf_counter() - t < 2.0  # committed and queued, not uploaded (5 s)
                assert key in worker.queue.pending() and store.get_meta(key) is not None
                assert not worker.stop(timeout=0.1)  # still in flight: the daemon says so
            finally:
                silent.close()
                for conn in held:
                    conn.close()  # the request ends at once rather than at its read timeout
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
        assert queue_counts(home) == {
            "queued": 2,
            "uploaded": 0,
            "records_queued": 0,
            "records_uploaded": 0,
        }
        server.start()
        with serving(Proc(home, "--manifest", manifest, log=tmp_path / "d2.log")) as d:
            assert d.wait_warm()["present"] == 2
            wait_for(lambda: len(list(remote_of(home).objects())) == 2, what="the queue")
        assert queue_counts(home) == {
            "queued": 0,
            "uploaded": 2,
            "records_queued": 0,
            "records_uploaded": 0,
        }
    finally:
        server.stop(signal.SIGKILL)


def test_a_weed_whose_port_was_taken_before_it_bound_picks_again(tmp_path):
    # Seen when two suites ran at once: bench.weed picks free ports, another process binds one
    # before weed does, and weed exits ("port ... is not available"). The harness picks again.
    server = Weed(tmp_path / "weed")
    taken = server.ports["s3"]
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", taken))
        blocker.listen()
        server.start()
        try:
            assert server.ports["s3"] != taken
            assert server.client().head_bucket(Bucket=BUCKET)
        finally:
            server.stop(signal.SIGKILL)
