"""ModelIdentity: the one value for a model as it is run, as the manifest, the meta and the client
see it; its stored form is the schema-1 `extra` keys, byte for byte."""

from __future__ import annotations

import msgpack
import pytest

from kvstore.errors import ManifestError
from kvstore.identity.model import ModelIdentity
from kvstore.store.entry import EntryExtra, EntryMeta, entry_key, pack_tokens

QUANTIZED = ModelIdentity("/m", "/a", kv_bits=8, kv_group_size=32, quantized_kv_start=0,
                          model_config={"rope_theta": 1e6})  # fmt: skip


def _meta(extra: dict, model: str = "/m") -> EntryMeta:
    tokens = [1, 2, 3]
    key = entry_key(b"\x01" * 16, tokens)
    return EntryMeta(key, pack_tokens(tokens), 3, "x", False, model, b"\x01" * 16, b"\0" * 16,
                     0.0, 0.0, 0, 0, 0, 1, [], EntryExtra.from_map(extra))  # fmt: skip


def test_state_round_trips_and_is_what_entries_always_stored():
    assert ModelIdentity.from_state(QUANTIZED.state, "/m") == QUANTIZED
    # the literal extra warm, the client and serve wrote before the identity was one value
    before = {"adapter": "/a", "kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0,
              "model_config": {"rope_theta": 1e6}}  # fmt: skip
    assert msgpack.packb(QUANTIZED.state) == msgpack.packb(before)


def test_an_entry_reads_its_identity_from_extra_through_the_meta():
    stored = _meta({**QUANTIZED.state, "source": "pin"})
    meta = EntryMeta.unpack(stored.key, stored.pack())
    assert ModelIdentity.of_entry(meta) == QUANTIZED and meta.source == "pin"
    # an older entry without the later keys: generate's defaults, as it was keyed
    old = ModelIdentity.of_entry(_meta({"adapter": None, "kv_bits": 4}))
    assert (old.kv_group_size, old.quantized_kv_start, old.model_config) == (64, 5000, None)


def test_same_model_ignores_what_does_not_change_the_kv():
    plain = ModelIdentity("/m")
    assert ModelIdentity("/m", kv_group_size=32).same_model() == plain.same_model()
    assert ModelIdentity("/m", model_config={}).same_model() == plain.same_model()
    assert ModelIdentity("/m", kv_bits=8).same_model() != plain.same_model()
    assert QUANTIZED.same_model() != ModelIdentity("/m", "/a", kv_bits=8).same_model()
    assert ModelIdentity.of_entry(_meta(QUANTIZED.state)).same_model() == QUANTIZED.same_model()


@pytest.mark.parametrize(
    ("fields", "setting"),
    [({"kv_bits": "8"}, "kv_bits"), ({"kv_group_size": 48}, "kv_group_size"),
     ({"quantized_kv_start": -1}, "quantized_kv_start")],
)  # fmt: skip
def test_check_names_the_setting_generate_would_refuse(fields, setting):
    with pytest.raises(ManifestError, match=f"^{setting}: must be"):
        ModelIdentity("/m", **fields).check()
    assert ModelIdentity("/m", kv_bits=8).check().kv_bits == 8
