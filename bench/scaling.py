"""Scaling: kvstore.client.hydrate vs prefix length and vs store population (mostly other models'
entries); `kvstore ls` and `evict` at 10,000 entries; Store.put vs a raw write + fsync."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from click.testing import CliRunner
from mlx_lm.models.cache import LRUPromptCache

from bench.shapes import KV28_F16, MB, make_cache
from bench.timing import Stats, interleave
from kvstore.cli.main import main as cli
from kvstore.client import hydrate
from kvstore.codec import codec
from kvstore.home.settings import FILEHASH_NAME, ensure_home
from kvstore.identity.fingerprint import FileHashCache, model_fingerprint
from kvstore.store.entry import EntryMeta, entry_key, pack_tokens
from kvstore.store.store import Store


def _put_pins(home: Path, model: Path, lengths: list[int]) -> bytes:
    """Store kv28-f16 caches of `lengths` tokens under the tiny model's real fingerprint."""
    ensure_home(home)
    fp = model_fingerprint(model, hash_cache=FileHashCache(home / FILEHASH_NAME)).digest
    with Store(home) as s:
        for i, n in enumerate(lengths):
            # distinct first token (no pin prefixes another); ids inside the tiny model's
            # vocabulary (512), or hydrate rightly skips the entry
            ids = [i + 3] + [10 + j % 500 for j in range(n - 1)]
            s.put(
                entry_key(fp, ids),
                codec.encode(make_cache(KV28_F16, n, seed=i)),
                tokens=pack_tokens(ids),
                label=f"pin{i}",
                pinned=True,
                model=str(model),
            )
    return fp


def _populate_others(home: Path, n: int) -> None:
    """`n` small entries of 50 other models. One transaction: n fsynced puts would dominate the
    run, and what is measured here is reading past them, not writing them."""
    now = time.time()
    blob = os.urandom(1024)
    with Store(home) as s:

        def fill(txn):
            for i in range(n):
                fp = (i % 50 + 1).to_bytes(2, "big") * 8
                ids = [i, i + 1, i + 2]
                key = entry_key(fp, ids)
                meta = EntryMeta(
                    key=key,
                    tokens=pack_tokens(ids),
                    ntokens=3,
                    label=f"other-{i % 10}",
                    pinned=False,
                    model=f"/models/other-{i % 50}",
                    fingerprint=fp,
                    template_hash=b"",
                    created=now,
                    last_used=now,
                    hits=0,
                    nbytes=len(blob),
                    checksum=0,
                    codec=codec.CODEC_VERSION,
                    classes=[],
                )
                txn.put(key, blob, db=s._blob)
                txn.put(key, meta.pack(), db=s._meta)

        s._write(fill)


def _hydrate_fn(home: Path, model: Path):
    def fn():
        lru = LRUPromptCache(max_size=64)
        rep = hydrate(lru, "m", model, home=home)
        assert rep.warning is None and rep.entries, rep.warning
        return lru

    return fn


def vs_prefix(root: Path, model: Path, quick: bool) -> list[dict]:
    rows = []
    for n in [64, 256, 1024] + ([] if quick else [4096, 8192]):
        home = root / f"prefix-{n}"
        _put_pins(home, model, [n])
        st = interleave({"hydrate": _hydrate_fn(home, model)}, reps=5)["hydrate"]
        nbytes = n * KV28_F16.bytes_per_token
        rows.append(
            {"tokens": n, "nbytes": nbytes, "stats": st.to_json(), "gbps": nbytes / st.median / 1e9}
        )
        print(f"  scaling prefix {n:5d} tokens ({nbytes / MB:7.1f} MB): {st.ms()}", flush=True)
        shutil.rmtree(home)
    return rows


def vs_population(root: Path, model: Path, quick: bool) -> dict:
    fns = {}
    for n in (10, 1000, 10000):
        home = root / f"pop-{n}"
        _put_pins(home, model, [128] * 4)
        _populate_others(home, n - 4)
        fns[f"{n} entries"] = _hydrate_fn(home, model)
    stats = interleave(fns, reps=7 if quick else 15)
    base = stats["10 entries"].median
    out = {k: {"stats": v.to_json(), "overhead": v.median / base - 1} for k, v in stats.items()}
    for k, v in out.items():
        print(f"  scaling hydrate with {k:15}: {stats[k].ms()}  overhead {v['overhead']:+.1%}")
    return out


def admin_at_10k(root: Path) -> dict:
    home = root / "pop-10000"  # left by vs_population
    runner = CliRunner()

    def ls_json():
        r = runner.invoke(cli, ["ls", "--json", "--home", str(home)])
        assert r.exit_code == 0, r.output

    def ls_table():
        r = runner.invoke(cli, ["ls", "--home", str(home)])
        assert r.exit_code == 0, r.output

    stats = interleave({"ls --json": ls_json, "ls": ls_table}, reps=3)
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "kvstore", "ls", "--json", "--home", str(home)],
        check=True,
        capture_output=True,
    )
    ls_process = time.perf_counter() - t
    # evict 1,000 of the 10,000 (one label) from a copy each time, so every rep sees 10,000
    evict_s = []
    for _ in range(3):
        copy = root / "evict-copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(home, copy)
        t = time.perf_counter()
        r = runner.invoke(cli, ["evict", "--label", "other-3", "--home", str(copy)])
        evict_s.append(time.perf_counter() - t)
        assert r.exit_code == 0 and "evicted 1000 " in r.output, r.output
    out = {k: v.to_json() for k, v in stats.items()}
    out["evict --label (1,000 of 10,000)"] = Stats.of(evict_s).to_json()
    out["ls --json, new process"] = {"median": ls_process}
    for k, v in out.items():
        print(f"  admin at 10,000 entries: {k:32} {v['median']:.3f} s")
    return out


def _put_alternatives(store: Store, path: Path, size: int) -> dict:
    blob = os.urandom(size * MB)
    ids = list(range(size))
    key = entry_key(b"\x07" * 16, ids)

    def put():
        store.put(key, blob, tokens=pack_tokens(ids))

    def raw():
        with open(path, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())

    return {"Store.put": put, "write+fsync": raw}


def put_vs_fsync(root: Path, quick: bool) -> list[dict]:
    rows = []
    home = root / "put"
    ensure_home(home)
    for size in [1, 16, 64] + ([] if quick else [256]):
        with Store(home) as s:
            stats = interleave(_put_alternatives(s, root / "raw.bin", size), reps=5)
        row = {
            "size_mb": size,
            "stats": {k: v.to_json() for k, v in stats.items()},
            "gbps": {k: size * MB / v.median / 1e9 for k, v in stats.items()},
            "put_vs_raw": stats["Store.put"].median / stats["write+fsync"].median,
        }
        rows.append(row)
        print(
            f"  put {size:4d} MB: Store.put {stats['Store.put'].ms()}  write+fsync "
            f"{stats['write+fsync'].ms()}  ratio x{row['put_vs_raw']:.2f}",
            flush=True,
        )
    return rows


def run(quick: bool) -> dict:
    from kvstore.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvbench-scaling-") as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "model", "llama").resolve()
        return {
            "vs_prefix": vs_prefix(root, model, quick),
            "vs_population": vs_population(root, model, quick),
            "admin_10k": admin_at_10k(root),
            "put": put_vs_fsync(root, quick),
        }
