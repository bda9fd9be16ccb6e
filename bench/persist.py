"""Request-path cost of persisting a pin with write-behind.

Timed side by side: what client.PersistentPromptCache really does on the caller's thread when a
new pin is persisted (`_persist`: hand references to the evaluated cache to the write-behind
queue), the two designs it was chosen between (encode on the request path + enqueue the bytes;
enqueue a snapshot of the state arrays), and, for context, the fsynced Store.put that the
writer thread does later, off the request path.
"""

from __future__ import annotations

import queue
import tempfile
from pathlib import Path

from bench.shapes import HYBRID_9B, KV28_F16, MB, make_cache
from bench.timing import interleave
from kvstore.codec import codec
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store


def _alternatives(store: Store, cache: list, ids: list[int], blob: bytes, ppc) -> dict:
    q: queue.SimpleQueue = queue.SimpleQueue()
    serial = iter(range(1, 1 << 30))

    def persistent_prompt_cache():  # new tokens each time: a pin is offered once
        ppc._persist([next(serial), *ids], cache, label="bench", pinned=True)

    def encode_enqueue():
        q.put((ids, codec.encode(cache)))

    def snapshot_enqueue():
        q.put((ids, [c.state for c in cache]))

    def store_put():  # what the writer thread does later
        store.put(entry_key(b"\x05" * 16, ids), blob, tokens=pack_tokens(ids))

    return {
        "PersistentPromptCache._persist": persistent_prompt_cache,
        "encode+enqueue": encode_enqueue,
        "snapshot+enqueue": snapshot_enqueue,
        "Store.put (writer, off path)": store_put,
    }


def _persistent_prompt_cache(tmp: Path):
    """A real PersistentPromptCache on a tiny model, with no daemon: jobs are dropped by the
    worker after the request path handed them over, which is all that is timed here."""
    import logging

    from mlx_lm import load

    from kvstore.client import PersistentPromptCache
    from kvstore.tiny import make_tiny_model

    logging.getLogger("kvstore.client").setLevel(logging.ERROR)  # the one no-daemon warning
    path = make_tiny_model(tmp / "model", "llama")
    model, tokenizer = load(str(path))
    return PersistentPromptCache.open(model, tokenizer, path, home=tmp / "ppc-home", stats=False)


def run(quick: bool) -> dict:
    rows = []
    cases = [(KV28_F16, 64), (KV28_F16, 256), (HYBRID_9B, 256)]  # ~7 MB, 28 MB, ~57 MB
    if not quick:
        cases.append((KV28_F16, 2048))  # 224 MB
    with tempfile.TemporaryDirectory(prefix="kvbench-persist-") as tmp, Store(Path(tmp)) as store:
        ppc = _persistent_prompt_cache(Path(tmp))
        for shape, tokens in cases:
            cache = make_cache(shape, tokens)
            ids = list(range(tokens))
            blob = codec.encode(cache)
            stats = interleave(_alternatives(store, cache, ids, blob, ppc), reps=5 if quick else 11)
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
        ppc.close()
    return {"rows": rows}
