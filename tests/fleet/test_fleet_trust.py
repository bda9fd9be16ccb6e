"""What a box trusts from the fleet tier (a real SeaweedFS server): objects carry an HMAC-SHA256
under the fleet key and the box that computed them; a box holding the key refuses any object
whose MAC is missing or wrong (a bucket writer without the key), stores nothing of it, counts it
and prefills as it would have; a box without a key works as before and says so."""

from __future__ import annotations

import dataclasses
import json
import secrets
from pathlib import Path
from unittest import mock

import pytest
import xxhash
from fleet_boxes import BUCKET, big_entry, box, remote_of, store_chain
from helpers import TWO_PINS, Proc, cli, manifest_for, serving

from kvstore.codec import codec
from kvstore.errors import RemoteError
from kvstore.fleet.fetch import UNAUTHENTICATED
from kvstore.fleet.objects import (
    blob_end,
    object_header,
    object_name,
    seal,
    verify_object,
)
from kvstore.fleet.remote_settings import RemoteSettings
from kvstore.store.entry import CHUNK_SUMS_KEY
from kvstore.store.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("environments_closed")]


def keyed(home: Path, key: str, previous: str | None = None) -> Path:
    """The box's credentials file given a fleet key (as `remote key new` prints it)."""
    creds = home / "s3.toml"
    text = creds.read_text() + f'fleet_key = "{key}"\n'
    if previous:
        text += f'fleet_key_previous = "{previous}"\n'
    creds.write_text(text)
    return home


def refused_metric() -> float:
    from kvstore import metrics

    got = metrics.REGISTRY.get_sample_value(
        "kvstore_fleet_refused_total", {"reason": "unauthentic"}
    )
    return got or 0.0


def box_id(home: Path) -> str:
    return (home / "box_id").read_text().strip()


def warm_and_push(home: Path, manifest: str) -> None:
    cli("warm", "--manifest", manifest, "--home", home, code=0)
    assert "2 uploaded" in cli("remote", "push", "--home", home, code=0).output


def objects_of(home: Path) -> dict[str, str]:
    """label -> object name of the box's stored entries."""
    rs = remote_of(home).settings
    with Store(home, readonly=True) as store:
        return {m.label: object_name(rs, m.key) for m in store.metas()}


def tampered(data: bytes, key: bytes, *, keep_trailer: bool) -> bytes:
    """The object with its KV values changed, re-framed with kvstore's own functions so every
    structural check passes: a new blob, a meta with its length and checksum, and either the
    original trailer (its MAC no longer matches) or a fresh one made without a key."""
    meta, blob, _ = verify_object(key, data, unsigned=True)
    cache, _ = codec.decode(blob)
    for c in cache:
        if getattr(c, "keys", None) is not None:  # attention layers; a state layer keeps its own
            c.keys = c.keys * 1.5
    new = codec.encode(cache, {})
    extra = meta.extra.without(CHUNK_SUMS_KEY)
    meta = dataclasses.replace(
        meta, nbytes=len(new), checksum=xxhash.xxh3_64_intdigest(new), extra=extra
    )
    body = object_header(meta) + new
    if keep_trailer:
        return body + bytes(data[blob_end(data) :])
    return body + seal(RemoteSettings(endpoint="http://x", bucket="b", box_id="mallory"), body)


def test_key_new_writes_the_key_0600_rotates_and_status_never_shows_it(s3, tmp_path):
    a = box(tmp_path / "a", s3)
    r = cli("remote", "key", "new", "--home", a, code=0)
    creds = (a / "s3.toml").read_text()
    first = json.loads(creds.split("fleet_key = ", 1)[1].splitlines()[0])
    assert "copy these lines into the credentials file of every other box" in r.output
    assert f'fleet_key = "{first}"' in r.output and (a / "s3.toml").stat().st_mode & 0o777 == 0o600
    status = cli("remote", "status", "--json", "--home", a, code=0).output
    assert first not in status
    data = json.loads(status)
    assert data["authenticated"] and data["settings"]["fleet_key"] == "(set)"
    assert data["settings"]["box_id"] == box_id(a)
    cli("remote", "key", "new", "--home", a, code=0)  # rotation: the old key stays as previous
    creds = (a / "s3.toml").read_text()
    assert f'fleet_key_previous = "{first}"' in creds and creds.count("fleet_key = ") == 1
    assert "access_key_id" in creds  # the S3 keys are kept


