"""The index of one model's learned records as the store holds them: their chains (the packed
token ids from position 0 to each record nothing extends), read incrementally from the store's
`kids` rows (`LearnedChains`: a change to the store costs what changed). One per home and model
in a process, shared by the cold tier (kvstore.learned.coldtier) and the reasons' reader."""

from __future__ import annotations

import bisect
import heapq
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore import tokens as tk


def leaf_chains(packed: Sequence[bytes]) -> list[bytes]:
    """Packed chains, sorted, without those another one extends (in sorted order, a chain's
    extensions follow it: the next one says)."""
    chains = sorted(packed)
    return [c for c, after in zip(chains, [*chains[1:], b""][: len(chains)], strict=True)
            if not after.startswith(c)]  # fmt: skip


class _Record:
    """One learned record as `LearnedChains` keeps it: where it starts and ends, the record it
    follows and its own tokens (packed), not its KV. Unreadable: start and end -1."""

    __slots__ = ("end", "last_used", "parent", "start", "tokens")

    def __init__(self, parent: bytes, meta: Any):
        self.parent = parent
        self.start: int = meta.start if meta is not None else -1
        self.end: int = meta.end if meta is not None else -1
        self.tokens: bytes = meta.tokens if meta is not None else b""
        self.last_used: float = meta.last_used if meta is not None else 0.0


