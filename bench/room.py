"""What the first request through a stored prefix pays for the prefix having no spare room.

mlx-lm's KVCache grows 256 tokens at a time: a prefix it prefilled has room for the next
request's tokens, a hydrated one (or one `load_prompt_cache` read) holds exactly its own, so the
first request's update copies the whole prefix into a longer buffer. `kvstore.client.load` gives
its warmed pin that room (client/load.py, `give_room`). Here, in new interpreters,
alternating: a prefix of kv28-f16's layout (28 layers, 4 KV heads x 128, float16) held exactly
(as hydrated) or with 256 positions of room (as `give_room` leaves the warmed pin), copied as
LRUPromptCache.fetch_nearest_cache copies it, then one 40-token update of every layer, evaluated:
the request's cache work before its attention.

    python -m bench.room [--tokens 2000] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench.timing import in_fresh_process

LAYERS, HEADS, DIM, NEW = 28, 4, 128, 40


def _worker(argv: list[str]) -> None:
    import copy

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore.client.load import give_room

    room, n = argv[0] == "room", int(argv[1])
    cache = []
    for _ in range(LAYERS):
        c = KVCache()  # as a hydrated entry is: exactly n positions
        c.keys = mx.random.normal((1, HEADS, n, DIM)).astype(mx.float16)
        c.values = mx.random.normal((1, HEADS, n, DIM)).astype(mx.float16)
        c.offset = n
        cache.append(c)
    if room:  # what load's warm-up leaves: its request's grown copy, put back by give_room
        grown = copy.deepcopy(cache)
        one = mx.zeros((1, HEADS, 1, DIM), mx.float16)
        for c in grown:
            c.update_and_fetch(one, one)
        assert give_room(cache, grown)
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    new = mx.random.normal((1, HEADS, NEW, DIM)).astype(mx.float16)
    mx.eval(new)
    t = time.perf_counter()
    kv = copy.deepcopy(cache)  # what fetch_nearest_cache hands the request
    mx.eval([c.update_and_fetch(new, new) for c in kv])
    nbytes = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    print(json.dumps({"update_s": time.perf_counter() - t, "nbytes": nbytes}))


def run(tokens: int, reps: int) -> dict:
    samples: dict[str, list[float]] = {"exact": [], "room": []}
    nbytes = 0
    for r in range(reps):
        for name in ("exact", "room") if r % 2 == 0 else ("room", "exact"):
            res = in_fresh_process("bench.room", [name, str(tokens)])
            samples[name].append(res["update_s"])
            nbytes = nbytes or res["nbytes"]
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(
        f"  room: {tokens}-token prefix ({nbytes / 2**20:.0f} MiB), copy + first {NEW}-token "
        f"update: exactly its size {med['exact'] * 1e3:.1f} ms, with 256 positions of room "
        f"{med['room'] * 1e3:.1f} ms ({reps} new processes each)",
        flush=True,
    )
    return {"tokens": tokens, "nbytes": nbytes, "median_s": med, "samples_s": samples}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    else:
        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        ap.add_argument("--tokens", type=int, default=2000)
        ap.add_argument("--reps", type=int, default=5)
        a = ap.parse_args()
        print(json.dumps(run(a.tokens, a.reps), indent=1))
