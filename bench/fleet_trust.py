"""What the fleet key costs: sealing an object (HMAC-SHA256 over header, meta, blob and
provenance, as the uploader does) and verifying one as a box that holds the key does, against the
structural verification every fetched object gets anyway (checksum and a full decode), on real
KVCache entries of a few sizes (8 heads x 128, float16: 4 KiB a token and layer).

And what the semantic check costs per fetched entry (kvstore.fleet.check.check_cache: a
re-prefill of its first 64 positions and the comparison, as the client runs it at start before it
inserts a pending entry, or a warm that loaded the model), against prefilling the whole entry
(what the fetch spares), on the tiny llama and on a bigger random-weight llama made in memory.

And what the check adds to an app's start (`--start`): `kvstore.client.load` of the tiny llama
over a store of fetched pins still pending their check (checked, then the verdicts recorded in the
store), against the next start, when they have passed and are inserted as they are.

    python -m bench.fleet_trust [--check-only | --start]
    python -m bench.run --quick --only fleet_trust   # the tiny llama's check only, smaller seals
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvstore.codec import codec
from kvstore.fleet.objects import object_header, seal, verify_object
from kvstore.fleet.remote_settings import RemoteSettings
from kvstore.store.entry import EntryMeta, entry_key, pack_tokens

SIZES = (1024, 8192, 32768)  # tokens: 4 MiB, 32 MiB, 128 MiB of KV
REPEATS = 3


def _entry(tokens: int) -> tuple[bytes, bytes, EntryMeta]:
    import xxhash

    c = KVCache()
    kv = [mx.random.normal((1, 8, tokens, 128)).astype(mx.float16) for _ in range(2)]
    c.update_and_fetch(*kv)
    mx.eval(c.keys, c.values)
    ids = [i % 30000 for i in range(tokens)]
    key = entry_key(bytes(16), ids)
    blob = codec.encode([c], {})
    now = time.time()
    meta = EntryMeta(key=key, tokens=pack_tokens(ids), ntokens=tokens, label="bench", pinned=True,
                     model="m", fingerprint=bytes(16), template_hash=bytes(16), created=now,
                     last_used=now, hits=0, nbytes=len(blob),
                     checksum=xxhash.xxh3_64_intdigest(blob), codec=codec.CODEC_VERSION,
                     classes=codec.cache_classes([c]))  # fmt: skip
    return key, blob, meta


def _best(fn, *args, **kw) -> float:
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn(*args, **kw)
        times.append(time.perf_counter() - t)
    return min(times)


def seal_costs(sizes: tuple[int, ...] = SIZES) -> list[dict]:
    """Seal, verify and verify with the key, per entry size (tokens)."""
    k = secrets.token_bytes(32)
    keyed = RemoteSettings(endpoint="http://x", bucket="b", box_id="box-bench", fleet_keys=(k,))
    rows = []
    for tokens in sizes:
        key, blob, meta = _entry(tokens)
        body = object_header(meta) + blob
        data = body + seal(keyed, body)
        rows.append({
            "tokens": tokens,
            "mib": len(data) / 2**20,
            "seal_s": _best(seal, keyed, body),
            "verify_s": _best(verify_object, key, data, unsigned=True),  # checksums only
            "verify_keyed_s": _best(verify_object, key, data, keys=(k,)),
        })  # fmt: skip
    return rows


# (name, llama config overrides over kvstore.tiny's): the tiny test model, and a bigger one
CHECK_MODELS = (
    ("tiny llama (2 layers x 64)", {}),
    ("llama 8 layers x 512", dict(hidden_size=512, num_hidden_layers=8,
                                  intermediate_size=1408, num_attention_heads=8,
                                  num_key_value_heads=4, head_dim=64)),
)  # fmt: skip
CHECK_SIZES = (148, 1024, 2048)  # tokens of the fetched entry (148: the tests' classify pin)


def check_costs(models: tuple = CHECK_MODELS) -> Iterator[dict]:
    from kvstore import mlxlm
    from kvstore.fleet.check import check_cache
    from kvstore.identity.model import ModelIdentity
    from kvstore.kvcheck.prefill import prefill
    from kvstore.tiny import ARCHITECTURES

    identity = ModelIdentity("bench")
    for name, overrides in models:
        config = {**ARCHITECTURES["llama"], **overrides}
        model_class, args_class = mlxlm.model_classes(config)
        mx.random.seed(0)
        model = model_class(args_class.from_dict(config))
        mx.eval(model.parameters())
        prefill(model, [1, 2, 3], identity=identity)  # the first forward's graph set-up, once
        for tokens in CHECK_SIZES:
            ids = [(7 * i) % 500 + 3 for i in range(tokens)]
            t = time.perf_counter()
            stored = prefill(model, ids, identity=identity)
            full = time.perf_counter() - t
            check = _best(check_cache, model, identity, ids, stored)
            assert check_cache(model, identity, ids, stored).ok
            yield {"model": name, "tokens": tokens, "prefill_s": full, "check_s": check}


START_PINS = 8  # fetched pins in the store, each a distinct system prompt (~100 to ~600 tokens)


def start_cost() -> dict:
    """Seconds of `kvstore.client.load` with START_PINS pending entries, then with them passed."""
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    from kvstore.client import load
    from kvstore.ops.warm import warm
    from kvstore.pins.manifest import load_manifest
    from kvstore.store.entry import CHECK_PENDING, FLEET_CHECK
    from kvstore.store.store import Store
    from kvstore.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "model", "llama")
        home = root / "home"
        home.mkdir(mode=0o700)
        words = "Answer the request in order, name what decided it and keep the reply short. "
        pins = "".join(
            f'[[model.prefix]]\nname = "stage{i}"\n'
            f'messages = [{{ role = "system", content = "Stage {i}. {words * (2 + 3 * i)}" }}]\n'
            for i in range(START_PINS)
        )
        (root / "m.toml").write_text(f'[[model]]\npath = "{model}"\n{pins}')
        with Store(home) as store:  # as a read-through stores them: another box's, pending
            warm(load_manifest(root / "m.toml"), store, home=home)
            pending = {FLEET_CHECK: CHECK_PENDING, "origin": "remote", "uploader": "box-bench"}
            store.edit_meta({k: lambda m: replace(m, extra=m.extra.updated(pending))
                             for k in store.keys()})  # fmt: skip
            tokens = sum(m.ntokens for m in store.metas())
        load(str(model), home=root / "empty", warm=False, stats=False)[2].close()  # imports, once
        times = []
        for _ in range(2):
            t = time.perf_counter()
            _, _, cache = load(str(model), home=home, warm=False, stats=False)
            times.append(time.perf_counter() - t)
            assert cache.report.entries == START_PINS, cache.report
            cache.close()
    return {"pins": START_PINS, "tokens": tokens, "pending_s": times[0], "passed_s": times[1]}


def run(quick: bool) -> dict:
    """All three for bench.run; quick: the tiny llama's check only, entries up to 32 MiB."""
    seals = seal_costs(SIZES[:2] if quick else SIZES)
    checks = list(check_costs(CHECK_MODELS[:1] if quick else CHECK_MODELS))
    start = start_cost()
    for r in seals:
        print(f"  seal {r['mib']:.1f} MiB {r['seal_s']:.3f}s, verify {r['verify_s']:.3f}s, with "
              f"the key {r['verify_keyed_s']:.3f}s", flush=True)  # fmt: skip
    for r in checks:
        print(f"  check {r['model']}, {r['tokens']} tokens: {r['check_s']:.4f}s (prefill "
              f"{r['prefill_s']:.3f}s)", flush=True)  # fmt: skip
    print(f"  client.load over {start['pins']} pending pins {start['pending_s']:.3f}s, passed "
          f"{start['passed_s']:.3f}s", flush=True)  # fmt: skip
    return {"seal": seals, "check": checks, "start": start}


