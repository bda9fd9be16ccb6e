"""`put` (one entry) and `put_blocks` (learned records): the one write of each, from any command
or process (the daemon's handlers, a warm, `import`, `remote pull`). Each checks what it writes,
stores it, evicts the learned records a pin makes redundant and holds the byte budgets
(kvstore.ops.budget); both evict through kvstore.ops.evict. A client hands its put to the daemon
with `send` (`request` builds what it sends)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvstore import tokens as tk
from kvstore.errors import CodecError
from kvstore.identity.fingerprint import model_location, model_name, with_model_location
from kvstore.learned.blockstore import BlockStore, is_snapshot
from kvstore.learned.chain import chain_hashes, position_hash
from kvstore.learned.policy import MIN_LCP
from kvstore.ops.budget import Budget
from kvstore.ops.evict import EvictedRecord, evict, under_pin
from kvstore.store.entry import (
    KEY_BYTES,
    EntryExtra,
    EntryMeta,
    PutFields,
    blob_checksum,
    tokens_match_key,
)
from kvstore.store.store import Store
from kvstore.wire.daemon_client import DaemonClient
from kvstore.wire.messages import PutBlocksRequest, PutRequest


def check_request(req: PutRequest, *, max_bytes: int) -> PutFields:
    """The key, fields and size of a put, before its blob is read; its fields, checked."""
    key, tokens = req.key, req.fields.get("tokens")
    if len(key) != KEY_BYTES or not isinstance(tokens, bytes) or len(tokens) % tk.SIZE:
        raise ValueError(f"put: key must be {KEY_BYTES} bytes and tokens packed uint32")
    fields = PutFields.from_map(req.fields)
    # The key's second half is the tokens' hash: a mismatch would file KV under a lie.
    if not tokens_match_key(key, tokens):
        raise ValueError(f"put {key.hex()}: key does not match the entry's tokens")
    if not 0 < req.nbytes <= max_bytes:
        raise ValueError(f"put {key.hex()}: {req.nbytes} bytes is outside 1..max_bytes={max_bytes}")
    return fields


def check_blob(req: PutRequest, blob: Any) -> Any:
    """The blob (inline or streamed) is the one the request announced."""
    if len(blob) != req.nbytes or blob_checksum(blob) != req.checksum:
        raise ValueError(f"put {req.key.hex()}: blob length or checksum does not match")
    return blob


def check_kv(req: PutRequest, blob: bytes) -> None:
    """The blob decodes, and its KV covers exactly the entry's tokens: more or fewer would be
    served as the prefix it claims to be (a pure state-space cache keeps no offset to compare).
    Decodes: run it on the main thread (kvstore.daemon.writer on mlx and threads)."""
    from kvstore.codec import codec

    key = req.key
    try:
        cache, _ = codec.decode(blob, name=f"put {key.hex()}")
    except CodecError as e:
        raise ValueError(str(e)) from None
    layers = (req.fields.get("extra") or {}).get("kv_layers") or []
    if layers:  # a state-only snapshot: its KV layers are block records, stored empty here
        if not isinstance(layers, list) or not all(
            isinstance(i, int) and 0 <= i < len(cache) and cache[i].offset == 0 for i in layers
        ):
            raise ValueError(f"put {key.hex()}: extra.kv_layers must name empty KV layers")
        cache = [c for i, c in enumerate(cache) if i not in set(layers)]
    held, ntokens = codec.cache_tokens(cache), tk.count(req.fields["tokens"])
    if held != ntokens and not (held is None and codec.keeps_no_offset(cache)):
        what = f"the KV holds {held} tokens" if held is not None else "its layers disagree"
        raise ValueError(f"put {key.hex()}: {what}, but the entry is {ntokens} tokens")


def put(
    store: Store,
    key: bytes,
    blob: bytes,
    fields: PutFields,
    *,
    budget: Budget,
    after: Callable[[EntryMeta], object] | None = None,
    sent: PutRequest | None = None,
) -> EntryMeta:
    """Store one entry: its KV decoded and compared with its tokens first when it was `sent` by
    another process (a blob this process just encoded from a cache is not), then `after(meta)`
    (the daemon's accounting of what it stores) and the budgets held. A pin evicts the learned
    records of its own prefix (kvstore.ops.evict), daemon or not. The model was located by
    whoever built the fields (`located`)."""
    if sent is not None:
        check_kv(sent, blob)
    meta = store.put(key, blob, **fields.as_kwargs())
    if after is not None:
        after(meta)
    if meta.pinned and not is_snapshot(meta):  # the pin serves its prefix: stored once
        data = meta.tokens
        dropped = budget.blocks.drop_covered(meta.fingerprint, data, slack=MIN_LCP)
        # each tombstone names at most the pin's tokens (those past it, a few, are not the pin's)
        gone = [EvictedRecord(r, tk.cut(data, 0, r.end)) for r in dropped]
        evict(budget.home, under_pin(meta.label), records=gone)
    budget.enforce()
    return meta


def put_blocks(
    blocks: BlockStore, req: PutBlocksRequest, *, budget: Budget
) -> tuple[int, list[bytes]]:
    """Store learned records and hold the budgets; returns the bytes newly written and the
    records' keys."""
    fp, data = req.fingerprint, req.tokens
    rows = [(r.start, r.end, r.blob) for r in req.records]
    written = blocks.put_records(
        fp, data, rows, label=req.label, extra={"model": req.model, **req.extra}
    )
    hashes = chain_hashes(fp, data, blocks.block)
    keys = [fp + position_hash(fp, data, e, blocks.block, hashes) for _, e, _ in rows]
    budget.enforce()
    return written, keys


def located(fields: PutFields) -> PutFields:
    """`fields` with the model named by `model_name` (a relative path as its absolute folder)
    and where the model and adapter resolve here added to extra, unless it says already (the
    put's process's cwd and environment: the daemon's may resolve a path to something else)."""
    named = replace(fields, model=model_name(fields.model)) if fields.model else fields
    if fields.extra.model_dir is not None:
        return named
    where = model_location(fields.model, fields.extra.adapter)
    return replace(named, extra=EntryExtra.from_map({**where, **fields.extra.to_map()}))


def request(key: bytes, blob: bytes, fields: Mapping[str, Any]) -> PutRequest:
    """A put as the daemon takes it, its fields (PutFields, or a map sent as it is: the daemon
    checks what arrives, `check_request`) as a map. The model is located here, in the
    putting process's cwd and environment (the daemon's may resolve a relative path or hub id to
    something else, or not at all); the checksum lets the daemon tell the blob it received is
    the one sent."""
    return PutRequest(
        key=key,
        fields=with_model_location(dict(fields)),
        nbytes=len(blob),
        checksum=blob_checksum(blob),
        blob=blob,
    )


def send(client: DaemonClient, key: bytes, blob: bytes, fields: Mapping[str, Any]) -> EntryMeta:
    """Store an entry through the daemon (it checks, commits and holds the budget)."""
    reply = client.send(request(key, blob, fields))
    return EntryMeta.unpack(reply.key, reply.meta)


class LocalWriter:
    """A Store-shaped `put` that is the put operation on a store here (no daemon holds the home):
    for code written against Store (an import)."""

    def __init__(self, store: Store, home: Path):
        self.store, self.budget = store, Budget.of(store, home)

    def put(self, key: bytes, blob: bytes, **fields: Any) -> EntryMeta:
        return put(self.store, key, blob, located(PutFields.from_map(fields)), budget=self.budget)


class DaemonWriter:
    """A Store-shaped `put` that goes through the daemon (for code written against Store)."""

    def __init__(self, client: DaemonClient):
        self.client = client

    def put(self, key: bytes, blob: bytes, **fields: Any) -> EntryMeta:
        return send(self.client, key, blob, PutFields.from_map(fields))
