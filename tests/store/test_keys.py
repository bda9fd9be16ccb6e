"""Key layouts (kvstore.store.keys), the held-environment registry, and what eviction returns."""

from __future__ import annotations

from dataclasses import fields

from helpers import cli

from kvstore.home.settings import DEFAULT, DEFAULTS, UNITS, Settings
from kvstore.learned.chain import position_hash
from kvstore.store import lmdbenv
from kvstore.store.entry import entry_key, pack_tokens, prefix_hash
from kvstore.store.keys import (
    KEY_BYTES,
    Key,
    KidsRow,
    digest_hex,
    digest_of,
    fingerprint_of,
    kids_row,
    pack_key,
    parse_key,
    parse_kids_row,
    short_hex,
)
from kvstore.store.store import Store

FP = bytes(range(16))


def test_a_key_packs_and_parses_back():
    key = entry_key(FP, [1, 2, 3])
    assert len(key) == KEY_BYTES
    assert parse_key(key) == Key(FP, prefix_hash([1, 2, 3]))
    assert pack_key(*parse_key(key)) == key
    assert fingerprint_of(key) == FP and digest_of(key) == prefix_hash([1, 2, 3])
    assert parse_key(memoryview(key)) == parse_key(key)  # as LMDB hands out buffers


def test_a_kids_row_links_parent_and_child():
    tokens = list(range(600))
    parent = pack_key(FP, position_hash(FP, tokens, 256))
    child = pack_key(FP, position_hash(FP, tokens, 512))
    row = kids_row(parent, child)
    assert len(row) == KEY_BYTES + 16 and row.startswith(parent)
    assert parse_kids_row(row) == KidsRow(parent, child)


def test_the_short_key_is_what_ls_prints(kv_home):
    tokens = [7, 8, 9]
    with Store(kv_home) as store:
        key = store.put(entry_key(FP, tokens), bytes(64), tokens=pack_tokens(tokens)).key
    line = cli("ls", code=0).output.splitlines()[1]
    assert line.split()[0] == short_hex(key) == short_hex(key.hex()) == key.hex()[32:44]
    assert digest_hex(key) == digest_of(key).hex()


def test_held_environments_are_named_and_counted(kv_home):
    with Store(kv_home) as a:
        path = str(a.path.resolve())
        held = lmdbenv.ENVS[path]
        assert isinstance(held, lmdbenv.HeldEnv) and held.refs == 1 and not held.readonly
        assert held.env is a.env and lmdbenv.gate_of(a.path) is held.gate
        with Store(kv_home) as b:
            assert b.env is a.env and lmdbenv.ENVS[path].refs == 2
        assert lmdbenv.ENVS[path].refs == 1
    assert path not in lmdbenv.ENVS


def test_settings_are_one_table():
    assert DEFAULTS == {f.name: getattr(DEFAULT, f.name) for f in fields(Settings)}
    assert set(UNITS) <= set(DEFAULTS)
    assert Settings.of({**DEFAULTS, "block_tokens": 128, "remote": {}}).block_tokens == 128
