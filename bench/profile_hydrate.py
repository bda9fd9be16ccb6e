"""Where hydrate time goes. Two regimes:

    python -m bench.profile_hydrate --fresh [--mb 235]   # the first kvstore.client.hydrate of a
    new process
    python -m bench.profile_hydrate [--mb 235] [--reps 10]   # Store.load + insert, warmed up

--fresh stores one kv28-f16 entry under a real fingerprint (sparse model shards, Qwen3.5-9B's
config.json, the hash cache and the fingerprint's memo warm), then profiles the one
kvstore.client.hydrate call of a child interpreter, as an app restart makes it; the default
profiles the
per-entry work in this process after warm-up rounds (mlx's buffer cache then recycles the
destination memory).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(home: str, model: str) -> None:
    from mlx_lm.models.cache import LRUPromptCache

    from kvstore.client import hydrate

    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    rep = hydrate(LRUPromptCache(), "m", model, home=home)
    profile.disable()
    dt = time.perf_counter() - t
    assert rep.entries == 1, rep.warning
    print(f"first kvstore.client.hydrate of a new process: {dt * 1e3:.1f} ms under the profiler "
          f"({rep.nbytes / dt / 1e9:.2f} GB/s, {rep.nbytes / 2**20:.0f} MiB)")  # fmt: skip
    stats = pstats.Stats(profile)
    fingerprint = [v[3] for k, v in stats.stats.items() if k[2] == "model_fingerprint"]
    print(f"of which the model's fingerprint: {sum(fingerprint) * 1e3:.2f} ms")
    stats.sort_stats("tottime").print_stats(10)


def fresh(mb: int) -> None:
    from bench.coldstart import _store_entry
    from bench.fingerprint import make_model_dir
    from bench.shapes import KV28_F16, MB

    with tempfile.TemporaryDirectory(prefix="kvprofile-") as tmp:
        model = make_model_dir(Path(tmp) / "model", 64 * MB, shards=2)
        home = Path(tmp) / "home"
        _store_entry(home, model, KV28_F16, KV28_F16.tokens_for(mb * MB))
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        args = [sys.executable, "-m", "bench.profile_hydrate", "--child", str(home), str(model)]
        subprocess.run(args, env=env, check=True, capture_output=True)  # fills the hash cache
        subprocess.run(args, env=env, check=True)


def warm(mb: int, reps: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import LRUPromptCache

    from bench.shapes import KV28_F16, MB, make_cache
    from kvstore.codec import codec
    from kvstore.store.entry import entry_key, pack_tokens
    from kvstore.store.store import Store

    tokens = KV28_F16.tokens_for(mb * MB)
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
        for _ in range(reps):
            hydrate_one()
        profile.disable()
        dt = (time.perf_counter() - t) / reps
        mx.clear_cache()
    print(
        f"{len(blob) / MB:.0f} MiB entry: {dt * 1e3:.1f} ms per hydrate under the profiler "
        f"({len(blob) / dt / 1e9:.1f} GB/s)"
    )
    pstats.Stats(profile).sort_stats("tottime").print_stats(8)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(*sys.argv[2:4])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mb", type=int, default=235, help="entry size in MiB")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fresh", action="store_true", help="profile a new process's first hydrate")
    args = ap.parse_args()
    print(json.dumps(vars(args)))
    fresh(args.mb) if args.fresh else warm(args.mb, args.reps)


if __name__ == "__main__":
    main()
