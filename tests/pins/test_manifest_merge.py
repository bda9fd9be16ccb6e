"""Issue 10 item 7: two [[model]] tables for the same model merge their pins.

Before, the second table replaced the first in the warm's plan, and the first table's pins were
purged as "pin removed" on every warm.
"""

from __future__ import annotations

import pytest
from helpers import CLASSIFY, SYNTHESIZE

from kvstore.errors import ManifestError
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store


def two_tables(model, *, second_name="synthesize", second_extra="") -> str:
    return f"""# one model, two teams' tables
[[model]]
path = "{model}"

[[model.prefix]]
name = "classify"
messages = [{{ role = "system", content = "{CLASSIFY}" }}]

[[model]]
path = "{model}"
{second_extra}
[[model.prefix]]
name = "{second_name}"
messages = [{{ role = "system", content = "{SYNTHESIZE}" }}]
"""


def test_tables_of_the_same_model_merge(llama_path, tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(two_tables(llama_path))
    (model,) = load_manifest(path).models
    assert [p.name for p in model.prefixes] == ["classify", "synthesize"]


def test_the_same_pin_name_in_both_is_an_error_naming_both_tables(llama_path, tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(two_tables(llama_path, second_name="classify"))
    with pytest.raises(ManifestError) as e:
        load_manifest(path)
    msg = str(e.value)
    assert str(path) in msg and "'classify'" in msg
    assert "line 2 and line 9" in msg


def test_other_kv_settings_or_overrides_are_other_models(llama_path, tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(two_tables(llama_path, second_name="classify", second_extra="kv_bits = 8"))
    assert len(load_manifest(path).models) == 2
    path.write_text(
        two_tables(
            llama_path, second_name="classify", second_extra="model_config = {rope_theta = 2e4}"
        )
    )
    assert len(load_manifest(path).models) == 2


def test_warming_merged_tables_keeps_every_pin(llama_path, kv_home, tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(two_tables(llama_path))
    with Store(kv_home) as store:
        first = warm(load_manifest(path), store, home=kv_home)
        assert first.warmed == 2
        again = warm(load_manifest(path), store, home=kv_home)
        assert again.purged == []
        assert sorted(p.status for p in again.pins) == ["present", "present"]
        assert sorted(m.label for m in store.metas()) == ["classify", "synthesize"]
