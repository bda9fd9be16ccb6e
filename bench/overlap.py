"""Process start with and without kvstore: `kvstore.client.load` (weights and store entries
read at the same time) against `mlx_lm.load` alone, and against the two one after the other.

The model is generated here: random float16 weights in a real architecture (llama), >= 1 GiB at
full scale; entries of at least 0.5 GiB in total are stored under its real fingerprint. Each
alternative runs as one call in its own new interpreter, alternating, medians of N:
  mlx_lm.load         model and tokenizer, nothing hydrated (what an app without kvstore pays)
  kvstore.client.load         the same, plus a PersistentPromptCache hydrated on a second thread
  load, then hydrate  mlx_lm.load, then PersistentPromptCache.open(model, ...) hydrating after it
  load, then touch    mlx_lm.load, then as many new pages as the entries fill faulted in, as
                      kvstore's decoder allocates them (bench.coldstart.fault_in), nothing copied:
                      the floor after the load for a loader that puts the entries in process memory

    python -m bench.overlap [--full]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.timing import Stats, fresh_rounds, worker

MB = 2**20
ALTERNATIVES = ("mlx_lm.load", "kvstore.client.load", "load, then hydrate", "load, then touch")
# llama, float16: full ~1.3 GB of weights (663M parameters), quick ~0.23 GB
ARCH = {
    True: dict(hidden_size=1024, num_hidden_layers=4, intermediate_size=2752, vocab_size=32000),
    False: dict(hidden_size=2048, num_hidden_layers=12, intermediate_size=5504, vocab_size=32000),
}
ENTRIES_MB = {True: [64, 64], False: [256, 256]}


def start(argv: list[str]) -> dict:
    """One alternative's start in a new interpreter (`bench.timing.worker`): its call's seconds
    after the imports, the imports' seconds."""
    t_start = time.perf_counter()
    alternative, model, home, n = argv[0], argv[1], argv[2], int(argv[3])
    if alternative == "mlx_lm.load":
        from mlx_lm import load

        imported = time.perf_counter()
        load(model)
        hydrated = 0
    elif alternative == "kvstore.client.load":
        import kvstore.client.persistent  # noqa: F401  (imported before the timer, as the others' are)
        from kvstore.codec import idle_cores

        overlapped = idle_cores() >= 1  # what load decides (it reads the load average too)
        imported = time.perf_counter()
        _, _, cache = kvstore.client.load(model, home=home, stats=False)
        hydrated = cache.report.entries
        cache.close()
    elif alternative == "load, then touch":
        from mlx_lm import load

        from bench.coldstart import fault_in

        imported = time.perf_counter()
        load(model)
        fault_in(int(argv[4]))
        hydrated = n
    else:
        from mlx_lm import load

        from kvstore.client import PersistentPromptCache

        imported = time.perf_counter()
        m, tok = load(model)
        cache = PersistentPromptCache.open(m, tok, model, home=home, stats=False)
        hydrated = cache.report.entries
        cache.close()
    done = time.perf_counter()
    assert hydrated == (0 if alternative == "mlx_lm.load" else n), (alternative, hydrated)
    out = {"call_s": done - imported, "import_s": imported - t_start}
    if alternative == "kvstore.client.load":
        out["overlapped"] = overlapped
    return out


def make_model(path: Path, quick: bool) -> int:
    """A random-weight llama in float16 with a locally trained tokenizer; returns weight bytes."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import _get_classes, save_model

    from kvstore.tiny import write_tokenizer

    config = dict(
        model_type="llama",
        num_attention_heads=16,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="float16",
        **ARCH[quick],
    )
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))
    mx.eval(model.parameters())
    save_model(path, model)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _store_entries(home: Path, model: Path, sizes_mb: list[int]) -> int:
    from bench.shapes import KV28_F16, make_cache
    from kvstore.codec import codec
    from kvstore.home.settings import FILEHASH_NAME, ensure_home
    from kvstore.identity.fingerprint import FileHashCache, model_fingerprint
    from kvstore.store.entry import entry_key, pack_tokens
    from kvstore.store.store import Store

    ensure_home(home)
    fp = model_fingerprint(model, hash_cache=FileHashCache(home / FILEHASH_NAME)).digest
    total = 0
    with Store(home) as s:
        for i, mb in enumerate(sizes_mb):
            tokens = KV28_F16.tokens_for(mb * MB)
            ids = [i + 3, *range(10, 9 + tokens)]  # distinct first token: no entry prefixes another
            blob = codec.encode(make_cache(KV28_F16, tokens, seed=i))
            s.put(entry_key(fp, ids), blob, tokens=pack_tokens(ids), pinned=True, model=str(model))
            total += len(blob)
    return total


def run(quick: bool) -> dict:
    reps = 3 if quick else 5
    with tempfile.TemporaryDirectory(prefix="kvbench-overlap-") as tmp:
        root = Path(tmp)
        model, home = root / "model", root / "home"
        weights = make_model(model, quick)
        entries = _store_entries(home, model, ENTRIES_MB[quick])
        n = len(ENTRIES_MB[quick])
        args = (model, home, n, entries)
        # round 0 (untimed) fills the page cache and the layout cache
        samples = fresh_rounds({a: worker(start, a, *args) for a in ALTERNATIVES}, reps=reps)
    stats = {a: Stats.of([s["call_s"] for s in v]) for a, v in samples.items()}
    loads = samples["kvstore.client.load"]
    overlapped = sum(bool(s.get("overlapped")) for s in loads)
    process = {a: Stats.of([s["process_s"] for s in v]).median for a, v in samples.items()}
    base = stats["mlx_lm.load"].median
    out = {
        "weights_bytes": weights,
        "entries_bytes": entries,
        "stats": {a: st.to_json() for a, st in stats.items()},
        "process_s": process,
        "client_load_vs_mlx_lm_load": stats["kvstore.client.load"].median / base,
        "sequential_vs_mlx_lm_load": stats["load, then hydrate"].median / base,
        "touch_floor_vs_mlx_lm_load": stats["load, then touch"].median / base,
        "mode": f"beside the load in {overlapped} of {len(loads)} runs, else after it",
    }
    print(
        f"  overlap {weights / 2**30:.2f} GiB weights, {entries / 2**30:.2f} GiB entries: "
        + ", ".join(f"{a} {st.median:.2f} s" for a, st in stats.items())
        + f"  (kvstore.client.load x{out['client_load_vs_mlx_lm_load']:.3f} of mlx_lm.load; "
        f"read {out['mode']})",
        flush=True,
    )
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--full", action="store_true")
    print(json.dumps(run(not ap.parse_args().full), indent=1))
