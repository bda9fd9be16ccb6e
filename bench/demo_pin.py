"""The largest `make demo` pin: hydrate it from the store vs mlx_lm's load_prompt_cache of the
same bytes from a file, interleaved. Run `make demo` first; then `python -m bench.demo_pin`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache

from bench.timing import interleave
from kvstore.store.store import Store

HOME = Path(".demo/home")


def main() -> None:
    store = Store(HOME, readonly=True)
    meta = max(store.metas(), key=lambda m: m.nbytes)
    file = Path(tempfile.mkdtemp()) / "pin.safetensors"
    file.write_bytes(store.read_blob(meta.key))
    tokens = meta.token_ids()

    def insert(cache) -> None:
        mx.eval([c.state for c in cache])
        LRUPromptCache().insert_cache("m", tokens, cache, cache_type="system")

    stats = interleave(
        {
            # checksum, validation, one copy out of the LMDB page, evaluated, inserted
            "kvstore Store.load + insert": lambda: insert(store.load(meta.key, meta.tokens)[1]),
            "mlx_lm load_prompt_cache + insert": lambda: insert(load_prompt_cache(str(file))),
        },
        reps=50,
        warmup=5,
    )
    print(
        f"pin {meta.label!r}: {meta.ntokens} tokens, {meta.nbytes / 2**20:.2f} MiB, "
        f"classes {sorted(set(meta.classes))}"
    )
    for name, s in stats.items():
        print(f"{name:36} {s.ms()}  ({meta.nbytes / s.median / 1e9:.2f} GB/s)")
    a, b = stats.values()
    print(f"ratio load_prompt_cache / kvstore: {b.median / a.median:.2f}x")
    store.close()


if __name__ == "__main__":
    main()
