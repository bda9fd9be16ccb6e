"""The daemon's side of learned prefixes: the `learn` and `put_blocks` commands, the cap on
learned snapshot entries, and the metrics port. The policy itself is `kvstore.learn`; records
are `kvstore.store.blocks`. Mixed into the Daemon with its Commands.

learn {fingerprint: bytes16, tokens: packed u32 prompt, sliceable: bool, model: str,
       label: str|None, extra: dict}
  -> {want: [[start, end], ...], snapshot_at: [p, ...], paused: str|None}
put_blocks {fingerprint, tokens, records: [{start, end, blob}], label, model, extra}
  -> {stored: int (records accepted), bytes: int (bytes newly written)}
touch_blocks {fingerprint, keys: [fingerprint + H(end), ...]}
  -> {touched: int (records still stored)}: restores count as use in the learned LRU
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from kvstore import metrics
from kvstore.errors import KVStoreError
from kvstore.learn import MIN_LCP, LearnPolicy, worth_storing
from kvstore.settings import DEFAULTS
from kvstore.store.blocks import BlockStore, is_snapshot, learned_summary, today
from kvstore.store.chain import chain_hashes, position_hash
from kvstore.store.entry import FINGERPRINT_BYTES, EntryMeta, packed_prefix_hash

if TYPE_CHECKING:
    from kvstore.daemon.connection import Connection

log = logging.getLogger("kvstore.daemon")

MAX_RECORDS = 4096  # records in one put_blocks


def _arg(args: dict, name: str, kind: type | tuple, default: Any = None, required=False) -> Any:
    value = args.get(name)
    if value is None:
        if required:
            raise ValueError(f"argument {name!r} is required")
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"argument {name!r} must be {kind}, not {type(value).__name__}")
    return value


def _prompt(args: dict) -> tuple[bytes, bytes]:
    fp = _arg(args, "fingerprint", bytes, required=True)
    tokens = _arg(args, "tokens", bytes, required=True)
    if len(fp) != FINGERPRINT_BYTES or len(tokens) % 4:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, tokens packed uint32")
    return fp, tokens


class Learning:
    """Learned prefixes, mixed into the Daemon (which provides store, upkeep, ledger, settings,
    write)."""

    def init_learning(self) -> None:
        self._learn_lock = threading.Lock()  # connection threads share the policy
        self._bytes_per_token: dict[bytes, float] = {}  # per fingerprint, from put_blocks
        self._paused: str | None = None
        self._metrics_server: Any = None
        self.policy = LearnPolicy(
            min_requests=int(self._setting("learn_min_requests")),  # type: ignore[attr-defined]
            block=self.blocks.block,
        )

    def _setting(self, name: str) -> Any:
        return self.settings.get(name, DEFAULTS[name])  # type: ignore[attr-defined]

    @property
    def blocks(self) -> BlockStore:
        return self.upkeep.blocks  # type: ignore[attr-defined]

    def _prefill_tps(self, model: str) -> float | None:
        rows = [r for r in self.ledger.stats()["by_model_label"] if r["model"] == model]  # type: ignore[attr-defined]
        tokens, seconds = (
            sum(r["prefilled_tokens"] for r in rows),
            sum(r["prefill_s"] for r in rows),
        )
        return tokens / seconds if tokens and seconds > 0 else None

    def _pinned_end(self, fp: bytes, data: bytes) -> int:
        """Tokens of the longest pin of this model that prefixes `data` (packed), or 0."""
        best = 0
        for m in self.store.metas(fp, errors=[]):  # type: ignore[attr-defined]
            if m.pinned and not is_snapshot(m) and len(m.tokens) > 4 * best:
                if data.startswith(m.tokens):
                    best = len(m.tokens) // 4
        return best

    def learn_paused(self) -> str | None:
        """Why learning is paused now (the daily write budget), or None; logged once a day."""
        msg = self.policy.paused(
            written_today=self.blocks.written_today(),
            write_budget=int(self._setting("learn_write_bytes_per_day")),
        )
        self._note_paused(msg)
        return msg

    def _note_paused(self, msg: str | None) -> None:
        self._paused = msg
        metrics.LEARN_PAUSED.set(1 if msg else 0)
        if msg and self.policy.first_time(msg, today()):
            log.warning("%s", msg)

    def cmd_learn(self, args: dict, conn: Connection) -> dict[str, Any]:
        fp, data = _prompt(args)
        sliceable = bool(_arg(args, "sliceable", bool, False))
        model = _arg(args, "model", str, "")
        policy = self.policy
        hashes = chain_hashes(fp, data, policy.block)
        with self._learn_lock:
            end = policy.learned_end(fp, data, hashes)
        reply: dict[str, Any] = {"want": [], "snapshot_at": [], "paused": None}
        paused = self.learn_paused()
        if paused:
            reply["paused"] = paused
            return reply
        if end == 0:
            return reply
        bpt = self._bytes_per_token.get(fp)
        if not worth_storing(bpt and bpt * end, end, self._prefill_tps(model)):
            log.debug("learn: %d tokens of %s not worth storing (prefill is faster)", end, model)
            return reply
        if sliceable:
            stored = min(self.blocks.stored_end(fp, data[: 4 * end]), end)
            if stored >= end or end - self._pinned_end(fp, data[: 4 * end]) < MIN_LCP:
                return reply  # stored: as records, or in a pin (one copy)
            why = policy.paused(
                written_today=0,
                write_budget=1,
                want_bytes=int(bpt * (end - stored)) if bpt else None,
                learned_budget=int(self._setting("learned_max_bytes")),
            )
            if why:
                self._note_paused(why)
                reply["paused"] = why
                return reply
            with self._learn_lock:
                reply["want"] = [list(r) for r in policy.wants(fp, data, hashes, stored, end)]
        else:
            key = fp + packed_prefix_hash(data[: 4 * end])
            if self.store.get_meta(key) is None:  # type: ignore[attr-defined]
                marker = b"snap" + key
                with self._learn_lock:
                    now = policy.clock()
                    if policy.inflight.get(marker, 0) <= now:
                        policy.inflight[marker] = now + policy.inflight_s
                        reply["snapshot_at"] = [end]
        if reply["want"] or reply["snapshot_at"]:
            log.info("learn: %s of %s: want %s, snapshot at %s", args.get("label") or "-",
                     model, reply["want"], reply["snapshot_at"])  # fmt: skip
        return reply

    def cmd_put_blocks(self, args: dict, conn: Connection) -> dict[str, Any]:
        fp, data = _prompt(args)
        records = _arg(args, "records", list, required=True)
        label = _arg(args, "label", str, "learned")
        model = _arg(args, "model", str, "")
        extra = _arg(args, "extra", dict, {})
        if len(records) > MAX_RECORDS:
            raise ValueError(f"at most {MAX_RECORDS} records in one put_blocks")
        rows = []
        for i, r in enumerate(records):
            if not isinstance(r, dict):
                raise ValueError(f"record {i} is not a map")
            start, end = _arg(r, "start", int, required=True), _arg(r, "end", int, required=True)
            blob = _arg(r, "blob", bytes, required=True)
            rows.append((start, end, blob))

        def job():
            written = self.blocks.put_records(
                fp, data, rows, label=label, extra={"model": model, **extra}
            )
            hashes = chain_hashes(fp, data, self.blocks.block)
            keys = [fp + position_hash(fp, data, e, self.blocks.block, hashes) for _, e, _ in rows]
            with self._learn_lock:
                self.policy.landed(keys)
            uploader = self.upkeep.uploader  # type: ignore[attr-defined]  # fleet tier, or None
            if uploader is not None and extra.get("origin") != "remote":  # pulled: there already
                uploader.notify_records(keys)
            ntok = sum(e - s for s, e, _ in rows)
            if ntok:
                self._bytes_per_token[fp] = sum(len(b) for *_, b in rows) / ntok
            metrics.WRITTEN_BYTES.labels(kind="learned").inc(written)
            log.info("put_blocks %r of %s: %d records, %d bytes written", label, model,
                     len(rows), written)  # fmt: skip
            self.upkeep.enforce_budget()  # type: ignore[attr-defined]
            self.learned_stats(self.store.metas(errors=[]))  # type: ignore[attr-defined]  # gauges
            return written

        written = self.write("put_blocks", job)  # type: ignore[attr-defined]
        return {"stored": len(rows), "bytes": written}

    def cmd_touch_blocks(self, args: dict, conn: Connection) -> dict[str, Any]:
        """Records a client restored from the store: used now (the learned LRU evicts the
        least recently used leaves, so a prefix restored every day stays)."""
        fp = _arg(args, "fingerprint", bytes, required=True)
        keys = _arg(args, "keys", list, required=True)
        if len(fp) != FINGERPRINT_BYTES or len(keys) > MAX_RECORDS:
            raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, at most "
                             f"{MAX_RECORDS} keys")  # fmt: skip
        if not all(isinstance(k, bytes) and len(k) == 2 * FINGERPRINT_BYTES and k.startswith(fp)
                   for k in keys):  # fmt: skip
            raise ValueError("argument 'keys' must be record keys (fingerprint + position hash)")
        return {"touched": self.write("touch_blocks", lambda: self.blocks.touch(keys))}  # type: ignore[attr-defined]

    def after_put(self, meta: EntryMeta) -> None:
        """On the writer thread after an entry was stored: a learned snapshot counts in the
        daily write budget and keeps at most max_snapshots_per_prefix per chain (the shallowest
        go)."""
        if not is_snapshot(meta):
            metrics.WRITTEN_BYTES.labels(kind="pin").inc(meta.nbytes)
            self.upkeep.drop_learned_under(meta)  # type: ignore[attr-defined]
            return
        metrics.WRITTEN_BYTES.labels(kind="learned").inc(meta.nbytes)
        self.blocks.count_written(meta.nbytes)
        cap = max(1, int(self._setting("max_snapshots_per_prefix")))  # type: ignore[attr-defined]
        same_chain = [
            m
            for m in self.store.metas(meta.fingerprint, errors=[])  # type: ignore[attr-defined]
            if is_snapshot(m) and (m.tokens.startswith(meta.tokens) or
                                   meta.tokens.startswith(m.tokens))
        ]  # fmt: skip
        same_chain.sort(key=lambda m: m.ntokens, reverse=True)
        drop = same_chain[cap:]
        if drop:
            self.store.delete(m.key for m in drop)  # type: ignore[attr-defined]
            for m in drop:
                metrics.EVICTIONS.labels(reason="snapshot_cap").inc()
                log.info(
                    "evicted learned snapshot %s (%d tokens): more than "
                    "max_snapshots_per_prefix=%d on its chain",
                    m.key.hex(),
                    m.ntokens,
                    cap,
                )

    def learned_stats(self, metas: list) -> dict[str, Any]:
        summary = learned_summary(self.blocks, metas, self.settings, self._paused)  # type: ignore[attr-defined]
        metrics.set_learned(summary)
        return summary

    # -- metrics port -------------------------------------------------------------------------

    def start_metrics(self, port: int | None) -> None:
        """Serve the metrics registry on 127.0.0.1:port (off when None)."""
        if port is None:
            return
        from prometheus_client import start_http_server

        try:
            server, _ = start_http_server(port, addr="127.0.0.1", registry=metrics.REGISTRY)
        except OSError as e:
            raise KVStoreError(f"--metrics-port {port}: cannot listen on 127.0.0.1: {e}") from None
        self._metrics_server = server
        self.learned_stats(self.store.metas(errors=[]))  # type: ignore[attr-defined]
        log.info("metrics on http://127.0.0.1:%d/metrics", server.server_port)

    def stop_metrics(self) -> None:
        server = getattr(self, "_metrics_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()
            self._metrics_server = None
