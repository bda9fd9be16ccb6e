"""Which of the decoder's two copy paths wins in a long-lived process, against load_prompt_cache.

    python -m bench.hydrate_paths [--mb 64] [--reps 9]

kvstore.codec.materialize copies a blob either per tensor (small blobs, or when mlx's buffer cache
already holds as many bytes as the blob: recycled pages) or into one buffer on copier threads
(large blobs in a process whose cache is still empty: fresh pages fault in parallel). Here each
path is forced in turn on the same stored entry (kv28-f16 and the qwen3.5-9b hybrid), Store.load +
insert_cache, interleaved with load_prompt_cache of the same bytes, all in this one process. Also
timed: the whole-blob xxh3 pass alone, and alongside an mlx copy of the same bytes on another
thread (whether the per-tensor path could hide its checksum).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache

from bench.hydrate import _store_entry
from bench.shapes import HYBRID_9B, KV28_F16, MB, Shape
from bench.timing import interleave
from kvstore.codec import materialize
from kvstore.store.entry import pack_tokens
from kvstore.store.store import Store


def compare(shape: Shape, size_mb: int, reps: int) -> dict[str, float]:
    home = Path(tempfile.mkdtemp()) / "home"
    key, ids, path, _ = _store_entry(home, shape, shape.tokens_for(size_mb * MB))
    packed, keep = pack_tokens(ids), {}
    large = materialize.LARGE_BYTES

    def via_store(per_tensor: bool):
        def run() -> None:
            materialize.LARGE_BYTES = 1 << 62 if per_tensor else large
            try:
                _, cache = store.load(key, packed)
            finally:
                materialize.LARGE_BYTES = large
            lru = LRUPromptCache()
            lru.insert_cache("m", ids, cache, cache_type="system")
            keep["kv"] = lru

        return run

    def via_lpc() -> None:
        cache = load_prompt_cache(str(path))
        mx.eval([c.state for c in cache])
        lru = LRUPromptCache()
        lru.insert_cache("m", ids, cache, cache_type="system")
        keep["lpc"] = lru

    with Store(home, readonly=True) as store:
        stats = interleave(
            {"as chosen": via_store(False), "per tensor": via_store(True), "lpc": via_lpc},
            reps=reps,
            before=lambda name: keep.clear(),
        )
    return {name: st.median * 1e3 for name, st in stats.items()}


def checksum_overlap(size_mb: int, reps: int) -> dict[str, float]:
    src = np.random.default_rng(0).integers(0, 255, size_mb * MB, dtype=np.uint8)

    def hash_it() -> None:
        materialize.checksum(src)

    def copy_it() -> None:
        mx.eval(mx.array(src))

    def both() -> None:
        t = threading.Thread(target=hash_it)
        t.start()
        copy_it()
        t.join()

    stats = interleave({"xxh3": hash_it, "copy": copy_it, "both": both}, reps=reps)
    return {name: st.median * 1e3 for name, st in stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    for shape in (KV28_F16, HYBRID_9B):
        ms = compare(shape, args.mb, args.reps)
        print(
            f"{shape.name} {args.mb} MB, long-lived: as chosen {ms['as chosen']:.1f} ms, "
            f"per tensor {ms['per tensor']:.1f} ms, load_prompt_cache {ms['lpc']:.1f} ms"
        )
    ms = checksum_overlap(args.mb, args.reps)
    print(
        f"{args.mb} MB: xxh3 {ms['xxh3']:.1f} ms, mlx copy {ms['copy']:.1f} ms, "
        f"both on two threads {ms['both']:.1f} ms"
    )


if __name__ == "__main__":
    main()
