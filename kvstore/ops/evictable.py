"""Which entries an eviction removes: filters shared by `kvstore evict` and the daemon's budget.

Filters combine (AND); `to_size` then keeps only the least recently used unpinned entries whose
removal brings the store under that size. Pinned entries are never picked by `to_size`.
`stale` judges each entry by the absolute model directory recorded when it was stored, so the
daemon (cwd `/` under launchd, another HF_HOME) judges as the process that stored it would; what
it cannot judge here is kept and reported, never taken for stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvstore.errors import KVStoreError
from kvstore.identity.model import ModelIdentity, entry_model_name
from kvstore.store.entry import EntryMeta


@dataclass(frozen=True)
class Staleness:
    """What `--stale` decided for one entry: "current", "stale" or "unknown" (kept), and why."""

    verdict: str
    reason: str


def _recorded_dir(recorded: object, given: str | None, what: str) -> tuple[Path | None, str]:
    """The absolute directory to judge an entry by: the one recorded at put time (model_dir,
    adapter_dir), else the path as given when it is absolute; else why it cannot be judged."""
    if isinstance(recorded, str) and Path(recorded).is_absolute():
        return Path(recorded), ""
    if given and Path(given).expanduser().is_absolute():
        return Path(given).expanduser(), ""
    return None, (
        f"{what} {given!r} is relative or a hub id and the entry does not record where it "
        "resolved when stored; it cannot be resolved reliably here"
    )


def _gone(path: Path) -> Staleness | None:
    """Stale when the directory is gone from a parent that is still there; unknown when the
    parent is missing too (an unmounted volume) or it cannot be looked at (permissions, TCC)."""
    try:
        if path.is_dir():
            return None
        parent_there = path.parent.is_dir()
    except OSError as e:
        return Staleness("unknown", f"{path}: cannot be looked at here ({e})")
    if parent_there and not path.exists():
        return Staleness("stale", f"{path} is gone")
    return Staleness("unknown", f"{path} is not visible here (an unmounted volume?)")


def _judge(m: EntryMeta, cache) -> Staleness:
    from kvstore.identity.fingerprint import model_fingerprint

    model_dir, why = _recorded_dir(m.model_dir, m.model, "model")
    if model_dir is None:
        return Staleness("unknown", why)
    identity = ModelIdentity.of_entry(m)
    adapter_dir = None
    if identity.adapter:
        adapter_dir, why = _recorded_dir(m.extra.adapter_dir, identity.adapter, "adapter")
        if adapter_dir is None:
            return Staleness("unknown", why)
    for d in (model_dir, adapter_dir):
        if d is not None and (verdict := _gone(d)) is not None:
            return verdict
    # Load-time overrides the entry was made with (when recorded): the fingerprint covers them,
    # so judging without them would call a valid pin stale.
    overrides = identity.model_config
    here = ModelIdentity(
        str(model_dir),
        None if adapter_dir is None else str(adapter_dir),
        kv_bits=identity.kv_bits,
        model_config=overrides if isinstance(overrides, dict) and overrides else None,
    )
    if identity.kv_bits:  # group size and start count only for quantized KV
        here = replace(
            here,
            kv_group_size=identity.kv_group_size,
            quantized_kv_start=identity.quantized_kv_start,
        )
    try:
        fp = model_fingerprint(here, hash_cache=cache).digest
    except (KVStoreError, OSError) as e:  # a model dir we cannot fingerprint: never a deletion
        return Staleness("unknown", f"cannot fingerprint {model_dir} here: {e}")
    if fp != m.fingerprint:
        return Staleness("stale", f"model changed (fingerprint {fp.hex()} now)")
    return Staleness("current", "")


def staleness(metas: Iterable[EntryMeta], home: Path) -> dict[bytes, Staleness]:
    """Each entry's verdict; entries of one model as it was run are fingerprinted once."""
    from kvstore.home.settings import FILEHASH_NAME
    from kvstore.identity.fingerprint import FileHashCache

    cache = FileHashCache(home / FILEHASH_NAME)
    seen: dict[tuple, Staleness] = {}
    out = {}
    for m in metas:
        x = m.extra
        where = (ModelIdentity.of_entry(m).same_model(), x.model_dir, x.adapter_dir, m.fingerprint)
        if where not in seen:
            seen[where] = _judge(m, cache)
        out[m.key] = seen[where]
    return out


def select_for_eviction(
    metas: Sequence[EntryMeta],
    *,
    keys: Iterable[bytes] = (),
    label: str | None = None,
    model: str | None = None,
    unpinned: bool = False,
    stale: bool = False,
    to_size: int | None = None,
    home: Path,
    unknown: list[tuple[EntryMeta, str]] | None = None,
) -> list[EntryMeta]:
    """Entries matching every filter given; `to_size` then picks the LRU unpinned ones. `model`
    is a model's name (`model_name`), compared with each entry's (`entry_model_name`).

    `stale` picks only entries whose model is known to have changed or gone; those it cannot
    judge in this process are kept, and appended to `unknown` with the reason if given."""
    chosen = list(metas)
    keys = set(keys)
    if keys:
        chosen = [m for m in chosen if m.key in keys]
    if label is not None:
        chosen = [m for m in chosen if m.label == label]
    if model is not None:
        chosen = [m for m in chosen if entry_model_name(m.model, m.model_dir) == model]
    if unpinned:
        chosen = [m for m in chosen if not m.pinned]
    if stale:
        verdicts = staleness(chosen, home)
        if unknown is not None:
            unknown.extend(
                (m, verdicts[m.key].reason) for m in chosen if verdicts[m.key].verdict == "unknown"
            )
        chosen = [m for m in chosen if verdicts[m.key].verdict == "stale"]
    if to_size is not None:
        total = sum(m.nbytes for m in metas)
        victims = []
        for m in sorted((m for m in chosen if not m.pinned), key=lambda m: m.last_used):
            if total <= to_size:
                break
            victims.append(m)
            total -= m.nbytes
        chosen = victims
    return chosen
