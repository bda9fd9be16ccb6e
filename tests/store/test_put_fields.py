"""One constructor for an entry's put fields (kvstore.store.entry.entry_fields)."""

from __future__ import annotations

from kvstore.store.entry import PutFields, entry_fields, entry_key, pack_tokens
from kvstore.store.store import Store

FP = bytes(range(16))


def test_extra_is_state_then_source_then_the_rest_in_order():
    f = entry_fields(
        [1, 2, 3], label="system", pinned=False, model="m", template_hash=b"t", classes=["KVCache"],
        state={"adapter": None, "kv_bits": None}, source="pin", owners=["app"],
        runtime={"mlx": "x"},
        extra={"runtime": {"mlx": "y"}, "note": 1},
    )  # fmt: skip
    assert isinstance(f, PutFields) and f.tokens == pack_tokens([1, 2, 3])
    assert list(f.extra.to_map()) == ["adapter", "kv_bits", "source", "owners", "runtime", "note"]
    assert f.extra.runtime == {"mlx": "y"}  # `extra` overrides in place
    assert list(f.as_kwargs()) == [
        "tokens", "label", "pinned", "model", "template_hash", "classes", "extra"
    ]  # fmt: skip
    assert f.as_kwargs()["extra"] is f.extra  # not a deep copy
    assert entry_fields(pack_tokens([1, 2, 3]), label="", pinned=True, model="", template_hash=None,
                        classes=[], source="x").tokens == f.tokens  # fmt: skip


def test_the_fields_put_as_store_put_takes_them(kv_home):
    f = entry_fields([4, 5], label="x", pinned=True, model="m", template_hash=None, classes=[],
                     source="manifest", manifest=None)  # fmt: skip
    with Store(kv_home) as store:
        meta = store.put(entry_key(FP, [4, 5]), bytes(8), **f.as_kwargs())
    assert (meta.label, meta.pinned, meta.model) == ("x", True, "m")
    assert meta.extra.to_map() == {"source": "manifest", "manifest": None}