def test_tampered_object_is_refused_by_mac_counted_and_prefilled(s3, llama_path, tmp_path):
    k = secrets.token_hex(32)
    a, b = keyed(box(tmp_path / "a", s3), k), keyed(box(tmp_path / "b", s3), k)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    warm_and_push(a, manifest)
    names = objects_of(a)
    client = s3.client()
    for label, keep in (("classify", True), ("synthesize", False)):
        name = names[label]
        data = client.get_object(Bucket=BUCKET, Key=name)["Body"].read()
        key = bytes.fromhex(name.rsplit("/", 2)[1]) + bytes.fromhex(name.rsplit("/", 1)[1])
        client.put_object(Bucket=BUCKET, Key=name, Body=tampered(data, key, keep_trailer=keep))

    before = refused_metric()
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=1)
    assert "0 fetched, 0 not on the remote, 2 failed" in r.output, r.output
    assert refused_metric() == before + 2  # what the daemon's metrics port serves
    assert f"MAC does not match this fleet's key (uploaded by {box_id(a)}" in r.output
    assert "no MAC (uploaded by mallory" in r.output
    with Store(b, readonly=True) as store:
        assert store.keys() == []  # nothing of a refused object is stored
    status = json.loads(cli("remote", "status", "--json", "--home", b, code=0).output)
    assert status["refused"] == {"unauthentic": 2}
    r = cli("warm", "--manifest", manifest, "--home", b, code=0)  # prefills as it would have
    assert "2 warmed, 0 present, 0 failed, 0 fetched" in r.output, r.output
    assert json.loads(cli("remote", "status", "--json", "--home", b).output)["refused"] == {
        "unauthentic": 4
    }
    # the same objects pass every structural check: only the MAC refused them
    for name in names.values():
        data = client.get_object(Bucket=BUCKET, Key=name)["Body"].read()
        key = bytes.fromhex(name.rsplit("/", 2)[1]) + bytes.fromhex(name.rsplit("/", 1)[1])
        verify_object(key, data, unsigned=True)


def test_object_from_a_box_with_another_key_is_refused(s3, llama_path, tmp_path):
    a = keyed(box(tmp_path / "a", s3), secrets.token_hex(32))
    b = keyed(box(tmp_path / "b", s3), secrets.token_hex(32))
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    warm_and_push(a, manifest)
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=1)
    assert "0 fetched, 0 not on the remote, 2 failed" in r.output
    assert r.output.count("MAC does not match this fleet's key") == 2


def test_signed_objects_are_served_with_no_prefill_and_name_their_box(s3, llama_path, tmp_path):
    k = secrets.token_hex(32)
    a, b = keyed(box(tmp_path / "a", s3), k), keyed(box(tmp_path / "b", s3), k)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    warm_and_push(a, manifest)
    with mock.patch("kvstore.warm.warm.load_model", side_effect=AssertionError("model loaded")):
        r = cli("warm", "--manifest", manifest, "--home", b, code=0)
    assert "0 warmed, 0 present, 0 failed, 2 fetched" in r.output, r.output
    rows = json.loads(cli("ls", "--json", "--home", b, code=0).output)
    assert [r["uploader"] for r in rows] == [box_id(a)] * 2
    assert {"key", "label", "tokens", "nbytes", "pinned"} <= set(rows[0])  # existing keys kept
    assert f"from {box_id(a)}" in cli("ls", "--home", b, code=0).output
    listed = json.loads(cli("remote", "ls", "--json", "--home", b, code=0).output)
    assert [o["uploader"] for o in listed] == [box_id(a)] * 2
    assert box_id(a) != box_id(b)
    c = keyed(box(tmp_path / "c", s3), k)  # pull checks each against its own model: they pass
    r = cli("remote", "pull", "--manifest", manifest, "--home", c, code=0)
    assert "2 fetched" in r.output and "checked 2 objects against this box's model" in r.output


