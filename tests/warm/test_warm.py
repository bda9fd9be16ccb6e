"""kvstore.warm.warm: what a warm pass repairs and how it fails."""

from __future__ import annotations

from helpers import TWO_PINS, manifest_for

from kvstore.errors import StoreError
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.warm.warm import warm as warm_engine


def test_a_present_pin_with_a_bad_blob_is_warmed_again(llama_path, kv_home, tmp_path):
    manifest = load_manifest(manifest_for(tmp_path, llama_path, TWO_PINS))
    with Store(kv_home) as store:
        warm(manifest, store, home=kv_home)
        meta = {m.label: m for m in store.metas()}["classify"]
        blob = bytearray(store.read_blob(meta.key))
        blob[len(blob) // 2] ^= 0xFF
        with store.env.begin(write=True) as txn:
            txn.put(meta.key, bytes(blob), db=store._blob)
        assert store.check()  # broken now
        report = warm(manifest, store, home=kv_home)
        assert {p.name: p.status for p in report.pins} == {
            "classify": "warmed", "synthesize": "present"
        }  # fmt: skip
        assert store.check() == []


def test_a_failing_put_fails_its_pin_and_the_warm_goes_on(llama_path, kv_home, tmp_path):
    manifest = load_manifest(manifest_for(tmp_path, llama_path, TWO_PINS))
    calls = []

    def put(key, blob, fields):
        calls.append(fields["label"])
        if fields["label"] == "classify":
            raise StoreError("store map is full (test)")
        store.put(key, blob, **fields)

    with Store(kv_home) as store:
        report = warm_engine(manifest, store, home=kv_home, put=put)
        assert calls == ["classify", "synthesize"]
        status = {p.name: p.status for p in report.pins}
        assert status == {"classify": "failed", "synthesize": "warmed"}
        assert "map is full" in report.failed[0].error
        assert [m.label for m in store.metas()] == ["synthesize"]
