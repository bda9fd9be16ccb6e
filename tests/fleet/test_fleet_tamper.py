"""Issue 34's fleet edges, against a real SeaweedFS server: a box holding the fleet key that
changes a pin's KV past its first 64 positions and re-seals it is refused by the steps at
positions the receiving box draws (and `verify --deep` flags such an entry wherever it got in);
a box without a fleet key refuses unsigned objects unless its settings say `allow_unsigned =
true`; `remote push --reseal` knows this box's objects by their signed provenance, not by S3
metadata a copy may have dropped."""

from __future__ import annotations

import dataclasses
import json
import secrets
from pathlib import Path
from unittest import mock

import mlx.core as mx
import pytest
import xxhash
from fleet_boxes import BUCKET, box, remote_of
from helpers import CLASSIFY, SYNTHESIZE, TWO_PINS, cli, manifest_for
from test_fleet_trust import box_id, keyed, objects_of, warm_and_push

from kvstore.codec import codec
from kvstore.errors import RemoteError
from kvstore.fleet import check as fleet_check
from kvstore.fleet.fetch import UNAUTHENTICATED, UNSIGNED_REFUSED
from kvstore.fleet.objects import object_header, seal, verify_object
from kvstore.store.entry import CHUNK_SUMS_KEY

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("environments_closed")]

LONG = " ".join([CLASSIFY, SYNTHESIZE] * 3)  # about 890 tokens with the tiny llama's template
THREE_PINS = (
    TWO_PINS
    + f"""
[[model.prefix]]
name = "handbook"
messages = [{{ role = "system", content = "{LONG}" }}]
"""
)


def rows(home: Path) -> dict[str, dict]:
    return {r["label"]: r for r in json.loads(cli("ls", "--json", "--home", home, code=0).output)}


def key_of(name: str) -> bytes:
    return bytes.fromhex(name.rsplit("/", 2)[1]) + bytes.fromhex(name.rsplit("/", 1)[1])


def reseal_scaled(s3, a: Path, label: str, lo: int, hi: int) -> None:
    """Box `a`, which holds the fleet key, scales positions [lo, hi) of its object `label`'s KV
    (keys and values, every layer) by 1.5 and re-seals it: every structural check and the MAC
    pass, and its first 64 positions are untouched."""
    client = s3.client()
    name = objects_of(a)[label]
    rs = remote_of(a).settings
    data = client.get_object(Bucket=BUCKET, Key=name)["Body"].read()
    meta, blob, _ = verify_object(key_of(name), data, keys=rs.fleet_keys)
    cache, _ = codec.decode(blob)
    for c in cache:
        pos = mx.arange(c.keys.shape[2])[None, None, :, None]
        scale = mx.where((pos >= lo) & (pos < hi), 1.5, 1.0).astype(c.keys.dtype)
        c.keys, c.values = c.keys * scale, c.values * scale
    new = codec.encode(cache, {})
    extra = meta.extra.without(CHUNK_SUMS_KEY)
    meta = dataclasses.replace(
        meta, nbytes=len(new), checksum=xxhash.xxh3_64_intdigest(new), extra=extra
    )
    body = object_header(meta) + new
    client.put_object(Bucket=BUCKET, Key=name, Body=body + seal(rs, body),
                      Metadata={"box": box_id(a)})  # fmt: skip


def test_a_keyholders_tamper_past_64_is_refused_and_verify_deep_flags_it(s3, llama_path, tmp_path):
    k = secrets.token_hex(32)
    a, b, d = (keyed(box(tmp_path / n, s3), k) for n in "abd")
    manifest = str(manifest_for(tmp_path, llama_path, THREE_PINS))
    cli("warm", "--manifest", manifest, "--home", a, code=0)
    assert "3 uploaded" in cli("remote", "push", "--home", a, code=0).output
    assert rows(a)["handbook"]["tokens"] > 866
    reseal_scaled(s3, a, "handbook", 100, 867)

    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=1)
    assert "refused handbook: its KV is not what this box's model computes (first 64 of" in (
        r.output
    ), r.output
    assert "drawn positions stepped, position " in r.output, r.output
    assert f"every object of {box_id(a)} is quarantined" in r.output
    assert "handbook" not in rows(b)

    # box d checks only the first 64 positions (the check before the steps) and stores it
    with mock.patch.object(fleet_check, "SPOT_CHECKS", 0, create=True):
        r = cli("remote", "pull", "--manifest", manifest, "--home", d, code=0)
    assert "3 fetched" in r.output, r.output
    r = cli("verify", "--deep", "--home", d, code=1)
    assert "DIFFERS entry 'handbook'" in r.output, r.output
    assert "drawn positions stepped, position " in r.output
    assert "1 entry computed other KV than stored" in r.output
    assert r.output.count("ok      entry") == 2  # every entry is checked, the short pins pass
    cli("verify", "--deep", "--repair", "--home", d, code=1)
    assert sorted(rows(d)) == ["classify", "synthesize"]
    cli("verify", "--deep", "--home", d, code=0)