def test_key_rotation_accepts_the_previous_keys_objects(s3, llama_path, tmp_path):
    old = secrets.token_hex(32)
    a = keyed(box(tmp_path / "a", s3), old)
    b = keyed(box(tmp_path / "b", s3), old)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    warm_and_push(a, manifest)
    cli("remote", "key", "new", "--home", b, code=0)  # b rotates: old becomes previous
    assert "2 fetched" in cli("remote", "pull", "--manifest", manifest, "--home", b, code=0).output
    creds = b / "s3.toml"  # once the previous key is dropped, its objects are refused
    creds.write_text("".join(ln for ln in creds.read_text().splitlines(True)
                             if not ln.startswith("fleet_key_previous")))  # fmt: skip
    c = box(tmp_path / "c", s3)
    (c / "s3.toml").write_text(creds.read_text())
    r = cli("remote", "pull", "--manifest", manifest, "--home", c, code=1)
    assert "2 failed" in r.output and "MAC does not match" in r.output


def test_a_box_without_a_key_keeps_working_and_says_so(s3, llama_path, tmp_path):
    a, b = box(tmp_path / "a", s3), box(tmp_path / "b", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    warm_and_push(a, manifest)
    r = cli("remote", "status", "--home", b, code=0)
    assert f"warning: {UNAUTHENTICATED}" in r.output
    assert (
        json.loads(cli("remote", "status", "--json", "--home", b).output)["authenticated"] is False
    )
    with serving(Proc(b, "--manifest", manifest, log=tmp_path / "b.log")) as d:
        w = d.wait_warm()
        assert (w["warmed"], w["fetched"]) == (0, 2), d.text()
        assert d.text().count(UNAUTHENTICATED) == 1  # said once, at start


def test_objects_of_older_kvstores_are_refused_only_with_a_key(s3, llama_path, tmp_path):
    k = secrets.token_hex(32)
    a = box(tmp_path / "a", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    warm_and_push(a, manifest)
    client = s3.client()
    for name in objects_of(a).values():  # as the code before the trailer wrote them
        data = client.get_object(Bucket=BUCKET, Key=name)["Body"].read()
        key = bytes.fromhex(name.rsplit("/", 2)[1]) + bytes.fromhex(name.rsplit("/", 1)[1])
        meta, blob, _ = verify_object(key, data, unsigned=True)
        client.put_object(Bucket=BUCKET, Key=name, Body=object_header(meta) + bytes(blob))
    b, c = keyed(box(tmp_path / "b", s3), k), box(tmp_path / "c", s3)
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=1)
    assert r.output.count("no MAC (uploaded by an unknown box") == 2, r.output
    assert "2 fetched" in cli("remote", "pull", "--manifest", manifest, "--home", c, code=0).output


def test_multipart_objects_carry_a_mac_over_every_part(s3, tmp_path):
    k = secrets.token_hex(32)
    parts = dict(multipart_threshold=5 * 2**20, part_size=5 * 2**20)
    a = keyed(box(tmp_path / "a", s3, **parts), k)
    with Store(a) as store:
        key = big_entry(store, bytes(16), 2600)  # ~10 MiB: three parts
    cli("remote", "push", "--home", a, code=0)
    data, _ = remote_of(a).fetch(key)
    meta, blob, prov = verify_object(key, data, keys=(bytes.fromhex(k),))
    assert prov.signed and prov.box == box_id(a) and len(blob) == meta.nbytes > 10 * 2**20
    with pytest.raises(RemoteError, match="MAC does not match"):
        verify_object(key, data, keys=(secrets.token_bytes(32),))


def test_kv_forged_by_a_box_with_the_key_is_refused_by_the_semantic_check(s3, llama_path, tmp_path):
    k = secrets.token_hex(32)
    a, b = keyed(box(tmp_path / "a", s3), k), keyed(box(tmp_path / "b", s3), k)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    warm_and_push(a, manifest)
    faulty = remote_of(a).settings  # a member that holds the key signs KV its model got wrong
    client = s3.client()
    name = objects_of(a)["classify"]
    data = client.get_object(Bucket=BUCKET, Key=name)["Body"].read()
    key = bytes.fromhex(name.rsplit("/", 2)[1]) + bytes.fromhex(name.rsplit("/", 1)[1])
    forged = tampered(data, key, keep_trailer=True)
    forged = forged[: blob_end(forged)]
    client.put_object(
        Bucket=BUCKET, Key=name, Body=forged + seal(faulty, forged), Metadata={"box": box_id(a)}
    )
    assert verify_object(key, forged + seal(faulty, forged), keys=(bytes.fromhex(k),))

    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=1)
    assert "0 fetched, 0 not on the remote, 2 failed" in r.output, r.output
    assert "refused classify: its KV is not what this box's model computes (first 64" in r.output
    assert f"every object of {box_id(a)} is quarantined" in r.output
    assert f"not fetched synthesize: uploader {box_id(a)} is quarantined" in r.output
    with Store(b, readonly=True) as store:
        assert store.keys() == []  # the forged one refused, the rest of its box's quarantined
    status = json.loads(cli("remote", "status", "--json", "--home", b, code=0).output)
    assert list(status["quarantined"]) == [box_id(a)]
    r = cli("warm", "--manifest", manifest, "--home", b, code=0)  # the warm's fetch refuses too
    assert "2 warmed, 0 present, 0 failed, 0 fetched" in r.output, r.output
    assert f"uploader {box_id(a)} is quarantined" in r.output
    cli("remote", "release", box_id(a), "--home", b, code=0)
    assert json.loads(cli("remote", "status", "--json", "--home", b).output)["quarantined"] == {}
    assert "not quarantined" in cli("remote", "release", box_id(a), "--home", b, code=1).output
    from kvstore.fleet.queue import UploadQueue

    q = UploadQueue(b)
    q.quarantine(box_id(a), "again")
    q.close()
    r = cli("remote", "gc", "--quarantined", "--home", b, code=0)
    assert "2 objects deleted" in r.output, r.output
    assert list(remote_of(b).objects()) == []
    assert json.loads(cli("remote", "status", "--json", "--home", b).output)["quarantined"] == {}


