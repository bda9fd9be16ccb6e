"""What the fleet key costs: sealing an object (HMAC-SHA256 over header, meta, blob and
provenance, as the uploader does) and verifying one as a box that holds the key does, against the
structural verification every fetched object gets anyway (checksum and a full decode), on real
KVCache entries of a few sizes (8 heads x 128, float16: 4 KiB a token and layer).

    python -m bench.fleet_trust
"""

from __future__ import annotations

import secrets
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvstore.codec import codec
from kvstore.fleet.objects import object_header, seal, verify_object
from kvstore.fleet.settings import RemoteSettings
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


def run() -> list[dict]:
    k = secrets.token_bytes(32)
    keyed = RemoteSettings(endpoint="http://x", bucket="b", box_id="box-bench", fleet_keys=(k,))
    rows = []
    for tokens in SIZES:
        key, blob, meta = _entry(tokens)
        body = object_header(meta) + blob
        data = body + seal(keyed, body)
        rows.append({
            "tokens": tokens,
            "mib": len(data) / 2**20,
            "seal_s": _best(seal, keyed, body),
            "verify_s": _best(verify_object, key, data),
            "verify_keyed_s": _best(verify_object, key, data, keys=(k,)),
        })  # fmt: skip
    return rows


def main() -> None:
    print(f"{'tokens':>7} {'MiB':>7} {'seal':>8} {'verify':>8} {'+MAC':>8} {'MAC share':>9}")
    for r in run():
        extra = r["verify_keyed_s"] - r["verify_s"]
        print(f"{r['tokens']:7d} {r['mib']:7.1f} {r['seal_s']:7.3f}s {r['verify_s']:7.3f}s "
              f"{r['verify_keyed_s']:7.3f}s {extra / r['verify_keyed_s']:8.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
