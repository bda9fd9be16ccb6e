"""Hydrate: scan one model's entries, decode them (`prefetch`), insert them into an LRUPromptCache
(`insert`). The two halves are apart so that `kvstore.client.load` can prefetch while the weights
load.

The cache is never a hard dependency: a missing home, a corrupt store or entry, or a fingerprint
nobody stored gives one warning and a report of what did hydrate; no exception reaches the app.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.client.fleetcheck import check_pending, hold_pending
from kvstore.client.loader import check_loaded_from
from kvstore.degrade import library_call
from kvstore.errors import KVStoreError, counted
from kvstore.home.settings import FILEHASH_NAME, resolve_home
from kvstore.identity.fingerprint import FileHashCache, Fingerprint, model_fingerprint
from kvstore.identity.model import IdentityKeywords, ModelIdentity, entry_model_name, model_name
from kvstore.learned.blockstore import load_entry
from kvstore.store.entry import EntryMeta
from kvstore.store.store import Store

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.models.cache import LRUPromptCache
    from typing_extensions import Unpack

log = logging.getLogger("kvstore.client")


@dataclass
class HydrateReport:
    entries: int = 0
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    fingerprint: str = ""
    labels: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "key: reason" of entries not inserted
    # of those, the ones that failed their checks: (tokens, label) (kvstore.reasons' `corrupt`)
    corrupt: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    dropped: int = 0  # inserted, then pushed out by the LRU's own limits
    # this path's entries under another fingerprint: (tokens, what differs) (kvstore.reasons)
    other_model: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    warning: str | None = None


def _has_adapter(model: Any) -> bool:
    """LoRA / DoRA layers in a loaded model: an adapter the caller did not name."""
    if model is None or not hasattr(model, "modules"):
        return False
    names = {"LoRALinear", "LoRASwitchLinear", "LoRAEmbedding", "DoRALinear", "DoRAEmbedding"}
    return any(type(m).__name__ in names for m in model.modules())


def _other_versions(model_path: str | Path, other: list[tuple[tuple[int, ...], str]]) -> str | None:
    """Nothing stored for this fingerprint: the warning for this path's entries made for another
    version of it (`other`, from _what_differs), naming the identity parts that differ."""
    if not other:
        return None
    differ = ", ".join(dict.fromkeys(what for _, what in other))
    return (
        f"kvstore: {counted(len(other), 'stored entry')} for {model_path}, made with another "
        f"version of it (what differs: {differ}): not used; "
        "`kvstore warm` (or the daemon) re-warms what a manifest pins"
    )


def _what_differs(
    store: Store, model_path: str | Path, parts: dict, identity: ModelIdentity | None = None
) -> list[tuple[tuple[int, ...], str]]:
    """This path's entries under another fingerprint, each with what differs from the running
    identity: the fingerprint's parts its meta recorded, or for an entry that recorded none (an
    older one) what its identity state, codec and mlx-lm version say (kvstore.reasons)."""
    from kvstore.reasons import identity_diff

    name = model_name(model_path)
    running = _provenance(identity.state if identity is not None else {}, None, None)
    out = []
    for m in store.metas(errors=[]):
        if entry_model_name(m.model, m.model_dir) == name:
            stored = m.extra.fingerprint_parts
            if stored is not None:
                what = identity_diff(stored, parts)
            else:
                version = (m.extra.runtime or {}).get("mlx_lm")
                mine = _provenance(m.extra.to_map(), m.codec, version)
                what = identity_diff(mine, {k: running[k] for k in mine})
            out.append((tuple(m.token_ids()), what))
    return out


def _provenance(state: dict, codec: Any, mlx_lm: Any) -> dict:
    """An identity state with the codec version and mlx-lm version (None: not known, not
    compared), for `identity_diff`."""
    from kvstore.codec import CODEC_VERSION
    from kvstore.identity.codehash import runtime_versions

    keys = ("adapter", "kv_bits", "kv_group_size", "quantized_kv_start", "model_config")
    out = {k: state.get(k) for k in keys if k in state}
    if codec is None:  # the running side
        return {**out, "codec": CODEC_VERSION, "mlx_lm": runtime_versions()["mlx_lm"]}
    out["codec"] = codec
    if mlx_lm is not None:
        out["mlx_lm"] = mlx_lm
    return out


def check_arguments(identity: ModelIdentity, *, home: Any = None) -> tuple[Path, ModelIdentity]:
    """The resolved home and the identity with its paths as str; KVStoreError naming the first
    argument of the wrong type (hydrate, load and PersistentPromptCache build `identity` from
    their keyword arguments as given, and turn this into their one warning, never an
    exception)."""
    paths = dict(model_path=identity.path, home=home, adapter_path=identity.adapter)
    for name, value in paths.items():
        if not (value is None or isinstance(value, (str, os.PathLike))) or value == "":
            raise KVStoreError(f"{name}={value!r} is not a path (a str or os.PathLike)")
    identity.check()  # the manifest's one rule for KV quantization
    overrides = identity.model_config
    if overrides is not None and not isinstance(overrides, dict):
        raise KVStoreError(f"model_config={overrides!r} is not a dict of config.json keys")
    adapter = identity.adapter
    checked = replace(
        identity,
        path=str(identity.path),
        adapter=None if adapter is None else str(adapter),
        model_config=None if overrides is None else dict(overrides),
    )
    return resolve_home(home), checked


@dataclass
class Prefetched:
    """One model's entries, read, checked and decoded, not yet in any LRUPromptCache: what
    `kvstore.client.load` reads while the weights load, and `insert` then files."""

    model_path: str
    entries: list[tuple[EntryMeta, list]] = field(default_factory=list)
    report: HydrateReport = field(default_factory=HydrateReport)
    fingerprint: Fingerprint | None = None  # with the files it hashed; None when refused
    pending: Any = None  # fetched from the fleet, held until checked (kvstore.client.fleetcheck)


def prefetch(
    identity: ModelIdentity,
    *,
    home: str | Path | None = None,
    model: Any = None,
    fingerprint: Fingerprint | None = None,
) -> Prefetched:
    """Fingerprint the model and decode every stored entry valid for it; never raises.

    Pass the loaded `model` if you have it: its cache layout is then read from it instead of
    being rebuilt from config.json. `identity`'s KV quantization must be what the app generates
    with, and its `model_config` the overrides it loaded the model with
    (`mlx_lm.load(model_config=...)`); with the loaded `model` its own arguments count too.
    Without the loaded `model`, the cache layout comes from config.json (remembered in the
    home's hash cache). A model loaded with `kvstore.client.load` is checked against the files
    it was loaded from: a weight file changed since then hydrates nothing. `fingerprint` is the
    model's, when the caller has just computed it for the same identity without a loaded model
    (kvstore.client.load, before the weights load): it is not computed again.
    """
    t0 = time.perf_counter()
    model_path = identity.path
    pre = Prefetched(str(model_path))
    report = pre.report
    with library_call("kvstore: hydrate failed", level=logging.DEBUG) as failed:
        try:
            home, identity = check_arguments(identity, home=home)
            if identity.adapter is None and _has_adapter(model):
                raise KVStoreError(
                    "the model has LoRA layers but no adapter_path was given; pass the adapter the "
                    "model was loaded with (its weights are part of the entries' identity)"
                )
            fp = fingerprint
            if fp is None or model is not None or fp.identity != identity:
                fp = model_fingerprint(
                    identity, model_object=model, hash_cache=FileHashCache(home / FILEHASH_NAME)
                )
            check_loaded_from(model, fp)
            report.fingerprint = fp.hex
            pre.fingerprint = fp
            vocab = _vocab_size(model, identity)
            with Store(home, readonly=True) as store:
                errors: list = []
                metas = store.metas(fp.digest, errors=errors)
                report.skipped += [f"{e.key.hex()}: {e.reason}" for e in errors]
                # oldest first, so the LRU keeps the most recently used when it overflows
                for meta in sorted(metas, key=lambda m: (m.pinned, m.last_used)):
                    try:
                        _check_stored_ids(meta, vocab)
                        pre.entries.append(load_entry(store, meta.key, meta.tokens))
                    except (KVStoreError, ValueError) as e:
                        report.skipped.append(f"{meta.key.hex()}: {e}")
                        report.corrupt.append((tuple(meta.token_ids()), meta.label))
                    except KeyError:
                        report.skipped.append(f"{meta.key.hex()}: gone or not this prefix")
                hold_pending(pre, home, identity)  # inserted only once checked with the model
                if not metas and not errors:
                    report.other_model = _what_differs(store, model_path, fp.parts, identity)
                    report.warning = _other_versions(model_path, report.other_model)
        except KVStoreError as e:
            report.warning = f"kvstore: not hydrating {model_path}: {e}; prefilling as usual"
    if failed.error is not None:  # the cache must never take the app down
        err = failed.error
        report.warning = (
            f"kvstore: not hydrating {model_path}: unexpected {type(err).__name__}: {err}; "
            "prefilling as usual"
        )
    report.seconds = time.perf_counter() - t0
    return pre


def _vocab_size(model: Any, identity: ModelIdentity) -> int | None:
    if model is not None:
        from kvstore.kvcheck.prefill import model_vocab_size

        return model_vocab_size(model)
    from kvstore.identity.fingerprint import resolve_model_path
    from kvstore.identity.modelconfig import config_vocab_size, effective_config

    config = effective_config(resolve_model_path(identity.path), identity.model_config)
    return config_vocab_size(config)


def _check_stored_ids(meta: EntryMeta, vocab: int | None) -> None:
    """ValueError for an entry keyed by ids the model cannot take (only a damaged or foreign
    entry has them): served, they would send an out-of-vocabulary id towards mlx."""
    import numpy as np

    ids = np.frombuffer(meta.tokens, dtype="<u4")
    if vocab is not None and ids.size and int(ids.max()) >= vocab:
        from kvstore.kvcheck.prefill import check_token_ids  # names the first bad id

        check_token_ids(ids.tolist(), vocab, what="stored token ids")


def insert(
    prompt_cache,
    model_key: Any,
    pre: Prefetched,
    *,
    model: Any = None,
    size_option: str = "max_size",
) -> HydrateReport:
    """File prefetched entries into `prompt_cache`; log the report's one warning, if any. Entries
    fetched from the fleet and not yet checked are checked with the loaded `model` first (without
    it they are skipped: kvstore.client.fleetcheck). `size_option` is what the warning for entries
    the LRU could not keep tells the user to raise: the LRUPromptCache's `max_size`, or the
    command-line option that sets it (serve's `--prompt-cache-size`)."""
    t0 = time.perf_counter()
    report, model_path = pre.report, pre.model_path
    if not hasattr(prompt_cache, "insert_cache"):  # a wrong argument: a warning, as documented
        pre.entries, report.labels, report.skipped = [], [], []
        report.warning = (
            f"kvstore: not hydrating {model_path}: prompt_cache={prompt_cache!r} is not an "
            "LRUPromptCache; prefilling as usual"
        )
        log.warning("%s", report.warning)
        return report
    check_pending(pre, model)
    before = len(prompt_cache)
    # kvstore's own cache (kvstore.client.persistent) takes stored KV apart from a request's
    insert_stored = getattr(prompt_cache, "insert_stored", None)
    for meta, cache in pre.entries:
        if insert_stored is not None:
            insert_stored(model_key, meta.token_ids(), cache)
        else:
            prompt_cache.insert_cache(model_key, meta.token_ids(), cache, cache_type="system")
        report.entries += 1
        report.tokens += meta.ntokens
        report.nbytes += meta.nbytes
        report.labels.append(meta.label)
    pre.entries = []  # the LRU holds them now
    report.dropped = max(0, report.entries - (len(prompt_cache) - before))
    if report.warning is None and report.skipped:
        report.warning = (
            f"kvstore: skipped {counted(len(report.skipped), 'unreadable entry')} for {model_path} "
            f"(run `kvstore verify`): {report.skipped[0]}"
        )
    if report.warning is None and report.dropped:
        size = getattr(prompt_cache, "max_size", "?")
        given = f"{size_option} {size}" if size_option.startswith("-") else f"{size_option}={size}"
        report.warning = (
            f"kvstore: {report.dropped} of {report.entries} hydrated entries did not stay in the "
            f"LRUPromptCache ({given}, or a longer trimmable entry covers them); "
            f"raise {size_option} to keep them all"
        )
    if report.warning:
        log.warning("%s", report.warning)
    report.seconds += time.perf_counter() - t0
    return report


def hydrate(
    prompt_cache: LRUPromptCache,
    model_key: Any,
    model_path: str | Path | ModelIdentity,
    *,
    home: str | Path | None = None,
    model: nn.Module | None = None,
    prefetched: Prefetched | None = None,
    **identity: Unpack[IdentityKeywords],
) -> HydrateReport:
    """Insert every stored entry valid for this model into `prompt_cache` (an LRUPromptCache).

    `model_key` is the key the app's LRUPromptCache uses for this model; `model_path` the model
    (or its whole `ModelIdentity`). Pass the loaded `model` if you have it: its cache layout is
    then read from it instead of being rebuilt from config.json. The identity keywords
    (`adapter_path`, `kv_bits`, `kv_group_size`, `quantized_kv_start`, `model_config`) must be
    what the app generates with and the overrides it loaded the model with. `prefetched` (from
    `prefetch` with the same identity) skips the reading. Never raises: a store problem or an
    argument of the wrong type (`home=123`) is the report's one warning, logged, and nothing is
    inserted.
    """
    rows: dict[str, Any] = dict(identity)
    given = model_path if isinstance(model_path, ModelIdentity) else None
    if given is None:  # as given: prefetch checks it (a wrong type is the report's warning)
        given = ModelIdentity.given(model_path, rows)
    if rows:
        raise TypeError(f"hydrate() got an unexpected keyword argument {next(iter(rows))!r}")
    if prefetched is None:
        prefetched = prefetch(given, home=home, model=model)
    return insert(prompt_cache, model_key, prefetched, model=model)
