"""The reliability battery's shared parts: trial counts, entries whose content follows from their
key, a reader process, and the figures file the battery writes.

`make test` runs every part at its quick scale; `make stress` sets KVSTORE_STRESS=1 and the same
code runs at full scale. Run as a script (`python battery.py reader HOME STOPFILE`) it is one of
the concurrent LMDB readers of the concurrency test.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

STRESS = os.environ.get("KVSTORE_STRESS") == "1"
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / ("reliability.json" if STRESS else "reliability-quick.json")

FINGERPRINT = b"reliability-fp00"  # 16 bytes: the store never interprets it

FIGURES: dict[str, dict[str, Any]] = {}


def scale(quick: int, full: int) -> int:
    """A trial count: `quick` in make test, `full` in make stress."""
    return full if STRESS else quick


def record(part: str, **figures: Any) -> None:
    """Add figures of one part of the battery to the results file of this session."""
    FIGURES.setdefault(part, {}).update(figures)


def write_figures() -> Path | None:
    if not FIGURES:
        return None
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "mode": "stress" if STRESS else "quick",
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "parts": dict(sorted(FIGURES.items())),
    }
    RESULTS.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return RESULTS


def summary_lines() -> list[str]:
    out = []
    for part, figs in sorted(FIGURES.items()):
        shown = ", ".join(f"{k}={_short(v)}" for k, v in figs.items() if not isinstance(v, dict))
        out.append(f"{part}: {shown}")
    return out


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 6:
        return f"[{len(v)} items]"
    return str(v)


# -- entries whose content follows from their key ----------------------------------------------


ROWS = 2  # every battery entry holds 2 tokens ([seed, 7]): its KV must cover exactly those


def kv_rows(
    seed: int, version: int, nbytes: int, rows: int = ROWS
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic uint8 keys and values of about `nbytes` in all, shaped (1, 1, rows, width):
    the size goes into the row width, so the KV always covers exactly the entry's tokens."""
    width = max(1, nbytes // (2 * rows))
    raw = np.random.default_rng([seed, version]).integers(0, 256, 2 * rows * width, np.uint8)
    return raw[: rows * width].reshape(1, 1, rows, width), raw[rows * width :].reshape(
        1, 1, rows, width
    )


def blob_of(keys: np.ndarray, values: np.ndarray) -> bytes:
    """The safetensors bytes `codec.encode` writes for one KVCache of these uint8 rows, built
    with numpy alone: a forked writer child must not run mlx."""
    s = keys.shape[2]
    n = keys.nbytes
    header = {
        "0.0": {"data_offsets": [4, 4 + n], "dtype": "U8", "shape": list(keys.shape)},
        "0.1": {"data_offsets": [4 + n, 4 + 2 * n], "dtype": "U8", "shape": list(values.shape)},
        "0.2": {"data_offsets": [0, 4], "dtype": "I32", "shape": []},
        "__metadata__": {"1.0": "KVCache", "2.0": "", "2.1.0": "0.2", "2.1.1": "scalar"},
    }
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    offset = np.array([s], dtype="<i4").tobytes()
    return len(raw).to_bytes(8, "little") + raw + offset + keys.tobytes() + values.tobytes()


def entry(
    seed: int, nbytes: int, *, version: int = 0, tokens: list[int] | None = None
) -> tuple[bytes, bytes, dict[str, Any]]:
    """(key, blob, put fields): the first token is the seed, so a reader can re-derive the blob;
    `version` (in meta.extra) lets one key be overwritten with other content."""
    from kvstore.store.entry import entry_key, pack_tokens

    tokens = [seed, 7] if tokens is None else tokens
    blob = blob_of(*kv_rows(seed, version, nbytes, len(tokens)))
    fields = dict(
        tokens=pack_tokens(tokens),
        label=f"r{seed}",
        model="reliability",
        classes=["KVCache"],
        extra={"version": version, "size": nbytes, "source": "battery"},
    )
    return entry_key(FINGERPRINT, tokens), blob, fields


def verify_loaded(meta, cache) -> str | None:
    """Why a loaded entry is not what its key and meta say it must be (None: it is)."""
    seed = meta.token_ids()[0]
    version, size = (meta.extra.to_map().get(k) for k in ("version", "size"))  # unknown keys
    if not isinstance(version, int) or not isinstance(size, int):
        return f"{meta.key.hex()}: meta lacks version/size"
    keys, values = kv_rows(seed, version, size, meta.ntokens)
    got_k, got_v = np.array(cache[0].keys), np.array(cache[0].values)
    if got_k.shape != keys.shape or not np.array_equal(got_k, keys):
        return f"{meta.key.hex()}: keys differ from seed {seed} version {version}"
    if not np.array_equal(got_v, values):
        return f"{meta.key.hex()}: values differ from seed {seed} version {version}"
    return None


def verify_key(store, key: bytes) -> str | None:
    """Load one entry (checksum, decode) and compare it with what its key derives."""
    try:
        meta, cache = store.load(key)
    except KeyError:
        return f"{key.hex()}: missing"
    except Exception as e:
        return f"{key.hex()}: {type(e).__name__}: {e}"
    return verify_loaded(meta, cache)


# -- a concurrent LMDB reader ------------------------------------------------------------------


def reader_main(home: str, stop_file: str, out_file: str) -> None:
    """Read the store directly (read-only Store) until `stop_file` appears: every entry's meta,
    then each entry loaded and compared with what its key derives. Writes counts as JSON."""
    from kvstore.errors import StoreError
    from kvstore.store.store import Store

    counts = {"reads": 0, "scans": 0, "mismatches": 0, "errors": 0, "examples": []}
    store = None
    Path(out_file + ".ready").write_text("")  # imports done: the writes may start
    while not os.path.exists(stop_file):
        try:
            if store is None:
                store = Store(home, readonly=True)
            metas = store.metas()
            counts["scans"] += 1
            for m in metas[:: max(1, len(metas) // 16)]:  # a sample each pass: keep it moving
                try:
                    meta, cache = store.load(m.key)
                except KeyError:
                    continue  # evicted since the scan: not an error
                counts["reads"] += 1
                if why := verify_loaded(meta, cache):
                    counts["mismatches"] += 1
                    counts["examples"].append(why)
        except StoreError as e:
            if "no store here" in str(e):
                time.sleep(0.01)
                continue
            counts["errors"] += 1
            counts["examples"].append(f"{type(e).__name__}: {e}")
        except Exception as e:  # every other exception is unexpected and counted
            counts["errors"] += 1
            counts["examples"].append(f"{type(e).__name__}: {e}")
    if store is not None:
        store.close()
    counts["examples"] = counts["examples"][:5]
    Path(out_file).write_text(json.dumps(counts))


def hold_reader_main(home: str, ready_file: str) -> None:
    """Open a read transaction and hold it until killed (the dead-reader test SIGKILLs us)."""
    from kvstore.store.store import Store

    store = Store(home, readonly=True)
    txn = store.env.begin()
    txn.get(b"x", db=store._meta)  # the slot is taken at begin; touch the tree anyway
    Path(ready_file).write_text(str(os.getpid()))
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1] == "reader":
        reader_main(*sys.argv[2:5])
    elif sys.argv[1] == "hold":
        hold_reader_main(*sys.argv[2:4])
