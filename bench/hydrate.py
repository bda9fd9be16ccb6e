"""Hydrate one stored entry into LRUPromptCache, against the other ways to get the same bytes.

Alternatives, interleaved per size, all in this one long-lived process (the first call in a new
process is bench.coldstart's):
  kvstore            Store.load (checksum, validate, one copy into mlx) + insert_cache: the work
                     kvstore.client.hydrate does per entry
  kvstore.client.hydrate     end to end: a new LRUPromptCache, fingerprint (hash and layout caches
  warm),
                     store open, scan, load, insert
  load_prompt_cache  mlx_lm's loader of the same bytes from a .safetensors file (page cache warm),
                     evaluated, + insert_cache
  read               read() of the file into a buffer: the floor for any file-based loader
  memcpy             np.copyto of the bytes: the memory-bandwidth floor

Two allocation regimes, because a restart and a long-lived process differ: "fresh" (mlx's buffer
cache cleared and new host buffers each time, so every byte lands in a newly faulted page, as in a
restarted process) and "reused" (allocations recycled, steady state).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache

from bench.fingerprint import make_model_dir
from bench.shapes import HYBRID_9B, KV28_F16, KV36_BF16, MB, Shape, make_cache
from bench.timing import interleave
from kvstore.client import hydrate
from kvstore.codec import codec
from kvstore.home.settings import FILEHASH_NAME, ensure_home
from kvstore.identity.fingerprint import FileHashCache, model_fingerprint
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store

QUICK_SIZES = [1, 4, 16, 64, 256]  # MB
FULL_SIZES = [1, 4, 16, 64, 256, 1024]
ALTERNATIVES = ("kvstore", "kvstore.client.hydrate", "load_prompt_cache", "read", "memcpy")


def _model(home: Path) -> Path:
    """Sparse shards and Qwen3.5-9B's config.json: a real fingerprint for the entries."""
    model = home / "model"
    if not (model / "config.json").is_file():
        make_model_dir(model, 64 * MB, shards=2)
    return model


def _store_entry(home: Path, shape: Shape, tokens: int) -> tuple[bytes, list[int], Path, int]:
    cache = make_cache(shape, tokens)
    blob = codec.encode(cache)
    del cache
    ids = list(range(tokens))
    ensure_home(home)
    fp = model_fingerprint(_model(home), hash_cache=FileHashCache(home / FILEHASH_NAME)).digest
    key = entry_key(fp, ids)
    with Store(home) as s:
        s.put(key, blob, tokens=pack_tokens(ids), label=shape.name, pinned=True)
    path = home / f"{shape.name}-{tokens}.safetensors"
    path.write_bytes(blob)  # the same bytes, as mlx_lm.cache_prompt would leave them
    return key, ids, path, len(blob)


def measure_one(home: Path, shape: Shape, size_mb: int, *, reps: int) -> list[dict]:
    """Both allocation regimes on one stored entry (building it is the slow part)."""
    tokens = shape.tokens_for(size_mb * MB)
    key, ids, path, nbytes = _store_entry(home, shape, tokens)
    packed = pack_tokens(ids)
    src = np.frombuffer(path.read_bytes(), np.uint8)
    out = []
    with Store(home, readonly=True) as store:
        for fresh in (True, False):
            out.append(_measure(store, key, ids, packed, path, src, nbytes, reps, fresh, home))
            out[-1].update(shape=shape.name, size_mb=size_mb, tokens=tokens)
    path.unlink()
    with Store(home) as s:
        s.delete([key])
    return out


