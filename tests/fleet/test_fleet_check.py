"""The semantic check on the warm's read-through (a real SeaweedFS server, real daemon, the tiny
llama): KV another box computed and a warm fetched is stored pending its check, and checked
against this box's own model before it serves a request: by the warm when it loads the model
anyway, else by the client that holds the model, at start, before it inserts the entry. A forged
object (its KV changed and re-sealed by a box that holds the fleet key) is never served, and its
uploader is quarantined; a legitimate one is served with no prefill and checked exactly once."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from unittest import mock

import pytest
from fleet_boxes import BUCKET, box, remote_of, store_chain
from helpers import TWO_PINS, Proc, cli, manifest_for, serving
from test_fleet_trust import box_id, keyed, objects_of, tampered, warm_and_push

from kvstore.fleet import check as fleet_check
from kvstore.fleet.objects import blob_end, seal
from kvstore.home import tombstones
from kvstore.store.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("environments_closed")]

THREE_PINS = (
    TWO_PINS
    + """
[[model.prefix]]
name = "examine"
messages = [{ role = "system", content = "You examine an answer for errors, step by step." }]
"""
)


def forge(s3, a: Path, label: str) -> None:
    """Box `a`, which holds the fleet key, re-seals its object `label` with changed KV."""
    client = s3.client()
    name = objects_of(a)[label]
    data = client.get_object(Bucket=BUCKET, Key=name)["Body"].read()
    key = bytes.fromhex(name.rsplit("/", 2)[1]) + bytes.fromhex(name.rsplit("/", 1)[1])
    forged = tampered(data, key, keep_trailer=True)
    forged = forged[: blob_end(forged)]
    client.put_object(Bucket=BUCKET, Key=name, Body=forged + seal(remote_of(a).settings, forged),
                      Metadata={"box": box_id(a)})  # fmt: skip


def rows(home: Path) -> dict[str, dict]:
    return {r["label"]: r for r in json.loads(cli("ls", "--json", "--home", home, code=0).output)}


def status(home: Path) -> dict:
    return json.loads(cli("remote", "status", "--json", "--home", home, code=0).output)


def fleet(s3, tmp_path: Path, llama_path: Path, *, forged: str | None = None):
    """Boxes a and b sharing a key; a warmed TWO_PINS and pushed them (`forged`: then re-sealed
    one with changed KV). Returns (a, b, manifest)."""
    k = secrets.token_hex(32)
    a, b = keyed(box(tmp_path / "a", s3), k), keyed(box(tmp_path / "b", s3), k)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    warm_and_push(a, manifest)
    if forged:
        forge(s3, a, forged)
    return a, b, manifest


def load(llama_path: Path, home: Path):
    from kvstore.client import load as kv_load

    model, _, cache = kv_load(str(llama_path), home=home, warm=False)
    return model, cache


def test_read_through_stores_pending_and_the_client_checks_once_then_serves(
    s3, llama_path, tmp_path
):
    a, b, manifest = fleet(s3, tmp_path, llama_path)
    with mock.patch("kvstore.warm.warm.load_model", side_effect=AssertionError("model loaded")):
        r = cli("warm", "--manifest", manifest, "--home", b, code=0)
    assert "0 warmed, 0 present, 0 failed, 2 fetched" in r.output, r.output
    assert {r["fleet_check"] for r in rows(b).values()} == {"pending"}
    assert "check pending" in cli("ls", "--home", b, code=0).output
    r = cli("export", rows(b)["classify"]["key"], tmp_path / "c.safetensors", "--home", b, code=0)
    assert f"computed by {box_id(a)} and is not yet checked against this box's model" in r.output
    checks = mock.patch.object(fleet_check, "check_cache", wraps=fleet_check.check_cache)
    with checks as counted:
        _, cache = load(llama_path, b)
    assert counted.call_count == 2  # each fetched entry, once, before it is inserted
    assert sorted(cache.report.labels) == ["classify", "synthesize"], cache.report
    assert not cache.report.skipped and not cache.report.warning
    assert {r["fleet_check"] for r in rows(b).values()} == {"passed"}  # recorded in the store
    with checks as counted:
        _, cache = load(llama_path, b)
    assert counted.call_count == 0 and sorted(cache.report.labels) == ["classify", "synthesize"]
    assert status(b)["quarantined"] == {}


def test_forged_object_from_the_read_through_is_never_served_and_quarantines(
    s3, llama_path, tmp_path
):
    a, b, manifest = fleet(s3, tmp_path, llama_path, forged="classify")
    r = cli("warm", "--manifest", manifest, "--home", b, code=0)
    assert "2 fetched" in r.output, r.output  # MAC and structure pass: only the model can tell
    before = status(b)["refused"].get("mismatch", 0)
    # hydrate without the model cannot check it: the pending entries are skipped, not served
    from mlx_lm.models.cache import LRUPromptCache

    from kvstore.client import hydrate

    lru = LRUPromptCache(max_size=8)
    rep = hydrate(lru, "m", str(llama_path), home=b)
    assert rep.entries == 0 and len(rep.skipped) == 2 and "not yet checked" in rep.skipped[0]
    assert "2 entries fetched from the fleet" in rep.warning
    _, cache = load(llama_path, b)
    assert cache.report.labels == ["synthesize"], cache.report
    assert any("its KV is not what this box's model computes (first 64" in s
               for s in cache.report.skipped), cache.report.skipped  # fmt: skip
    assert list(rows(b)) == ["synthesize"]  # the forged entry is deleted
    st = status(b)
    assert list(st["quarantined"]) == [box_id(a)] and st["refused"]["mismatch"] == before + 1
    r = cli("warm", "--manifest", manifest, "--home", b, code=0)  # prefilled, not fetched again
    assert "1 warmed, 1 present, 0 failed, 0 fetched" in r.output, r.output
    assert f"uploader {box_id(a)} is quarantined" in r.output
    assert "uploader" not in rows(b)["classify"]


def test_a_warm_that_loads_the_model_checks_what_it_fetched_and_prefills_a_forgery(
    s3, llama_path, tmp_path
):
    a, b, _ = fleet(s3, tmp_path, llama_path, forged="classify")
    three = str(manifest_for(tmp_path, llama_path, THREE_PINS, name="three.toml"))
    r = cli("warm", "--manifest", three, "--home", b, code=0)  # examine is prefilled: model loaded
    assert "2 warmed, 0 present, 0 failed, 1 fetched" in r.output, r.output
    got = rows(b)
    assert got["synthesize"]["fleet_check"] == "passed" and got["synthesize"]["uploader"]
    assert "uploader" not in got["classify"] and "uploader" not in got["examine"]
    assert list(status(b)["quarantined"]) == [box_id(a)]
    assert [(t.entry, t.by) for t in tombstones.load(b, str(llama_path))] == [
        ("classify", "fleet check")
    ]
    with mock.patch.object(fleet_check, "check_cache", wraps=fleet_check.check_cache) as counted:
        _, cache = load(llama_path, b)
    assert counted.call_count == 0 and len(cache.report.labels) == 3  # nothing left to check


def test_through_a_daemon_the_client_records_its_verdicts_with_the_daemon(s3, llama_path, tmp_path):
    a, b, manifest = fleet(s3, tmp_path, llama_path, forged="synthesize")
    with serving(Proc(b, "--manifest", manifest, log=tmp_path / "b.log")) as d:
        w = d.wait_warm()
        assert (w["warmed"], w["fetched"], w["models_loaded"]) == (0, 2, 0), d.text()
        _, cache = load(llama_path, b)  # checks both; the daemon records the verdicts
        assert cache.report.labels == ["classify"], cache.report
        got = rows(b)
        assert list(got) == ["classify"] and got["classify"]["fleet_check"] == "passed"
        assert list(status(b)["quarantined"]) == [box_id(a)]
        text = d.text()
    assert f"every object of uploader {box_id(a)} is quarantined" in text, text


def test_a_forged_first_record_of_a_pulled_learned_chain_is_refused(s3, llama_path, tmp_path):
    from helpers import mlx_lm_prefill
    from mlx_lm import load as mlx_load

    from kvstore.identity.fingerprint import model_fingerprint

    k = secrets.token_hex(32)
    a, b, c = (keyed(box(tmp_path / n, s3), k) for n in "abc")
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    fp = model_fingerprint(str(llama_path)).digest
    model, _ = mlx_load(str(llama_path))
    tokens = [(7 * i) % 500 + 3 for i in range(300)]
    cache = mlx_lm_prefill(model, tokens)
    store_chain(a, cache, tokens, fp, llama_path)
    assert "learned records: 2 uploaded" in cli("remote", "push", "--home", a, code=0).output
    r = cli("remote", "pull", "--manifest", manifest, "--home", c, code=0)
    assert "2 learned records" in r.output, r.output
    assert "checked 2 learned records against this box's model" in r.output

    f = keyed(box(tmp_path / "f", s3), k)  # a member whose runtime computes wrong KV
    other = [(11 * i) % 400 + 5 for i in range(300)]
    bad = mlx_lm_prefill(model, other)
    for layer in bad:
        layer.keys = layer.keys * 1.5
    store_chain(f, bad, other, fp, llama_path)
    assert "learned records: 2 uploaded" in cli("remote", "push", "--home", f, code=0).output
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=1)
    assert "refused learned record" in r.output and "(first 64 of 256 tokens" in r.output, r.output
    assert f"every object of {box_id(f)} is quarantined" in r.output
    assert list(status(b)["quarantined"]) == [box_id(f)]
    stored = json.loads(cli("ls", "--learned", "--json", "--home", b, code=0).output)
    assert sorted(r["uploader"] for r in stored if r["start"] == 0) == [box_id(a)]  # a's passed


def test_push_reseal_renews_this_boxs_objects_under_the_rotated_key(s3, llama_path, tmp_path):
    from helpers import mlx_lm_prefill
    from mlx_lm import load as mlx_load

    from kvstore.identity.fingerprint import model_fingerprint

    old = secrets.token_hex(32)
    a, b = keyed(box(tmp_path / "a", s3), old), keyed(box(tmp_path / "b", s3), old)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    model, _ = mlx_load(str(llama_path))
    tokens = [(7 * i) % 500 + 3 for i in range(300)]
    cache = mlx_lm_prefill(model, tokens)
    fp = model_fingerprint(str(llama_path)).digest
    store_chain(a, cache, tokens, fp, llama_path)
    warm_and_push(a, manifest)  # and one of b's: a box re-seals only its own
    three = str(manifest_for(tmp_path, llama_path, THREE_PINS, name="three.toml"))
    cli("warm", "--manifest", three, "--home", b, code=0)
    assert "1 uploaded, 2 already there" in cli("remote", "push", "--home", b, code=0).output
    r = cli("remote", "push", "--reseal", "--home", a, code=1)
    assert "no fleet_key_previous" in r.output and "Traceback" not in r.output
    cli("remote", "key", "new", "--home", a, code=0)  # the rotation: old becomes previous
    r = cli("remote", "push", "--reseal", "--home", a, code=0)
    assert "4 re-sealed under the current key, 0 already under it, 1 other boxes'" in r.output, (
        r.output
    )
    r = cli("remote", "push", "--reseal", "--home", a, code=0)
    assert "0 re-sealed under the current key, 4 already under it" in r.output, r.output
    creds = (a / "s3.toml").read_text()
    c = box(tmp_path / "c", s3)  # only the new key: b's object is still under the old one
    (c / "s3.toml").write_text("".join(ln for ln in creds.splitlines(True)
                                       if not ln.startswith("fleet_key_previous")))  # fmt: skip
    r = cli("remote", "pull", "--manifest", three, "--home", c, code=1)
    assert "2 fetched and 2 learned records" in r.output and "1 failed" in r.output, r.output
    assert r.output.count("MAC does not match this fleet's key") == 1
    (b / "s3.toml").write_text(creds)  # b takes both lines, and re-seals its own
    r = cli("remote", "push", "--reseal", "--home", b, code=0)
    assert "1 re-sealed under the current key, 0 already under it, 4 other boxes'" in r.output, (
        r.output
    )
    d = box(tmp_path / "d", s3)
    (d / "s3.toml").write_text((c / "s3.toml").read_text())
    r = cli("remote", "pull", "--manifest", three, "--home", d, code=0)
    assert "3 fetched and 2 learned records, 0 not on the remote, 0 failed" in r.output, r.output


def test_an_entry_fetched_after_start_is_not_restored_unchecked_on_a_request(
    s3, llama_path, tmp_path
):
    from mlx_lm import load as mlx_load

    from kvstore.client import PersistentPromptCache

    a, b, manifest = fleet(s3, tmp_path, llama_path, forged="classify")
    model, tokenizer = mlx_load(str(llama_path))
    with Store(b):
        pass  # an empty store: the app starts with nothing to hydrate
    cache = PersistentPromptCache.open(
        model, tokenizer, llama_path, home=b, learn=True, stats=False
    )
    try:
        assert cache.report.entries == 0 and cache.learner is not None
        r = cli("warm", "--manifest", manifest, "--home", b, code=0)  # fetched while it runs
        assert "2 fetched" in r.output
        with Store(b, readonly=True) as store:
            forged = next(m for m in store.metas() if m.label == "classify")
        prompt = forged.token_ids() + [5, 6, 7]
        _, rest = cache.fetch_nearest_cache(cache.model_key, prompt)
        assert len(rest) == len(prompt)  # prefilled: the pending entry is not restored unchecked
        pinned = cache.pin("classify", tokens=forged.token_ids())  # nor taken as a stored pin
        assert pinned.source != "store", pinned
    finally:
        cache.close()


def test_a_pull_that_refuses_a_forgery_drops_that_boxs_pending_entries(s3, llama_path, tmp_path):
    a, b, manifest = fleet(s3, tmp_path, llama_path)
    one = "[[model.prefix]]" + TWO_PINS.split("[[model.prefix]]")[2]  # synthesize only
    cli("warm", "--manifest", manifest_for(tmp_path, llama_path, one, name="one.toml"),
        "--home", b, code=0)  # fmt: skip
    assert rows(b)["synthesize"]["fleet_check"] == "pending"
    forge(s3, a, "classify")
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=1)
    assert f"every object of {box_id(a)} is quarantined" in r.output, r.output
    assert rows(b) == {}  # its entry fetched earlier and not yet checked is dropped with it
    st = status(b)
    assert list(st["quarantined"]) == [box_id(a)] and st["refused"] == {"mismatch": 1}
    (gone,) = tombstones.load(b, str(llama_path))  # evicted as every eviction is
    assert (gone.entry, gone.by) == ("synthesize", "fleet check")


def test_kvstore_serve_checks_pending_entries_before_it_answers(s3, llama_path, tmp_path):
    import socket
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from helpers import CLASSIFY, SYNTHESIZE, wait_for

    a, b, manifest = fleet(s3, tmp_path, llama_path, forged="classify")
    assert "2 fetched" in cli("warm", "--manifest", manifest, "--home", b, code=0).output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-c", "from kvstore.cli.main import main; main()", "serve", "--home",
           str(b), "--model", str(llama_path), "--port", str(port)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def cached(system: str) -> int:
        turns = [{"role": "system", "content": system}, {"role": "user", "content": "Invoice?"}]
        body = dict(max_tokens=2, temperature=0.0, messages=turns)
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["usage"]["prompt_tokens_details"]["cached_tokens"]

    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(healthy, 90.0, log.read_text, proc=proc)
            text = log.read_text()  # checked before /health said 200
            assert "refused fetched entry 'classify'" in text, text
            assert "fetched entry 'synthesize' from" in text and "checked against" in text
            assert cached(SYNTHESIZE) >= rows(b)["synthesize"]["tokens"]  # served, no prefill
            # the forgery is never served: past the template's first tokens, prefilled
            assert cached(CLASSIFY) < rows(a)["classify"]["tokens"] // 10
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    assert list(rows(b)) == ["synthesize"] and rows(b)["synthesize"]["fleet_check"] == "passed"
    assert list(status(b)["quarantined"]) == [box_id(a)]


def test_the_daemons_warm_that_loads_the_model_checks_what_it_fetched(s3, llama_path, tmp_path):
    a, b, _ = fleet(s3, tmp_path, llama_path, forged="synthesize")
    three = str(manifest_for(tmp_path, llama_path, THREE_PINS, name="three.toml"))
    with serving(Proc(b, "--manifest", three, log=tmp_path / "b.log")) as d:
        w = d.wait_warm()
        assert (w["warmed"], w["fetched"], w["models_loaded"]) == (2, 1, 1), d.text()
        got = rows(b)
        assert got["classify"]["fleet_check"] == "passed" and "uploader" not in got["synthesize"]
        assert list(status(b)["quarantined"]) == [box_id(a)]
        text = d.text()
    assert "refused fetched entry" in text and "'synthesize'" in text, text