def test_semantic_check_of_a_final_state_layout_compares_the_whole_entry(s3, hybrid_path, tmp_path):
    k = secrets.token_hex(32)
    a, b, c = (keyed(box(tmp_path / n, s3), k) for n in "abc")
    manifest = str(manifest_for(tmp_path, hybrid_path, TWO_PINS))
    warm_and_push(a, manifest)
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=0)
    assert "2 fetched" in r.output and "checked 2 objects" in r.output, r.output
    name = objects_of(a)["classify"]
    client = s3.client()
    data = client.get_object(Bucket=BUCKET, Key=name)["Body"].read()
    key = bytes.fromhex(name.rsplit("/", 2)[1]) + bytes.fromhex(name.rsplit("/", 1)[1])
    forged = tampered(data, key, keep_trailer=True)
    forged = forged[: blob_end(forged)]
    client.put_object(Bucket=BUCKET, Key=name, Body=forged + seal(remote_of(a).settings, forged))
    r = cli("remote", "pull", "--manifest", manifest, "--home", c, code=1)
    assert "refused classify: its KV is not what this box's model computes (first 148 of 148" in (
        r.output
    ), r.output


def test_learned_records_carry_the_mac_and_honour_the_quarantine(s3, llama_path, tmp_path):
    from helpers import mlx_lm_prefill
    from mlx_lm import load

    from kvstore.fleet.queue import UploadQueue
    from kvstore.identity.fingerprint import model_fingerprint

    k = secrets.token_hex(32)
    a, b = keyed(box(tmp_path / "a", s3), k), keyed(box(tmp_path / "b", s3), k)
    other = keyed(box(tmp_path / "other", s3), secrets.token_hex(32))
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    fp = model_fingerprint(str(llama_path)).digest
    model, _ = load(str(llama_path))
    tokens = [(7 * i) % 500 + 3 for i in range(300)]
    cache = mlx_lm_prefill(model, tokens)
    store_chain(a, cache, tokens, fp, llama_path)
    assert "learned records: 2 uploaded" in cli("remote", "push", "--home", a, code=0).output
    r = cli("remote", "pull", "--manifest", manifest, "--home", other, code=1)
    assert "learned record" in r.output and "MAC does not match this fleet's key" in r.output
    q = UploadQueue(b)
    q.quarantine(box_id(a), "a look")
    q.close()
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=1)
    assert f"uploader {box_id(a)} is quarantined (a look); not stored" in r.output, r.output
    cli("remote", "release", box_id(a), "--home", b, code=0)
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=0)
    assert "2 learned records" in r.output, r.output
    rows = json.loads(cli("ls", "--learned", "--json", "--home", b, code=0).output)
    assert [r["uploader"] for r in rows] == [box_id(a)] * 2
