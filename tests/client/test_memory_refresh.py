"""Serve's two periodic reads of the store's learned records are incremental (issue 34 item 6):
the cold tier's index of learned chains and the reasons' learned prefixes decode only the
records learned since their last read, never the whole learned set again, and say what a full
read (BlockStore.learned_prefixes) says. Finding which records came and went still walks the
model's `kids` rows, so the request path does that only now and then where it costs; a timer
does it for it."""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvstore import tokens as tk
from kvstore.learned.blockstore import BlockStore
from kvstore.learned.chain import cuts
from kvstore.learned.coldtier import ColdTier, LearnTarget
from kvstore.learned.index import LearnedChains, leaf_chains
from kvstore.learned.records import slice_record
from kvstore.store.store import Store

FP = bytes(range(16))
BLOCK = 256


def _records(n: int, start: int) -> list[tuple[int, int, bytes]]:
    c = KVCache()
    x = mx.arange(n * 4, dtype=mx.float32).reshape(1, 1, n, 4)
    c.update_and_fetch(x, -x)
    return [(s, e, slice_record([c], s, e)) for s, e in cuts(start, n)]


def _put(blocks: BlockStore, tokens: list[int]) -> None:
    start = blocks.stored_end(FP, tokens) // BLOCK * BLOCK
    if start < len(tokens):
        blocks.put_records(FP, tokens, _records(len(tokens), start), label="x")


def _full(blocks: BlockStore) -> list[bytes]:
    """What a full read says: every learned prefix, as the cold tier's index keeps them."""
    got = blocks.learned_prefixes(FP, max_tokens=1 << 40, limit=1 << 40)
    return leaf_chains([t for t, _ in got])


def test_a_second_read_decodes_only_the_records_learned_since(tmp_path):
    base = list(range(1, 600))
    with Store(tmp_path) as store:
        blocks = BlockStore(store, block=BLOCK)
        for i in range(8):
            _put(blocks, base + [1000 + i] * (30 + 40 * i))
        view = LearnedChains(FP)
        assert view.update(blocks)
        first = view.decoded
        assert first == blocks.stats()["records"] and view.chains == _full(blocks)
        assert not view.update(blocks) and view.decoded == first  # nothing changed: nothing read
        blocks.touch([m.key for m in blocks.records()])  # a change, but no record came or went
        assert not view.update(blocks) and view.decoded == first
        _put(blocks, base + [2000] * 300)  # one more chain: [512, 768) and [768, 899)
        assert view.update(blocks)
        assert view.decoded - first == 2  # before: every record of the model, again
        assert view.chains == _full(blocks)


def test_what_it_keeps_follows_puts_and_evictions_as_a_full_read_says(tmp_path):
    rng = random.Random(3)
    systems = [[rng.randrange(1, 50_000) for _ in range(rng.randint(200, 700))] for _ in range(3)]
    with Store(tmp_path) as store:
        blocks = BlockStore(store, block=BLOCK)
        view = LearnedChains(FP)
        chats: list[list[int]] = []
        for step in range(40):
            if chats and rng.random() < 0.5:  # a chat's next turn extends it
                t = rng.choice(chats) + [
                    rng.randrange(1, 50_000) for _ in range(rng.randint(20, 300))
                ]
            else:
                t = rng.choice(systems) + [
                    rng.randrange(1, 50_000) for _ in range(rng.randint(5, 90))
                ]
            chats.append(t)
            _put(blocks, t)
            if step % 7 == 6:  # the learned budget evicts the least recently used leaves
                blocks.evict_learned(blocks.learned_bytes() * 2 // 3)
            view.update(blocks)
            assert view.chains == _full(blocks), step
            got = view.prefixes(max_tokens=1000, limit=1 << 30)
            full = blocks.learned_prefixes(FP, max_tokens=1000, limit=1 << 30)
            assert sorted(got) == sorted(full), step
        assert len(view.records) == blocks.stats()["records"]
        assert view.decoded < 2 * blocks.stats()["records"] + 40 * 6  # never the whole set again


def test_the_reasons_reader_gives_the_same_lists_until_something_is_learned(tmp_path):
    from kvstore.known import learned_reader, read_learned

    home = tmp_path
    with Store(home) as store:
        blocks = BlockStore(store, block=BLOCK)
        _put(blocks, list(range(1, 700)))
        read = learned_reader(home, FP)
        keys, ends = read()
        assert [tk.unpack(k) for k in keys] == [list(range(1, 700))] and ends == {}
        again = read()
        assert again[0] is keys and again[1] is ends  # nothing new: nothing decoded or built
        _put(blocks, list(range(1, 300)) + [7] * 100)
        keys2, _ = read()
        assert sorted(keys2) == sorted(read_learned(home, FP)[0]) and len(keys2) == 2
        assert keys[0] in keys2  # the prefix given before is given again, not rebuilt
        assert next(k for k in keys2 if k == keys[0]) is keys[0]


def test_a_models_index_holds_its_own_records_only(tmp_path):
    """The walk stops at the first `kids` row of another model: models stored before and after
    it in key order add nothing to its index."""
    before, after = bytes(16), bytes([255] * 16)
    with Store(tmp_path) as store:
        blocks = BlockStore(store, block=BLOCK)
        for fp in (before, FP, after):
            tokens = list(range(1, 700))
            blocks.put_records(fp, tokens, _records(len(tokens), 0), label="x")
        view = LearnedChains(FP)
        assert view.update(blocks)
        assert view.chains == _full(blocks) and len(view.records) == 3  # [0,256,512,699)
        with store.reading() as txn:
            links = blocks.links(txn, FP)
        assert len(links) == 3 and all(k.startswith(FP) for k in links)


def test_the_request_path_reads_a_costly_index_again_only_now_and_then(tmp_path):
    """A learning serve changes the store every request; reading the cold tier's index again
    walked every learned record of the model on the generation thread each time (13,000
    records: 24-50 ms a request in bench.index_walk; the default-budget soak averaged 20.3
    requests a second against 31.5 with the store kept small).
    Where a read costs, the request path keeps the index it has; the timer reads it."""
    with Store(tmp_path) as store:
        blocks = BlockStore(store, block=BLOCK)
        _put(blocks, list(range(1, 700)))
        cold = ColdTier(tmp_path)
        assert cold.blocks() is not None
        target = LearnTarget(fingerprint=FP, model="m", model_obj=None, extra={}, sliceable=True)
        try:
            first = cold.index(target)
            assert [tk.unpack(c) for c in first.chains] == [list(range(1, 700))]
            _put(blocks, list(range(1, 300)) + [7] * 100)  # the store changed
            first.cost = 1.0  # reading it cost a second (a store of many records)
            assert cold.index(target) is first  # the request path: the index it has
            timed = cold.index(target, timer=True)  # the timer (HIT_BATCH_S) reads it
            assert timed is not first and len(timed.chains) == 2
            _put(blocks, list(range(1, 300)) + [8] * 100)
            timed.cost = 0.0  # cheap to read: the request path reads it at once
            assert len(cold.index(target).chains) == 3
        finally:
            cold.close()