def _measure(store, key, ids, packed, path, src, nbytes, reps, fresh, home) -> dict:
    keep: dict[str, object] = {}  # results stay alive until the next rep, as a hydrated LRU would
    reused = {"read": bytearray(nbytes), "memcpy": np.empty(nbytes, np.uint8)}

    def via_kvstore():
        _, cache = store.load(key, packed)
        lru = LRUPromptCache()
        lru.insert_cache("m", ids, cache, cache_type="system")
        keep["kvstore"] = lru

    def via_hydrate():
        lru = LRUPromptCache()
        rep = hydrate(lru, "m", _model(home), home=home)
        assert rep.entries == 1 and rep.warning is None, rep.warning
        keep["kvstore.client.hydrate"] = lru

    def via_lpc():
        cache = load_prompt_cache(str(path))
        mx.eval([c.state for c in cache])
        lru = LRUPromptCache()
        lru.insert_cache("m", ids, cache, cache_type="system")
        keep["load_prompt_cache"] = lru

    def via_read():
        buf = bytearray(nbytes) if fresh else reused["read"]
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
        keep["read"] = buf

    def via_memcpy():
        dst = np.empty(nbytes, np.uint8) if fresh else reused["memcpy"]
        np.copyto(dst, src)
        keep["memcpy"] = dst

    def before(name: str) -> None:
        keep.pop(name, None)
        if fresh:
            mx.clear_cache()  # drop mlx's recycled buffers: allocate as a new process would

    stats = interleave(
        dict(
            zip(
                ALTERNATIVES,
                (via_kvstore, via_hydrate, via_lpc, via_read, via_memcpy),
                strict=True,
            )
        ),
        reps=reps,
        before=before,
    )
    keep.clear()
    gbps = {n: nbytes / st.median / 1e9 for n, st in stats.items()}
    return {
        "nbytes": nbytes,
        "regime": "fresh" if fresh else "reused",
        "stats": {n: st.to_json() for n, st in stats.items()},
        "gbps": gbps,
        "kvstore_vs_load_prompt_cache": stats["load_prompt_cache"].median / stats["kvstore"].median,
        "hydrate_vs_load_prompt_cache": stats["load_prompt_cache"].median
        / stats["kvstore.client.hydrate"].median,
    }


def fixed_cost(home: Path) -> dict:
    """Per-entry cost with next to no bytes: Store.load + insert_cache of a 1-token kv28-f16
    entry (56 tensors, 112 KiB), and of a tiny 4-layer model's 16-token entry."""
    out = {}
    for shape, tokens in ((KV28_F16, 1), (Shape("tiny-4-layer", 4, 2, 32, mx.float16), 16)):
        key, ids, path, nbytes = _store_entry(home, shape, tokens)
        packed = pack_tokens(ids)
        with Store(home, readonly=True) as store:

            def one(key=key, packed=packed, ids=ids):
                _, cache = store.load(key, packed)
                LRUPromptCache().insert_cache("m", ids, cache, cache_type="system")

            st = interleave({"entry": one}, reps=60, warmup=5)["entry"]
        with Store(home) as s:
            s.delete([key])
        path.unlink()
        out[f"{shape.name}, {tokens} tokens, {nbytes // 1024} KiB"] = st.median * 1e3
    for k, v in out.items():
        print(f"  hydrate fixed cost per entry: {k}: {v:.3f} ms", flush=True)
    return out


def run(quick: bool) -> dict:
    sizes = QUICK_SIZES if quick else FULL_SIZES
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbench-hydrate-") as tmp:
        home = Path(tmp)
        for shape in (KV28_F16, KV36_BF16, HYBRID_9B):
            for size in sizes:
                if size * MB < shape.fixed_bytes * 1.2:
                    continue  # the hybrid's fixed state alone is ~49 MiB
                if quick and shape is KV36_BF16 and size not in (16, 256):
                    continue  # bf16 moves like f16; two points show it in the quick run
                reps = 3 if size >= 256 else 5 if size >= 64 else 9
                for row in measure_one(home, shape, size, reps=reps):
                    rows.append(row)
                    g = row["gbps"]
                    print(
                        f"  hydrate {shape.name:18} {size:5d} MB {row['regime']:6}: "
                        + "  ".join(f"{n} {g[n]:6.2f}" for n in ALTERNATIVES)
                        + f" GB/s  (x{row['kvstore_vs_load_prompt_cache']:.2f} vs lpc, "
                        f"end to end x{row['hydrate_vs_load_prompt_cache']:.2f})",
                        flush=True,
                    )
                mx.clear_cache()
        fixed = fixed_cost(home)
    return {"rows": rows, "fixed_cost_ms": fixed}