def test_a_box_without_a_key_refuses_unsigned_objects_unless_allowed(s3, llama_path, tmp_path):
    a = box(tmp_path / "a", s3)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    warm_and_push(a, manifest)

    b = box(tmp_path / "b", s3, allow_unsigned=False)  # the default: no allow_unsigned line
    assert "allow_unsigned" not in (b / "settings.toml").read_text()
    r = cli("remote", "status", "--home", b, code=0)
    assert f"warning: {UNSIGNED_REFUSED}" in r.output
    assert (
        json.loads(cli("remote", "status", "--json", "--home", b).output)["settings"][
            "allow_unsigned"
        ]
        is False
    )
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=1)
    assert UNSIGNED_REFUSED in r.output and "Traceback" not in r.output
    r = cli("warm", "--manifest", manifest, "--home", b, code=0)
    assert "2 warmed, 0 present, 0 failed, 0 fetched" in r.output, r.output
    assert not any(row.get("uploader") for row in rows(b).values())
    name = next(iter(objects_of(a).values()))
    data, _ = remote_of(a).fetch(key_of(name))
    with pytest.raises(RemoteError, match="this box has no fleet_key to check it; refused") as e:
        verify_object(key_of(name), data)
    assert e.value.cause == "unauthentic" and "allow_unsigned = true" in str(e.value)

    c = box(tmp_path / "c", s3)  # allow_unsigned = true: taken, with the warning
    assert "allow_unsigned = true" in (c / "settings.toml").read_text()
    assert f"warning: {UNAUTHENTICATED}" in cli("remote", "status", "--home", c, code=0).output
    r = cli("warm", "--manifest", manifest, "--home", c, code=0)
    assert "0 warmed, 0 present, 0 failed, 2 fetched" in r.output, r.output
    d = box(tmp_path / "d", s3, allow_unsigned=False)
    (d / "settings.toml").write_text("allow_unsigned = 1\n" + (d / "settings.toml").read_text())
    r = cli("remote", "status", "--home", d, code=1)
    assert "allow_unsigned must be true or false, not 1" in r.output and "Traceback" not in r.output


def test_reseal_knows_this_boxs_objects_by_their_signed_provenance_not_metadata(
    s3, llama_path, tmp_path
):
    old = secrets.token_hex(32)
    a, b = keyed(box(tmp_path / "a", s3), old), keyed(box(tmp_path / "b", s3), old)
    manifest = str(manifest_for(tmp_path, llama_path, TWO_PINS))
    warm_and_push(a, manifest)
    client = s3.client()
    for name in objects_of(a).values():  # copied by a tool that drops user metadata
        body = client.get_object(Bucket=BUCKET, Key=name)["Body"].read()
        client.put_object(Bucket=BUCKET, Key=name, Body=body)
        assert client.head_object(Bucket=BUCKET, Key=name).get("Metadata", {}) == {}
    cli("remote", "key", "new", "--home", a, code=0)  # the rotation: old becomes previous
    r = cli("remote", "push", "--reseal", "--home", a, code=0)
    assert "2 re-sealed under the current key, 0 already under it, 0 other boxes'" in r.output, (
        r.output
    )
    creds = (a / "s3.toml").read_text()
    new_only = "".join(ln for ln in creds.splitlines(True) if not ln.startswith("fleet_key_prev"))
    (b / "s3.toml").write_text(new_only)  # only the new key: the re-sealed objects pass
    r = cli("remote", "pull", "--manifest", manifest, "--home", b, code=0)
    assert "2 fetched" in r.output, r.output
    # b's copies of a's objects, held here but not b's: never re-sealed by b
    (b / "s3.toml").write_text(creds)
    r = cli("remote", "push", "--reseal", "--home", b, code=0)
    assert "0 re-sealed under the current key, 0 already under it, 2 other boxes'" in r.output, (
        r.output
    )
