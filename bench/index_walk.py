"""What a learning serve pays on the generation thread to read the cold tier's index again after
the store changed (bench/results/reference/soak-notes.md, "Found on the way"):
`LearnedChains.update` over a store of `--records` learned records of one model (default
13,000, what the default-budget soak reached), after a change where no record came or went (a
touch, as every hit makes) and after one left (an eviction). The records are tiny (4 floats a
token): the walk reads the `kids` rows, not the KV.

    python -m bench.index_walk [--records N]

Only `BlockStore.put_records`, `touch`, `evict_learned` and `LearnedChains.update` are used, so
the same command times the code before a change (e.g. on a checkout of 7406a1f) and after."""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

FP = bytes(range(16))
BLOCK = 256


def _build(blocks, records: int, rng: random.Random) -> None:
    """Chats over 3 system prompts, each turn extending an earlier chat, until `records`."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore.learned.chain import cuts
    from kvstore.learned.records import slice_record

    systems = [[rng.randrange(1, 50_000) for _ in range(600)] for _ in range(3)]
    chats: list[list[int]] = []
    while blocks.stats()["records"] < records:
        base = rng.choice(chats) if chats and rng.random() < 0.6 else rng.choice(systems)
        tokens = base + [rng.randrange(1, 50_000) for _ in range(rng.randint(100, 400))]
        chats = (chats + [tokens])[-200:]
        start = blocks.stored_end(FP, tokens) // BLOCK * BLOCK
        cache = KVCache()
        x = mx.zeros((1, 1, len(tokens), 4), dtype=mx.float16)
        cache.update_and_fetch(x, x)
        recs = [(s, e, slice_record([cache], s, e)) for s, e in cuts(start, len(tokens))]
        blocks.put_records(FP, tokens, recs, label="walk")


def _walk(view, blocks) -> float:
    t = time.perf_counter()
    view.update(blocks)
    return (time.perf_counter() - t) * 1e3


def run(records: int, repeats: int = 5) -> dict:
    from kvstore.learned.blockstore import BlockStore
    from kvstore.learned.index import LearnedChains
    from kvstore.store.store import Store

    with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp)) as store:
        blocks = BlockStore(store, block=BLOCK)
        _build(blocks, records, random.Random(7))
        view = LearnedChains(FP)
        first = _walk(view, blocks)
        touched, evicted = [], []
        for _ in range(repeats):
            blocks.touch([next(iter(view.records))])  # a change; no record came or went
            touched.append(_walk(view, blocks))
            blocks.evict_learned(blocks.learned_bytes() - 1)  # the least recently used leaf
            evicted.append(_walk(view, blocks))
        return {
            "records": len(view.records),
            "first_read_ms": round(first, 1),
            "after_a_touch_ms": round(statistics.median(touched), 1),
            "after_an_eviction_ms": round(statistics.median(evicted), 1),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=13_000)
    print(run(ap.parse_args().records))


if __name__ == "__main__":
    main()
