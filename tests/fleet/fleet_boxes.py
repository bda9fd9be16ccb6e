"""The fleet tests' boxes: homes whose settings point at a server, the remote and upload queue
a box sees, a stored KV entry of a chosen size; and the test server's keys (bench.weed)."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import mlx.core as mx

from bench.weed import ACCESS_KEY, ADMIN_KEY, ADMIN_SECRET, BUCKET, SECRET_KEY, Weed

__all__ = ["ACCESS_KEY", "ADMIN_KEY", "ADMIN_SECRET", "BUCKET", "SECRET_KEY", "Weed"]
__all__ += ["big_entry", "box", "queue_counts", "remote_of", "store_chain"]
__all__ += ["FLEET_KEY", "chat", "keyed"]

FLEET_KEY = secrets.token_hex(32)  # the fleet key the read-through and learning tests' boxes share


def chat(n: int, seed: int = 3) -> list[int]:
    """`n` token ids of a made-up chat (ids 1-200: every tiny model's vocabulary has them)."""
    return [(7 * i + seed) % 200 + 1 for i in range(n)]


def keyed(home: Path, key: str = FLEET_KEY) -> Path:
    """`home` (a `box`) with a fleet key in its s3.toml."""
    creds = home / "s3.toml"
    creds.write_text(creds.read_text() + f'fleet_key = "{key}"\n')
    return home


def box(
    home: Path,
    server: Weed,
    *,
    key: str = ACCESS_KEY,
    secret: str = SECRET_KEY,
    allow_unsigned: bool = True,
    **remote,
) -> Path:
    """A home (one box of the fleet) whose settings.toml points at `server`. Without a fleet key
    (test_fleet_trust.keyed gives one) a box refuses every object unless `allow_unsigned`: the
    tests of the tier itself take them (True), the tests of that refusal pass False."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    creds = home / "s3.toml"
    creds.write_text(f'access_key_id = "{key}"\nsecret_access_key = "{secret}"\n')
    creds.chmod(0o600)
    table = dict(endpoint=server.endpoint, bucket=BUCKET, prefix="team", credentials=str(creds),
                 retry_interval=0.2, connect_timeout=1.0)  # fmt: skip
    table.update(remote)
    lines = [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    top = "allow_unsigned = true\n" if allow_unsigned else ""
    (home / "settings.toml").write_text(top + "[remote]\n" + "\n".join(lines) + "\n")
    return home


def remote_of(home: Path):
    from kvstore.fleet.objects import Remote
    from kvstore.fleet.remote_settings import remote_settings
    from kvstore.home.settings import load_settings

    return Remote(remote_settings(load_settings(home), home))


def queue_counts(home: Path) -> dict:
    from kvstore.fleet.queue import UploadQueue

    q = UploadQueue(home)
    try:
        return q.counts()
    finally:
        q.close()


def big_entry(store, fp: bytes, tokens: int, seed: int = 0) -> bytes:
    """A real KVCache of `tokens` tokens (8 heads x 128, float16: 4 KiB a token), stored."""
    from mlx_lm.models.cache import KVCache

    from kvstore.codec import codec
    from kvstore.store.entry import entry_key, pack_tokens

    mx.random.seed(seed)
    c = KVCache()
    kv = [mx.random.normal((1, 8, tokens, 128)).astype(mx.float16) for _ in range(2)]
    c.update_and_fetch(*kv)
    mx.eval(c.keys, c.values)
    ids = [(seed * 7919 + i) % 30000 for i in range(tokens)]
    key = entry_key(fp, ids)
    blob = codec.encode([c], {})
    store.put(key, blob, tokens=pack_tokens(ids), label=f"big{seed}", model="m",
              classes=codec.cache_classes([c]))  # fmt: skip
    return key


def store_chain(
    home: Path, cache, tokens: list[int], fp: bytes, model_path, start: int = 0
) -> None:
    """`cache` (the KV of `tokens`) stored in `home` as learned block records from `start`, as
    a box that served those tokens learns them."""
    from kvstore.learned.blockstore import BlockStore
    from kvstore.learned.chain import cuts
    from kvstore.learned.records import slice_record
    from kvstore.store.store import Store

    rows = [(s, e, slice_record(cache, s, e)) for s, e in cuts(start, len(tokens))]
    with Store(home) as store:
        BlockStore(store).put_records(fp, tokens, rows, label="learned",
                                      extra={"model": str(model_path)})  # fmt: skip
