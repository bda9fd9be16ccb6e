"""Where hydrate time goes: cProfile of Store.load + LRUPromptCache.insert_cache of one large
kv28-f16 entry (the per-entry work of client.hydrate), after warm-up rounds.

    python -m bench.profile_hydrate [--mb 235] [--reps 10]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

from bench.shapes import KV28_F16, MB, make_cache
from kvstore import codec
from kvstore.keys import entry_key, pack_tokens
from kvstore.store import Store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=235, help="entry size in MiB")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    tokens = KV28_F16.tokens_for(args.mb * MB)
    ids = list(range(tokens))
    with tempfile.TemporaryDirectory(prefix="kvprofile-") as tmp, Store(Path(tmp)) as store:
        blob = codec.encode(make_cache(KV28_F16, tokens))
        meta = store.put(entry_key(b"\x01" * 16, ids), blob, tokens=pack_tokens(ids))

        def hydrate_one() -> None:
            _, cache = store.load(meta.key, meta.tokens)
            LRUPromptCache().insert_cache("m", ids, cache, cache_type="system")

        for _ in range(3):
            hydrate_one()
        t = time.perf_counter()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.reps):
            hydrate_one()
        profile.disable()
        dt = (time.perf_counter() - t) / args.reps
        mx.clear_cache()
    print(
        f"{len(blob) / MB:.0f} MiB entry: {dt * 1e3:.1f} ms per hydrate under the profiler "
        f"({len(blob) / dt / 1e9:.1f} GB/s)"
    )
    pstats.Stats(profile).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
