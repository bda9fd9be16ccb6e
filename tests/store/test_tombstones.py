"""Tombstones of evictions: kept in the home across processes, the last MAX_TOMBSTONES, per model;
each covers exactly the prefix it was made for."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.home import tombstones


@dataclass
class Meta:
    tokens: list[int]
    model: str = "m"
    label: str = "sys"

    def token_ids(self) -> list[int]:
        return self.tokens


def test_tombstones_survive_name_their_budget_and_cover_their_prefix(tmp_path):
    assert tombstones.note(tmp_path, [Meta([1, 2, 3])], tombstones.BY_BYTES) == 1
    tombstones.note(tmp_path, [Meta([7, 8], model="other")], tombstones.BY_EVICT)
    (t,) = tombstones.load(tmp_path, "m")
    assert (t.by, t.entry, t.length) == ("byte budget", "sys", 3)
    assert t.covers([1, 2, 3, 4]) and not t.covers([1, 2, 4, 4]) and not t.covers([1, 2])


def test_only_the_last_tombstones_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tombstones, "MAX_TOMBSTONES", 3)
    for i in range(5):
        tombstones.note(tmp_path, [Meta([i])], tombstones.BY_LEARNED)
    assert [t.length for t in tombstones.load(tmp_path, "m")] == [1, 1, 1]
    assert [t.covers([i]) for t in tombstones.load(tmp_path, "m") for i in (1, 2, 3, 4)].count(
        True
    ) == 3


def test_an_unreadable_file_is_ignored(tmp_path):
    (tmp_path / tombstones.TOMBSTONES_NAME).write_bytes(b"\xc1garbage")
    assert tombstones.load(tmp_path, "m") == []
