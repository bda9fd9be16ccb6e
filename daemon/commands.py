"""The daemon's socket commands: `cmd_<op>(request, conn)` takes one operation's typed request
(kvstore.wire.messages), calls its operation (kvstore.ops, or the daemon's learning part) and
returns its typed reply, or raises. `dispatch` decodes a frame into the request the operations
table names and encodes the reply; the handlers are registered from that table, and a table
entry without a handler (or a handler without an entry) stops the daemon at start.

Reads (ping, stats, ls) use the store directly from the connection's thread; every write is a job
on the one writer thread, and the handler waits for it. A raised KVStoreError, ValueError or
TypeError becomes an error reply naming what was wrong, with its code (kvstore.wire.codes).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from kvstore import metrics
from kvstore.daemon.connection import Connection
from kvstore.daemon.learn import Learning
from kvstore.daemon.lifecycle import peak_rss_bytes, rss_bytes
from kvstore.daemon.upkeep import Upkeep
from kvstore.daemon.writer import Writer
from kvstore.degrade import daemon_handler
from kvstore.errors import KVStoreError, StoreDamaged
from kvstore.home.ledger import Ledger, validate
from kvstore.home.registry import canonical, register
from kvstore.home.settings import Settings
from kvstore.ops import entries, verify
from kvstore.ops import manifests as manifest_ops
from kvstore.ops import put as put_ops
from kvstore.ops import stats as stats_ops
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.wire import protocol
from kvstore.wire.codes import ErrorCode
from kvstore.wire.messages import (
    OPS,
    PROTOCOL_VERSION,
    EvictReply,
    EvictRequest,
    FleetCheckedReply,
    FleetCheckedRequest,
    LearnReply,
    LearnRequest,
    LsReply,
    LsRequest,
    ManifestRemoveReply,
    ManifestRemoveRequest,
    ManifestsReply,
    ManifestsRequest,
    PingReply,
    PingRequest,
    PutBlocksReply,
    PutBlocksRequest,
    PutReply,
    PutRequest,
    RecordReply,
    RecordRequest,
    RepairReply,
    RepairRequest,
    Reply,
    StatsReply,
    StatsRequest,
    TouchBlocksReply,
    TouchBlocksRequest,
    TouchReply,
    TouchRequest,
    WarmReply,
    WarmRequest,
)

log = logging.getLogger("kvstore.daemon")


class DaemonControl(Protocol):
    """What the commands need of the daemon process itself (kvstore.daemon.server.Daemon)."""

    home: Path
    started: float
    manifests: list[Path]
    fixed_manifests: frozenset[Path]

    def watcher_mode(self) -> str: ...
    def reload(self, cause: str) -> Future: ...
    def watch(self, manifest: Path) -> None: ...
    def unwatch(self, manifest: Path) -> bool: ...


class Commands:
    """The handlers, over the daemon's parts."""

    def __init__(
        self,
        store: Store,
        writer: Writer,
        upkeep: Upkeep,
        ledger: Ledger,
        learning: Learning,
        settings: Settings,
        control: DaemonControl,
    ):
        self.store, self.writer, self.upkeep, self.ledger = store, writer, upkeep, ledger
        self.learning, self.settings, self.control = learning, settings, control
        self.handlers = self._register()

    def _register(self) -> dict[str, Callable[[Any, Connection], Reply]]:
        """`cmd_<op>` for each operation of kvstore.wire.messages.OPS; a missing or extra one is
        a bug, raised here, at start, rather than answered UNKNOWN_OP to some later client."""
        table = {op: getattr(self, f"cmd_{op}", None) for op in OPS}
        missing = sorted(op for op, handler in table.items() if handler is None)
        extra = sorted(n[4:] for n in dir(self) if n.startswith("cmd_") and n[4:] not in OPS)
        if missing or extra:
            raise RuntimeError(f"daemon handlers do not match the operations table: "
                               f"missing {missing}, not in the table {extra}")  # fmt: skip
        return {op: handler for op, handler in table.items() if handler is not None}

    @property
    def home(self) -> Path:
        return self.control.home

    def write(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the writer thread and wait for it (`dispatch` logs a failure)."""
        return self.writer.submit(name, fn, reported=True).result()

    # -- reads --------------------------------------------------------------------------------

    def cmd_ping(self, req: PingRequest, conn: Connection) -> PingReply:
        return PingReply(
            pid=os.getpid(),
            home=str(self.home),
            uptime=time.time() - self.control.started,
            protocol=PROTOCOL_VERSION,
            ops=list(OPS),
        )

    def cmd_stats(self, req: StatsRequest, conn: Connection) -> StatsReply:
        reply = stats_ops.stats(
            self.store,
            self.upkeep.blocks,
            settings=self.settings,
            ledger=self.ledger.stats(),
            paused=self.learning.paused,
            daemon=self._daemon_state(),
        )
        if reply.learned is not None:
            metrics.set_learned(reply.learned)
        return reply

    def _daemon_state(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "uptime": time.time() - self.control.started,
            "rss": rss_bytes(),
            "peak_rss": peak_rss_bytes(),
            "watcher": self.control.watcher_mode(),
            "manifests": [str(p) for p in self.control.manifests],
            "writing": self.writer.current,
            "last_warm": self.upkeep.last_warm,
            "deferred": dict(self.upkeep.deferred),  # warms waiting for memory to load a model
        }

    def cmd_ls(self, req: LsRequest, conn: Connection) -> LsReply:
        return LsReply([m.to_json() for m in entries.ls(self.store, req)])

    # -- writes -------------------------------------------------------------------------------

    def cmd_put(self, req: PutRequest, conn: Connection) -> PutReply:
        """An entry, inline or streamed as `{"data": bytes}` frames; verified before commit. A
        streamed put that fails midway leaves chunk frames unread: `dispatch` set the connection
        to close after the reply rather than parse them."""
        fields = put_ops.check_request(req, max_bytes=int(self.settings.max_bytes))
        blob = req.blob
        if blob is None:  # grows to at most nbytes (itself at most max_bytes, checked above)
            blob = conn.receive_stream(req.nbytes)
            conn.close_after_reply = False
        blob = put_ops.check_blob(req, blob)

        def job():
            # Decoded here, on the writer (main) thread: see kvstore.daemon.writer on mlx and
            # threads. after_put: kvstore.daemon.learn's write budget and snapshot cap.
            meta = put_ops.put(self.store, req.key, blob, fields, budget=self.upkeep.budget,
                               after=self.learning.after_put, sent=req)  # fmt: skip
            log.info("put %s %r of %s: %d tokens, %d bytes", req.key.hex(), meta.label,
                     meta.model, meta.ntokens, meta.nbytes)  # fmt: skip
            return meta

        meta = self.write("put", job)
        return PutReply(key=meta.key, meta=meta.pack())

    def cmd_evict(self, req: EvictRequest, conn: Connection) -> EvictReply:
        """The filters of `kvstore evict`; full 32-byte keys (the CLI resolves hex prefixes)."""

        def job():
            watched = {canonical(p) for p in self.control.manifests}
            return entries.evict(self.store, req, home=self.home, watched=watched)

        done = self.write("evict", job)
        for m, why in done.unknown:
            log.warning("evict --stale kept %s %r of %s: %s", m.key.hex(), m.label, m.model, why)
        for o in done.owned:  # evicted all the same: the next reconcile of that manifest re-warms
            log.info(
                "evicted pin %r is kept by manifest %s (%s)",
                o.label,
                o.manifest,
                "re-warmed at its next reconcile" if o.watched else "not watched",
            )
        return done.reply()

    def cmd_repair(self, req: RepairRequest, conn: Connection) -> RepairReply:
        """`kvstore verify --repair`: check every entry and learned record and delete the bad
        ones, as one writer job (it decodes, so it runs on the main thread too)."""
        reply = self.write(
            "repair",
            lambda: verify.check(self.store, self.upkeep.blocks, home=self.home, repair=True),
        )
        for p in reply.problems:
            log.warning("repair: deleted entry %s: %s", p.key.hex(), p.reason)
        for p in reply.record_problems:
            log.warning("repair: deleted learned record %s: %s", p.key.hex(), p.reason)
        return reply

    def cmd_warm(self, req: WarmRequest, conn: Connection) -> WarmReply:
        """Reconcile one manifest (or, without one, re-read settings and reconcile every manifest
        the daemon watches, as SIGHUP does). A manifest warmed here is watched from then on, so
        its pins stay true."""
        given = req.manifest
        if given is None:
            return WarmReply(self.control.reload("warm request").result())
        path = Path(given).expanduser().absolute()
        manifest = load_manifest(path)  # a bad manifest is the caller's error, not a log line
        self.control.watch(path)
        try:  # and from every later start too
            if register(self.home, manifest.path):
                log.info("registered manifest %s: reconciled and watched at every start", path)
        except KVStoreError as e:
            log.error("%s (watched until this daemon stops)", e)
        return WarmReply(
            [self.write("warm", lambda: self.upkeep.warm(manifest, cause="warm request"))]
        )

    def cmd_manifests(self, req: ManifestsRequest, conn: Connection) -> ManifestsReply:
        """The manifests watched now, and which of them the daemon was started with."""
        return ManifestsReply(
            watched=[str(p) for p in self.control.manifests],
            fixed=sorted(str(p) for p in self.control.fixed_manifests),
        )

    def cmd_manifest_remove(
        self, req: ManifestRemoveRequest, conn: Connection
    ) -> ManifestRemoveReply:
        """`kvstore manifests remove PATH`: forget a registered manifest and stop watching it
        (unless it is the manifest this daemon was started with). Its pins stay stored."""
        target, removed = manifest_ops.remove(self.home, req.path)
        fixed = target in self.control.fixed_manifests
        unwatched = False if fixed else self.control.unwatch(target)
        return ManifestRemoveReply(removed, unwatched, fixed)

    def cmd_touch(self, req: TouchRequest, conn: Connection) -> TouchReply:
        return TouchReply(self.write("touch", lambda: entries.touch(self.store, req.keys)))

    def cmd_record(self, req: RecordRequest, conn: Connection) -> RecordReply:
        records = validate(req.records)  # a bad record is the client's error: BAD_ARGUMENT
        return RecordReply(self.write("record", lambda: self.ledger.append(records)))

    # -- learned prefixes (kvstore.daemon.learn) ------------------------------------------------

    def cmd_learn(self, req: LearnRequest, conn: Connection) -> LearnReply:
        return self.learning.learn(req)

    def cmd_put_blocks(self, req: PutBlocksRequest, conn: Connection) -> PutBlocksReply:
        return self.learning.put_blocks(req)

    def cmd_touch_blocks(self, req: TouchBlocksRequest, conn: Connection) -> TouchBlocksReply:
        return self.learning.touch_blocks(req)

    # -- the fleet tier's semantic check (kvstore.fleet.check) ----------------------------------

    def cmd_fleet_checked(self, req: FleetCheckedRequest, conn: Connection) -> FleetCheckedReply:
        """A client checked entries fetched from the fleet against its model: record it."""
        from kvstore.ops.fleet import fleet_checked

        return self.write("fleet_checked", lambda: fleet_checked(self.store, self.home, req))

    def dispatch(self, msg: dict[str, Any], conn: Connection) -> dict[str, Any]:
        """One frame in, one frame out: the request the operations table names, decoded; its
        handler's reply encoded, or an error reply with its code."""
        cmd, args = msg.get("cmd"), msg.get("args", {})
        kind = OPS.get(cmd) if isinstance(cmd, str) else None
        if kind is None or not isinstance(cmd, str):
            return protocol.error(f"unknown command {cmd!r}", ErrorCode.UNKNOWN_OP)
        if not isinstance(args, dict):
            return protocol.error(f"{cmd}: args must be a map", ErrorCode.BAD_ARGUMENT)
        conn.close_after_reply = kind.streams(args)
        with daemon_handler(f"{cmd} failed", logger=log) as failed:  # a bug costs one request
            try:
                return protocol.ok(self.handlers[cmd](kind.from_wire(args), conn).to_wire())
            except (KVStoreError, ValueError, TypeError) as e:
                if not isinstance(e, StoreDamaged):  # the daemon said that once, and stops
                    log.warning("%s: %s", cmd, e)
                code = ErrorCode.REFUSED if isinstance(e, KVStoreError) else ErrorCode.BAD_ARGUMENT
                return protocol.error(f"{cmd}: {e}", code)
        bug = failed.error
        return protocol.error(
            f"{cmd}: internal error: {type(bug).__name__}: {bug}", ErrorCode.INTERNAL
        )
