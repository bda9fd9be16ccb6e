"""Learned block records on the fleet tier: `remote push` uploads each local record the remote
lacks as its own object, `remote pull` fetches a model's records this box lacks, each verified
in full (`kvstore.fleet.objects.verify_record`) before it is stored with `BlockStore.put_records`
(through the daemon's `put_blocks` when one runs: it is the one writer). A daemon with [remote]
uploading also sends each record its put_blocks stored, write-behind, through the upload queue
(`kvstore.fleet.queue.upload_one_record`), as it does entries; pulls stay explicit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore import tokens as tk
from kvstore.errors import KVStoreError, RemoteError
from kvstore.fleet.objects import Remote, verify_record
from kvstore.identity.model import entry_model_name
from kvstore.learned.blockstore import BlockStore
from kvstore.store.keys import fingerprint_of

if TYPE_CHECKING:
    from kvstore.store.store import Store

# what another box recorded about its own model path; this box's is put instead
_THAT_BOX = ("model", "model_dir", "adapter_dir")


def push_records(
    remote: Remote, store: Store, *, model: str | None = None, say: Callable[[str], None]
) -> dict[str, int]:
    """Upload every readable local record (of `model`: a name, `model_name`) the remote
    lacks. Counts: uploaded, exists, gone (missing, corrupt or cut off from its chain here)."""
    blocks = BlockStore(store)
    block = blocks.cut_at()
    counts = {"uploaded": 0, "exists": 0, "gone": 0}
    for meta in blocks.records():
        stored = entry_model_name(meta.extra.model or "", meta.extra.model_dir)
        if model is None or stored == model:
            counts[upload_record(remote, blocks, meta.key, block, say)] += 1
    return counts


def upload_record(
    remote: Remote,
    blocks: BlockStore,
    key: bytes,
    block: int,
    say: Callable[[str], None],
    *,
    replace: bool = False,
) -> str:
    """Upload the record `key` with the tokens before it: "uploaded", "exists", or "gone" (missing,
    corrupt or cut off from its chain here: `say` says which). `block`: the store's cut;
    `replace`: overwrite the remote's object (a re-seal)."""
    try:
        chain = blocks.chain_to(key)
    except KVStoreError as e:
        say(f"warning: {e}; not uploaded")
        return "gone"
    blobs = blocks.read_blobs(chain[-1:])
    if not blobs:
        say(f"warning: learned record {key.hex()} is corrupt locally; not uploaded")
        return "gone"
    prefix = b"".join(m.tokens for m in chain[:-1])
    return remote.upload_record(chain[-1], prefix, block, blobs[0], replace=replace)


def pull_records(
    remote: Remote,
    store: Store,
    fingerprint: bytes,
    *,
    model: str,
    extra: dict,
    put: Callable[[bytes, bytes, list[tuple[int, int, bytes]], str, dict], None],
    say: Callable[[str], None],
    refused: Callable[[RemoteError], None] = lambda e: None,
    quarantined: Callable[[], dict[str, str]] = dict,
    check: Callable[[bytes, str, list[int], Any, str | None], bool] | None = None,
) -> tuple[int, int]:
    """Fetch the records of `fingerprint` this box lacks, verified in full, and store them with
    `put(fingerprint, chain tokens, [(start, end, blob)], label, extra)`; `model` and `extra` are
    this box's identity of the model (as its manifest names it); `refused` counts an object
    refused (corrupt, unauthentic); records of a `quarantined()` uploader are refused, and so is
    every record that `check(key, label, the chain's tokens to its end, blob, uploader)` says is
    not what this box's model computes (kvstore.fleet.check.check_record). Returns (fetched,
    failed)."""
    blocks = BlockStore(store)
    have = {m.key for m in blocks.records()}
    block = blocks.cut_at()
    fetched = failed = 0
    for o in remote.records(fingerprint):
        if o.key in have or fingerprint_of(o.key) != fingerprint:
            continue
        try:
            data, _ = remote.fetch(o.key, name=o.name)
            v = verify_record(o.key, data, keys=remote.settings.fleet_keys,
                              unsigned=remote.settings.allow_unsigned)  # fmt: skip
        except RemoteError as e:
            if e.cause in ("corrupt", "unauthentic", "version"):
                refused(e)
            say(f"warning: {e}; not stored")
            failed += 1
            continue
        meta, tokens, cut, blob = v.meta, v.tokens, v.block, v.blob
        if why := quarantined().get(v.provenance.box):
            say(f"warning: learned record {o.key.hex()}: uploader {v.provenance.box} is "
                f"quarantined ({why}); not stored")  # fmt: skip
            failed += 1
            continue
        label = f"learned record {o.key.hex()}"
        if check is not None and check(o.key, label, tk.unpack(tokens), blob, v.provenance.box):
            failed += 1
            continue
        if cut != block:
            say(f"warning: learned record {o.key.hex()} was cut at {cut} tokens, this store at "
                f"{block}; not stored")  # fmt: skip
            failed += 1
            continue
        theirs = meta.extra.without(*_THAT_BOX).to_map()
        put(fingerprint, tokens, [(meta.start, meta.end, bytes(blob))], meta.label,
            {**theirs, **extra, "model": model, "origin": "remote",
             "uploader": v.provenance.box})  # fmt: skip
        have.add(o.key)
        fetched += 1
        say(f"fetched  learned [{meta.start}, {meta.end}) {meta.label:11} {len(blob)} bytes")
    return fetched, failed