def targets(res: dict) -> list[dict]:
    """bench.run's rows (context: what the fleet key and the semantic check cost)."""
    rows = []

    def add(name, value, unit, note=""):
        rows.append({"target": name, "measured": value, "unit": unit, "ok": None, "note": note})

    for r in res["seal"]:
        add(
            f"fleet key: verify with the key, {r['mib']:.0f} MiB object",
            round(r["verify_keyed_s"], 4),
            "s",
            f"seal {r['seal_s']:.4f} s, verify without the key {r['verify_s']:.4f} s",
        )
    for r in res["check"]:
        add(
            f"semantic check of a fetched entry: {r['model']}, {r['tokens']} tokens",
            round(r["check_s"], 4),
            "s",
            f"prefilling it: {r['prefill_s']:.3f} s",
        )
    st = res["start"]
    add(
        f"kvstore.client.load over {st['pins']} fetched pins pending their check (tiny llama)",
        round(st["pending_s"], 3),
        "s",
        f"{st['passed_s']:.3f} s once they passed",
    )
    return rows


def main() -> None:
    import sys

    if "--start" in sys.argv:
        r = start_cost()
        print(f"kvstore.client.load over {r['pins']} fetched pins ({r['tokens']} tokens), tiny "
              f"llama: {r['pending_s']:.3f}s pending their check, {r['passed_s']:.3f}s once passed "
              f"(the check: {r['pending_s'] - r['passed_s']:.3f}s, "
              f"{(r['pending_s'] - r['passed_s']) / r['pins'] * 1e3:.1f} ms a pin)")  # fmt: skip
        return

    print("semantic check per fetched entry (first 64 positions re-prefilled and compared):")
    print(f"{'model':28} {'tokens':>7} {'prefill':>9} {'check':>9} {'share':>6}")
    for r in check_costs():
        print(f"{r['model']:28} {r['tokens']:7d} {r['prefill_s']:8.3f}s {r['check_s']:8.4f}s "
              f"{r['check_s'] / r['prefill_s']:6.1%}", flush=True)  # fmt: skip
    if "--check-only" in sys.argv:
        return
    print()
    print(f"{'tokens':>7} {'MiB':>7} {'seal':>8} {'verify':>8} {'+MAC':>8} {'MAC share':>9}")
    for r in seal_costs():
        extra = r["verify_keyed_s"] - r["verify_s"]
        print(f"{r['tokens']:7d} {r['mib']:7.1f} {r['seal_s']:7.3f}s {r['verify_s']:7.3f}s "
              f"{r['verify_keyed_s']:7.3f}s {extra / r['verify_keyed_s']:8.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
