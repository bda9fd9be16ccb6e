"""Request-path cost of persisting a pin with write-behind.

If client.PersistentPromptCache exists, it should be timed here; until it does, the pieces that
could run on the request path are timed: codec.encode of the prompt cache plus a queue put handing
the bytes to the writer thread, and the cheaper design, a snapshot of the state arrays (references:
mlx arrays are immutable values) plus a queue put, with encode moved to the writer thread.
The fsynced Store.put runs off the request path and is timed alongside for context.
"""

from __future__ import annotations

import queue
import tempfile
from pathlib import Path

from bench.shapes import HYBRID_9B, KV28_F16, MB, make_cache
from bench.timing import interleave
from kvstore import codec
from kvstore.keys import entry_key, pack_tokens
from kvstore.store import Store


def _alternatives(store: Store, cache: list, ids: list[int], blob: bytes) -> dict:
    q: queue.SimpleQueue = queue.SimpleQueue()

    def encode_enqueue():
        q.put((ids, codec.encode(cache)))

    def snapshot_enqueue():
        q.put((ids, [c.state for c in cache]))

    def store_put():  # what the writer thread does later
        store.put(entry_key(b"\x05" * 16, ids), blob, tokens=pack_tokens(ids))

    return {
        "encode+enqueue": encode_enqueue,
        "snapshot+enqueue": snapshot_enqueue,
        "Store.put (writer, off path)": store_put,
    }


def run(quick: bool) -> dict:
    try:
        from client import PersistentPromptCache  # noqa: F401

        have_ppc = True  # present, but its API was not settled when this was written
    except ImportError:
        have_ppc = False
    rows = []
    cases = [(KV28_F16, 64), (KV28_F16, 256), (HYBRID_9B, 256)]  # ~7 MB, 28 MB, ~57 MB
    if not quick:
        cases.append((KV28_F16, 2048))  # 224 MB
    with tempfile.TemporaryDirectory(prefix="kvbench-persist-") as tmp, Store(Path(tmp)) as store:
        for shape, tokens in cases:
            cache = make_cache(shape, tokens)
            ids = list(range(tokens))
            blob = codec.encode(cache)
            stats = interleave(_alternatives(store, cache, ids, blob), reps=5 if quick else 11)
            rows.append(
                {
                    "shape": shape.name,
                    "tokens": tokens,
                    "nbytes": len(blob),
                    "stats": {k: v.to_json() for k, v in stats.items()},
                }
            )
            st = "; ".join(f"{k} {v.ms()}" for k, v in stats.items())
            print(f"  persist {shape.name:18} {len(blob) / MB:6.1f} MB: {st}", flush=True)
    return {"PersistentPromptCache_present": have_ppc, "rows": rows}
