"""The daemon's socket commands: `cmd_<name>(args, conn)` returns a result or raises.

Reads (ping, stats, ls) use the store directly from the connection's thread; every write is a job
on the one writer thread, and the handler waits for it. A raised KVStoreError, ValueError or
TypeError becomes an error reply naming what was wrong.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvstore.codec import codec
from kvstore.daemon.connection import Connection
from kvstore.daemon.lifecycle import peak_rss_bytes, rss_bytes
from kvstore.daemon.upkeep import Upkeep
from kvstore.daemon.writer import Writer
from kvstore.errors import CodecError, KVStoreError
from kvstore.pins.manifest import load_manifest
from kvstore.pins.registry import canonical, register, unregister
from kvstore.store.entry import KEY_BYTES, blob_checksum, tokens_match_key
from kvstore.store.eviction import select_for_eviction
from kvstore.store.ledger import Ledger, validate
from kvstore.store.ownership import owning_manifests
from kvstore.store.store import Store

log = logging.getLogger("kvstore.daemon")

_EVICT_FILTERS = ("keys", "label", "model", "unpinned", "stale", "all", "to_size")


def _want(
    args: dict[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    default: Any = None,
    *,
    required: bool = False,
) -> Any:
    """One argument of a request, type-checked: bad input is an error reply, not a crash."""
    if name not in args or args[name] is None:
        if required:
            raise ValueError(f"argument {name!r} is required")
        return default
    value = args[name]
    if not isinstance(value, kind):
        raise ValueError(f"argument {name!r} must be {kind}, not {type(value).__name__}")
    return value


_PUT_FIELDS: dict[str, tuple[type, str]] = {
    "label": (str, "str"),
    "model": (str, "str"),
    "pinned": (bool, "bool"),
    "template_hash": (bytes, "bytes"),
    "classes": (list, "a list of str"),
    "extra": (dict, "a map with str keys and msgpack-simple values"),
}
_SIMPLE = (type(None), bool, int, float, str, bytes)
_MAX_DEPTH = 8


def _simple(value: Any, depth: int = 0) -> bool:
    """A value msgpack stores and reads back as itself: scalars, bytes, and lists or str-keyed
    maps of those (nested at most _MAX_DEPTH deep)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2**63) <= value < 2**64
    if isinstance(value, _SIMPLE):
        return True
    if depth >= _MAX_DEPTH:
        return False
    if isinstance(value, list):
        return all(_simple(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _simple(v, depth + 1) for k, v in value.items())
    return False


def check_put_fields(fields: dict[str, Any]) -> None:
    """The meta fields of a put, type-checked before anything is queued; raises ValueError
    naming the first bad field (`tokens` is checked with the key)."""
    for name, value in fields.items():
        if name == "tokens":
            continue
        if name not in _PUT_FIELDS:
            raise ValueError(f"field {name!r} is not one a put may set ({', '.join(_PUT_FIELDS)})")
        kind, what = _PUT_FIELDS[name]
        if not isinstance(value, kind):
            raise ValueError(f"field {name!r} must be {what}, not {type(value).__name__}")
        if name == "classes" and not all(isinstance(c, str) for c in value):
            raise ValueError(f"field {name!r} must be {what}")
        if name == "extra" and not _simple(value):
            raise ValueError(f"field {name!r} must be {what}")


class Commands:
    """Mixed into the Daemon, which provides these attributes."""

    home: Path
    store: Store
    writer: Writer
    upkeep: Upkeep
    ledger: Ledger
    settings: dict[str, Any]
    manifests: list[Path]
    started: float
    stopping: threading.Event
    watcher_mode: Callable[[], str]
    request_stop: Callable[[str], None]
    reload: Callable[[str], Future]
    watch: Callable[[Path], None]
    unwatch: Callable[[Path], bool]
    fixed_manifests: frozenset[Path]
    after_put: Callable[[Any], None]
    learned_stats: Callable[[list], dict[str, Any]]

    def write(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the writer thread and wait for it (`dispatch` logs a failure)."""
        return self.writer.submit(name, fn, reported=True).result()

    # -- reads --------------------------------------------------------------------------------

    def cmd_ping(self, args: dict, conn: Connection) -> dict[str, Any]:
        return {"pid": os.getpid(), "home": str(self.home), "uptime": time.time() - self.started}

    def cmd_stats(self, args: dict, conn: Connection) -> dict[str, Any]:
        data = self.store.stats()
        data["settings"] = dict(self.settings)
        data["daemon"] = {
            "pid": os.getpid(),
            "uptime": time.time() - self.started,
            "rss": rss_bytes(),
            "peak_rss": peak_rss_bytes(),
            "watcher": self.watcher_mode(),
            "manifests": [str(p) for p in self.manifests],
            "writing": self.writer.current,
            "last_warm": self.upkeep.last_warm,
            "deferred": dict(self.upkeep.deferred),  # warms waiting for memory to load a model
        }
        data["ledger"] = self.ledger.stats()
        data["learned"] = self.learned_stats(self.store.metas(errors=[]))
        return data

    def cmd_ls(self, args: dict, conn: Connection) -> list[dict[str, Any]]:
        model = _want(args, "model", str)
        label = _want(args, "label", str)
        return [
            m.to_json()
            for m in self.store.metas(errors=[])
            if (model is None or m.model == model) and (label is None or m.label == label)
        ]

    # -- writes -------------------------------------------------------------------------------

    def cmd_put(self, args: dict, conn: Connection) -> dict[str, Any]:
        """An entry, inline or streamed as `{"data": bytes}` frames; verified before commit."""
        # A streamed put that fails midway leaves chunk frames unread: close rather than parse them.
        conn.close_after_reply = args.get("blob") is None
        key = _want(args, "key", bytes, required=True)
        fields = dict(_want(args, "fields", dict, required=True))
        nbytes = _want(args, "nbytes", int, required=True)
        checksum = _want(args, "checksum", int, required=True)
        tokens = fields.get("tokens")
        if len(key) != KEY_BYTES or not isinstance(tokens, bytes) or len(tokens) % 4:
            raise ValueError(f"put: key must be {KEY_BYTES} bytes and tokens packed uint32")
        check_put_fields(fields)
        # The key's second half is the tokens' hash: a mismatch would file KV under a lie.
        if not tokens_match_key(key, tokens):
            raise ValueError(f"put {key.hex()}: key does not match the entry's tokens")
        budget = int(self.settings["max_bytes"])
        if not 0 < nbytes <= budget:
            raise ValueError(f"put {key.hex()}: {nbytes} bytes is outside 1..max_bytes={budget}")
        blob = args.get("blob")
        if blob is None:  # grows to at most nbytes (itself at most max_bytes, checked above)
            blob = conn.receive_stream(nbytes)
            conn.close_after_reply = False
        elif not isinstance(blob, bytes):
            raise ValueError("argument 'blob' must be bytes")
        if len(blob) != nbytes or blob_checksum(blob) != checksum:
            raise ValueError(f"put {key.hex()}: blob length or checksum does not match")

        def job():
            # Decoded here, on the writer (main) thread: see kvstore.daemon.writer on mlx and
            # threads.
            try:
                cache, _ = codec.decode(blob, name=f"put {key.hex()}")
            except CodecError as e:
                raise ValueError(str(e)) from None
            # The KV must cover exactly the entry's tokens: more or fewer would be served as the
            # prefix it claims to be. (A pure state-space cache keeps no offset to compare.)
            held, ntokens = codec.cache_tokens(cache), len(tokens) // 4
            if held != ntokens and not (held is None and codec.keeps_no_offset(cache)):
                what = f"the KV holds {held} tokens" if held is not None else "its layers disagree"
                raise ValueError(f"put {key.hex()}: {what}, but the entry is {ntokens} tokens")
            del cache
            # Located by the client (DaemonClient.put): our cwd and HF_HOME are not its own.
            meta = self.store.put(key, blob, locate=False, **fields)
            self.after_put(meta)  # kvstore.daemon.learn: write budget, snapshot cap
            log.info(
                "put %s %r of %s: %d tokens, %d bytes",
                key.hex(),
                meta.label,
                meta.model,
                meta.ntokens,
                meta.nbytes,
            )
            self.upkeep.enforce_budget()
            return meta

        meta = self.write("put", job)
        return {"key": meta.key, "meta": meta.pack()}

    def cmd_evict(self, args: dict, conn: Connection) -> dict[str, Any]:
        """The filters of `kvstore evict`; full 32-byte keys (the CLI resolves hex prefixes)."""
        keys = _want(args, "keys", list, [])
        if not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys):
            raise ValueError(f"argument 'keys' must be a list of {KEY_BYTES}-byte keys")
        # to_size=0 is a filter ("down to 0 bytes"), not its absence.
        if not any(args.get(f) for f in _EVICT_FILTERS if f != "to_size") and (
            args.get("to_size") is None
        ):
            raise ValueError(f"name what to evict: one of {', '.join(_EVICT_FILTERS)}")
        label, model = _want(args, "label", str), _want(args, "model", str)
        to_size = _want(args, "to_size", int)

        def job():
            unknown: list = []
            victims = select_for_eviction(
                self.store.metas(errors=[]),
                keys=keys,
                label=label,
                model=model,
                unpinned=bool(args.get("unpinned")),
                stale=bool(args.get("stale")),
                everything=bool(args.get("all")),
                to_size=to_size,
                home=self.home,
                unknown=unknown,
            )
            n = self.store.delete(m.key for m in victims)
            for m, why in unknown:
                log.warning(
                    "evict --stale kept %s %r of %s: %s", m.key.hex(), m.label, m.model, why
                )
            for m in victims:
                log.info(
                    "evicted %s %r of %s (%d bytes): requested",
                    m.key.hex(),
                    m.label,
                    m.model,
                    m.nbytes,
                )
            watched = {canonical(p) for p in self.manifests}
            owned = [
                {"label": m.label, "model": m.model, "manifest": path,
                 "watched": canonical(path) in watched}
                for m in victims
                for path in owning_manifests(m)
            ]  # fmt: skip
            for o in owned:  # evicted all the same: the next reconcile of that manifest re-warms
                log.info(
                    "evicted pin %r is kept by manifest %s (%s)",
                    o["label"],
                    o["manifest"],
                    "re-warmed at its next reconcile" if o["watched"] else "not watched",
                )
            return {
                "evicted": n,
                "bytes": sum(m.nbytes for m in victims),
                "owned": owned,
                "keys": [m.key.hex() for m in victims],
                "unknown": [
                    {"key": m.key.hex(), "label": m.label, "model": m.model, "reason": why}
                    for m, why in unknown
                ],
            }

        return self.write("evict", job)

    def cmd_repair(self, args: dict, conn: Connection) -> dict[str, Any]:
        """`kvstore verify --repair`: check every entry and learned record and delete the bad
        ones, as one writer job (it decodes, so it runs on the main thread too)."""

        def job():
            entries = len(self.store.keys())
            problems = self.store.check(repair=True)
            for p in problems:
                log.warning("repair: deleted entry %s: %s", p.key.hex(), p.reason)
            records, bad = self.upkeep.blocks.check(repair=True)
            for p in bad:
                log.warning("repair: deleted learned record %s: %s", p.key.hex(), p.reason)
            return {
                "entries": entries,
                "problems": [{"key": p.key, "reason": p.reason} for p in problems],
                "records": records,
                "record_problems": [{"key": p.key, "reason": p.reason} for p in bad],
            }

        return self.write("repair", job)

    def cmd_warm(self, args: dict, conn: Connection) -> dict[str, Any]:
        """Reconcile one manifest (or, without one, every manifest the daemon watches). A manifest
        warmed here is watched from then on, so its pins stay true."""
        given = _want(args, "manifest", str)
        if given is None:
            return {"reports": self.reload("warm request").result()}
        path = Path(given).expanduser().absolute()
        manifest = load_manifest(path)  # a bad manifest is the caller's error, not a log line
        self.watch(path)
        try:  # and from every later start too
            if register(self.home, manifest.path):
                log.info("registered manifest %s: reconciled and watched at every start", path)
        except KVStoreError as e:
            log.error("%s (watched until this daemon stops)", e)
        return {
            "reports": [
                self.write("warm", lambda: self.upkeep.warm(manifest, cause="warm request"))
            ]
        }

    def cmd_manifests(self, args: dict, conn: Connection) -> dict[str, Any]:
        """The manifests watched now, and which of them the daemon was started with."""
        return {
            "watched": [str(p) for p in self.manifests],
            "fixed": sorted(str(p) for p in self.fixed_manifests),
        }

    def cmd_manifest_remove(self, args: dict, conn: Connection) -> dict[str, Any]:
        """`kvstore manifests remove PATH`: forget a registered manifest and stop watching it
        (unless it is the manifest this daemon was started with). Its pins stay stored."""
        target = canonical(_want(args, "path", str, required=True))
        removed = unregister(self.home, target)
        fixed = target in self.fixed_manifests
        unwatched = False if fixed else self.unwatch(target)
        return {"removed": removed, "unwatched": unwatched, "still_watched": fixed}

    def cmd_touch(self, args: dict, conn: Connection) -> dict[str, Any]:
        keys = _want(args, "keys", list, required=True)
        if not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys):
            raise ValueError(f"argument 'keys' must be a list of {KEY_BYTES}-byte keys")
        return {"touched": self.write("touch", lambda: self.store.touch(keys))}

    def cmd_record(self, args: dict, conn: Connection) -> dict[str, Any]:
        records = validate(args.get("records"))
        return {"recorded": self.write("record", lambda: self.ledger.append(records))}

    # -- process ------------------------------------------------------------------------------

    def cmd_reload(self, args: dict, conn: Connection) -> dict[str, Any]:
        """Re-read settings and every manifest, and reconcile (what SIGHUP does)."""
        return {"reports": self.reload("reload request").result()}

    def cmd_shutdown(self, args: dict, conn: Connection) -> dict[str, Any]:
        self.request_stop("shutdown request")
        return {"pid": os.getpid()}

    def dispatch(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        cmd, args = msg.get("cmd"), msg.get("args", {})
        handler = getattr(self, f"cmd_{cmd}", None) if isinstance(cmd, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown command {cmd!r}"}
        if not isinstance(args, dict):
            return {"ok": False, "error": f"{cmd}: args must be a map"}
        try:
            return {"ok": True, "result": handler(args, conn)}
        except (KVStoreError, ValueError, TypeError) as e:
            log.warning("%s: %s", cmd, e)
            return {"ok": False, "error": f"{cmd}: {e}"}
        except Exception as e:  # a bug must cost one request, never the daemon
            log.exception("%s failed", cmd)
            return {"ok": False, "error": f"{cmd}: internal error: {type(e).__name__}: {e}"}
