"""The fleet tier against a real SeaweedFS server: two homes on this machine stand for two boxes."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx
import pytest
from fleet_boxes import (
    BUCKET,
    big_entry,
    box,
    remote_of,
)
from helpers import TWO_PINS, Proc, assert_same_kv, cli, manifest_for, serving, wait_for
from mlx_lm import load

from bench.weed import OTHER_BUCKET
from kvstore.codec import codec
from kvstore.errors import RemoteError
from kvstore.fleet.fetch import WarmFetcher, choose
from kvstore.fleet.objects import Remote
from kvstore.fleet.queue import UploadQueue
from kvstore.fleet.remote_settings import RemoteSettings, RemoteSettingsError, remote_settings
from kvstore.home.ledger import Ledger
from kvstore.home.settings import load_settings
from kvstore.identity.fingerprint import model_fingerprint, with_model_location
from kvstore.kvcheck.prefill import prefill
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.pins.ownership import APP, owners
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store

# the server fixtures (weed, s3) come from this plugin: one session server for both fleet files
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("environments_closed")]


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
    from mlx_lm import load
    from mlx_lm.server import LRUPromptCache

    from kvstore.client.hydrate import hydrate

    lru = LRUPromptCache()  # an app on box B hydrates what came from A, and gets A's KV
    model, _ = load(str(llama_path))  # checked with it first: it came from another box
    assert hydrate(lru, "m", llama_path, home=b, model=model).entries == 2
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
    with mock.patch("kvstore.warm.warm.load_model", side_effect=AssertionError("model loaded")):
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
    from fleet_boxes import SECRET_KEY

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


def test_without_boto3_a_warm_is_local_and_says_why(s3, llama_path, tmp_path):
    import sys

    home = box(tmp_path / "a", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    with mock.patch.dict(sys.modules, {"boto3": None}):  # as on a box without the fleet extra
        r = cli("warm", "--manifest", manifest, "--home", home)
    assert r.exit_code == 0 and "2 warmed" in r.output
    assert "needs boto3: pip install 'mlx-kvstore[fleet]'" in r.output


# Where features met: found in the review of issues 9-13, each failed before its fix.


@pytest.mark.slow
def test_pulled_runtime_entry_records_this_boxs_model_dir_not_the_other_boxs(
    s3, llama_path, tmp_path
):
    """`kvstore remote pull` of an entry another box stored (not one of this box's manifest pins)
    used to keep that box's extra: its model_dir (so `evict --stale` here judged the entry by the
    other box's path, and deleted it once that path was gone) and its manifest owners."""
    a_model = shutil.copytree(llama_path, tmp_path / "box_a" / "models" / "llama")
    b_model = shutil.copytree(llama_path, tmp_path / "box_b" / "models" / "llama")
    a, b = box(tmp_path / "a", s3), box(tmp_path / "b", s3)
    model, _ = load(str(a_model))
    tokens = list(range(3, 40))
    key = entry_key(model_fingerprint(a_model).digest, tokens)
    blob = codec.encode(prefill(model, tokens), {"model": str(a_model), "tokenizer_config": "{}"})
    a_manifest = str(tmp_path / "box_a" / "manifest.toml")
    extra = {"source": "manifest", "manifest": a_manifest, "owners": [f"manifest:{a_manifest}"]}
    with Store(a) as sa:  # box A: a pin of one of A's manifests, with A's locations
        fields = with_model_location(dict(tokens=pack_tokens(tokens), label="a-only", pinned=True,
                                          model=str(a_model), classes=["KVCache"] *
                                          len(model.layers), extra=extra))  # fmt: skip
        sa.put(key, blob, **fields)  # located as the put operation locates
        assert sa.get_meta(key).extra.model_dir == str(a_model)
    assert "1 uploaded" in cli("remote", "push", "--home", str(a)).output

    manifest = manifest_for(tmp_path, b_model, TWO_PINS)
    r = cli("remote", "pull", "--manifest", str(manifest), "--home", str(b))
    assert r.exit_code == 0 and "1 fetched, 2 not on the remote" in r.output, r.output
    with Store(b, readonly=True) as sb:
        meta = sb.get_meta(key)
    assert meta.extra.model_dir == str(b_model.resolve())
    assert owners(meta) == [APP] and meta.extra.manifest is None
    assert meta.extra.origin == "remote" and not meta.pinned  # no manifest here pins it

    shutil.rmtree(a_model)  # box A's model is not on box B (its parent directory is)
    r = cli("evict", "--stale", "--home", str(b))
    assert r.exit_code == 0, r.output
    with Store(b, readonly=True) as sb:
        assert sb.get_meta(key) is not None, r.output  # B's model is intact: not stale


@pytest.mark.slow
def test_kv_made_with_other_mlx_versions_is_prefilled_not_fetched(s3, llama_path, tmp_path):
    """The fingerprint leaves mlx / mlx-lm versions out (the upgrade canary checks them): a warm
    used to fetch another runtime's KV and record it under this box's runtime, so after an
    upgrade the canary's dropped entries came straight back from the fleet, labelled as new."""
    a, b = box(tmp_path / "a", s3), box(tmp_path / "b", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    old = {"mlx": "0.0.1", "mlx_lm": "0.0.1"}
    with mock.patch("kvstore.warm.warm.runtime_versions", return_value=old):  # box A before upgrade
        assert "2 warmed" in cli("warm", "--manifest", manifest, "--home", str(a)).output
    assert "2 uploaded" in cli("remote", "push", "--home", str(a)).output
    r = cli("warm", "--manifest", manifest, "--home", str(b))
    assert r.exit_code == 0 and "2 warmed" in r.output and "0 fetched" in r.output, r.output
    assert "made with mlx 0.0.1, mlx_lm 0.0.1; this box runs" in r.output
    with Store(b, readonly=True) as sb:
        assert {m.extra.runtime["mlx"] for m in sb.metas()} == {mx.__version__}
    r = cli("remote", "pull", "--manifest", manifest, "--home", str(box(tmp_path / "c", s3)))
    assert "0 fetched" in r.output and "made with mlx 0.0.1" in r.output, r.output