class LearnedChains:
    """One model's learned records as the store holds them, read incrementally: `update` walks
    the model's `kids` rows (keys only, nothing decoded), decodes the metas of the records that
    appeared since it last ran and forgets those that left. A change to the store costs what
    changed, not a read of every learned record, and one view serves both of a process's readers
    (the cold tier's index and the reasons' learned prefixes: `learned_chains`).

    Kept: each record's own tokens (4 bytes a token: the learned budget bounds them) and the
    chains (`chains`: the packed token ids from position 0 to each record nothing extends,
    sorted, none a prefix of another, as `leaf_chains` keeps them; a new list on each change,
    so a reader on another thread sees one or the other). A chain that ends off a block
    boundary (a prompt's end) inside a record of another is left out while that one is there. A
    record's `last_used` is what it had when first read (later touches are not read again): the
    reasons' most recently used prefixes are the most recently learned ones."""

    def __init__(self, fingerprint: bytes):
        self.fingerprint = fingerprint
        self.records: dict[bytes, _Record] = {}
        self.kids: dict[bytes, int] = {}  # record (or root) key -> records known that follow it
        self._off: dict[bytes, set[bytes]] = {}  # parent -> its records that end off a block
        self.chains: list[bytes] = []
        self.change = -1  # the store's last transaction id when last read
        self.version = 0  # changes seen
        self.block = 0  # the store's block_tokens
        self.decoded = 0  # record metas decoded, in all (what a test counts)
        self._lock = threading.Lock()
        self._cut: dict[bytes, bytes] = {}  # `prefixes` last given, by end record (reused)

    def update(self, blocks: Any) -> bool:
        """Read what changed in `blocks` (a BlockStore of an open Store) since the last update;
        whether the records changed."""
        with self._lock:
            change = blocks.changes()
            if change == self.change or not blocks.opened():
                return False
            with blocks.store.reading() as txn:
                added, removed = self._diff(blocks, txn)
                metas = [(parent, key, blocks.meta_in(txn, key)) for parent, key in added]
                self.block = blocks.block_tokens(txn)
            self.decoded += len(metas)
            self.change = change
            if not added and not removed:
                return False
            chains = self.chains.copy()
            self._remove(removed, chains)
            self._add(metas, chains)
            self.chains = chains
            self.version += 1
            return True

    def _diff(self, blocks: Any, txn: Any) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
        """(parent, key) of the records the store holds that are not known, and the keys of
        known records it no longer holds."""
        now = blocks.links(txn, self.fingerprint)
        records = self.records
        added = [(parent, key) for key, parent in now.items() if key not in records]
        removed = []
        if len(now) - len(added) < len(records):  # some left: which
            removed = [k for k, rec in records.items() if now.get(k) != rec.parent]
        return added, removed

    def _prefix(self, key: bytes) -> bytes:
        """The packed tokens from position 0 to the end of record `key` (b"": a record on the
        way is missing or unreadable)."""
        parts = []
        rec = self.records.get(key)
        while rec is not None and rec.start >= 0:
            parts.append(rec.tokens)
            if rec.start == 0:
                return b"".join(reversed(parts))
            up = self.records.get(rec.parent)
            rec = up if up is not None and up.end == rec.start else None
        return b""

    def _remove(self, removed: list[bytes], chains: list[bytes]) -> None:
        for key in removed:  # every chain first: a removed record may be on the way of another
            _discard(chains, self._prefix(key))
        parents = []
        for key in removed:
            rec = self.records.pop(key)
            self.kids.pop(key, None)
            self._cut.pop(key, None)
            off = self._off.get(rec.parent)
            if off is not None:
                off.discard(key)
                if not off:
                    del self._off[rec.parent]
                parents.append(rec.parent)  # a chain it held inside may be an end again
            n = self.kids.get(rec.parent, 0) - 1
            if n > 0:
                self.kids[rec.parent] = n
            else:
                self.kids.pop(rec.parent, None)
                parents.append(rec.parent)
        for key in parents:  # nothing follows them now: ends of chains
            if key in self.records and key not in self.kids:
                _insert(chains, self._prefix(key))
            for end in self._off.get(key, ()):
                if end not in self.kids:
                    _insert(chains, self._prefix(end))

    def _add(self, metas: list[tuple[bytes, bytes, Any]], chains: list[bytes]) -> None:
        metas.sort(key=lambda m: m[2].start if m[2] is not None else 0)  # parents first
        for parent, key, meta in metas:
            self.records[key] = rec = _Record(parent, meta)
            if self.block and rec.end % self.block:
                self._off.setdefault(parent, set()).add(key)
            was = self.kids.get(parent, 0)
            self.kids[parent] = was + 1
            if not was and parent in self.records:  # its chain goes on in this one
                _discard(chains, self._prefix(parent))
        for _, key, _ in metas:
            if key not in self.kids:
                _insert(chains, self._prefix(key))

    def prefixes(self, *, max_tokens: int, limit: int) -> list[tuple[bytes, int]]:
        """As BlockStore.learned_prefixes says them, from what is known (nothing read): the most
        recently learned `limit` learned prefixes (a record that ends off a block boundary, or
        that nothing follows), each cut at `max_tokens`, with its stored length. The cut
        prefixes of those given last time are given again (the same objects)."""
        with self._lock:
            block = self.block or 1
            ends = heapq.nlargest(
                limit,
                ((r.last_used, k) for k, r in self.records.items()
                 if r.start >= 0 and (r.end % block or k not in self.kids)),
            )  # fmt: skip
            out, cut = [], {}
            for _, key in ends:
                got = self._cut.get(key)
                if got is None:
                    got = tk.cut(self._prefix(key), 0, max_tokens)
                if got:
                    cut[key] = got
                    out.append((got, self.records[key].end))
            self._cut = cut
            return out


def _discard(chains: list[bytes], chain: bytes) -> None:
    i = bisect.bisect_left(chains, chain)
    if chain and i < len(chains) and chains[i] == chain:
        del chains[i]


def _insert(chains: list[bytes], chain: bytes) -> None:
    """Put `chain` in sorted `chains` unless one there extends it (it would follow it); one it
    extends (it would precede it) goes (as `leaf_chains` leaves them)."""
    i = bisect.bisect_left(chains, chain)
    if not chain or (i < len(chains) and chains[i].startswith(chain)):
        return
    if i and chain.startswith(chains[i - 1]):
        chains[i - 1] = chain
    else:
        chains.insert(i, chain)


_VIEWS: weakref.WeakValueDictionary[tuple[str, bytes], LearnedChains] = (
    weakref.WeakValueDictionary()
)
_VIEWS_LOCK = threading.Lock()


def learned_chains(home: Path, fingerprint: bytes) -> LearnedChains:
    """The process's `LearnedChains` of this home's model (one, shared by the cold tier and the
    reasons' reader while either holds it)."""
    key = (str(home), bytes(fingerprint))
    with _VIEWS_LOCK:
        view = _VIEWS.get(key)
        if view is None:
            view = _VIEWS[key] = LearnedChains(bytes(fingerprint))
        return view
