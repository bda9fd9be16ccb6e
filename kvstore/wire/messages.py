"""Every request and reply on the daemon's socket: one definition, used by both ends.

Frames are kvstore.wire.protocol's: a request is `{"cmd": name, "args": Request.to_wire()}`, a
reply `{"ok": True, "result": Reply.to_wire()}` or `{"ok": False, "error": message, "code":
ErrorCode}` (kvstore.wire.codes). `from_wire` checks a request's arguments (kvstore.wire.args:
a bad one is a ValueError naming it, sent back as BAD_ARGUMENT) and reads a reply leniently (an
older daemon may leave a field out). Field names are the wire's keys and never change, so old and
new peers interoperate; a new field is added with a default. `OPS` maps each operation to its
(Request, Reply); `ping` answers PROTOCOL_VERSION and the operations the daemon has (a version-1
daemon answers neither: read as version 1).

Tokens are packed little-endian uint32, fingerprints 16 bytes, entry keys 32 (fingerprint +
H(tokens)), learned record keys fingerprint + H(end).

  ping -> {pid, home, uptime, protocol, ops}
  stats -> {**store.stats(), settings, daemon: {pid, uptime, rss, ...}, ledger, learned}
  ls {model, label} -> [entry meta as JSON, ...]
  put {key, fields: {tokens, label, model, pinned, template_hash, classes, extra}, nbytes,
       checksum, blob: bytes | None (None: the blob follows as {"data": bytes} frames)}
    -> {key, meta: packed EntryMeta}
  evict {keys: [key32], label, model, unpinned, stale, all: bool, to_size: int | None}
    -> {evicted, bytes, owned: [{label, model, manifest, watched}], keys: [hex],
        unknown: [{key: hex, label, model, reason}]}  (--stale kept what it cannot judge)
  repair -> {entries, problems: [{key, reason}], records, record_problems: [{key, reason}]}
  warm {manifest: path | None (every watched one)} -> {reports: [warm report as a map]}
  manifests -> {watched: [path], fixed: [path]}
  manifest_remove {path} -> {removed, unwatched, still_watched}
  touch {keys: [key32]} -> {touched}
  record {records: [ledger record]} -> {recorded}
  reload -> {reports}      shutdown -> {pid}
  learn {fingerprint, tokens (the request's prompt), sliceable: bool, model: str,
         label: str | None, extra: map}
    -> {want: [[start, end], ...] (records to send, cut at block_tokens; [] if none),
        snapshot_at: [p, ...] (state layouts: boundaries to put as learned entries),
        paused: str | None (why learning is paused; the client says it once)}
  put_blocks {fingerprint, tokens (at least to the last record's end),
              records: [{start, end, blob}] (at most MAX_RECORDS), label, model, extra}
    -> {stored: records accepted, bytes: bytes newly written} (sent after the commit)
  touch_blocks {fingerprint, keys: [fingerprint + H(end), ...] (records a client restored)}
    -> {touched: records still stored} (their last_used and hits: the learned LRU's order)
  fleet_checked {passed: [key32], refused: [{key: key32, ok: false, what, uploader, label}]}
    -> {passed: entries marked checked, deleted: entries deleted}  (kvstore.fleet.check: a
    client's verdicts on entries fetched from the fleet and pending their check)
A learned snapshot is an ordinary `put` with pinned=False, label "learned", extra.learned=True.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.store.entry import FINGERPRINT_BYTES, KEY_BYTES
from kvstore.wire.args import arg, key_list, prompt

PROTOCOL_VERSION = 2  # 1: no error codes, and ping answers no protocol or ops
MAX_RECORDS = 4096  # records in one put_blocks, keys in one touch_blocks


class Message:
    """A request or reply: its fields are the wire map's keys, in order."""

    def to_wire(self) -> Any:
        me: Any = self  # every message is a dataclass
        return {f.name: getattr(self, f.name) for f in fields(me)}

    @classmethod
    def from_wire(cls, d: Any) -> Any:
        """Lenient: a field the map lacks takes its default."""
        d = d if isinstance(d, dict) else {}
        kind: Any = cls
        return cls(**{f.name: d[f.name] for f in fields(kind) if f.name in d})


# -- requests without arguments --------------------------------------------------------------


@dataclass(frozen=True)
class Empty(Message):
    def to_wire(self) -> dict[str, Any]:
        return {}


# -- replies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PingReply(Message):
    pid: int = 0
    home: str = ""
    uptime: float = 0.0
    protocol: int = 1  # absent from a version-1 daemon's reply
    ops: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StatsReply(Message):
    """`stats`: the store's own numbers first, then the tables."""

    store: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    daemon: dict[str, Any] | None = None
    ledger: dict[str, Any] = field(default_factory=dict)
    learned: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        data = dict(self.store)
        data.update(settings=self.settings, daemon=self.daemon, ledger=self.ledger)
        data["learned"] = self.learned
        return data

    @classmethod
    def from_wire(cls, d: Any) -> StatsReply:
        d = dict(d) if isinstance(d, dict) else {}
        tables = {k: d.pop(k) for k in ("settings", "daemon", "ledger", "learned") if k in d}
        return cls(store=d, **tables)

    def to_local_json(self) -> dict[str, Any]:
        """What `kvstore stats --json` prints when it read the store itself (its key order)."""
        data = dict(self.store)
        if self.learned is not None:
            data["learned"] = self.learned
        data["ledger"] = self.ledger
        data["settings"] = self.settings
        return data


@dataclass(frozen=True)
class LsRequest(Message):
    model: str | None = None
    label: str | None = None

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> LsRequest:
        return cls(model=arg(d, "model", str), label=arg(d, "label", str))


@dataclass(frozen=True)
class LsReply(Message):
    entries: list[dict[str, Any]] = field(default_factory=list)  # EntryMeta.to_json() each

    def to_wire(self) -> list[dict[str, Any]]:
        return list(self.entries)

    @classmethod
    def from_wire(cls, d: Any) -> LsReply:
        return cls(entries=list(d) if isinstance(d, list) else [])


EVICT_FILTERS = ("keys", "label", "model", "unpinned", "stale", "all", "to_size")


@dataclass(frozen=True)
class EvictRequest(Message):
    """The filters of `kvstore evict`; full 32-byte keys (the CLI resolves hex prefixes)."""

    keys: list[bytes] = field(default_factory=list)
    label: str | None = None
    model: str | None = None
    unpinned: bool = False
    stale: bool = False
    all: bool = False
    to_size: int | None = None

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> EvictRequest:
        keys = key_list(d, "keys", KEY_BYTES)
        # to_size=0 is a filter ("down to 0 bytes"), not its absence.
        if not any(d.get(f) for f in EVICT_FILTERS if f != "to_size") and (
            d.get("to_size") is None
        ):
            raise ValueError(f"name what to evict: one of {', '.join(EVICT_FILTERS)}")
        return cls(
            keys=keys,
            label=arg(d, "label", str),
            model=arg(d, "model", str),
            unpinned=bool(d.get("unpinned")),
            stale=bool(d.get("stale")),
            all=bool(d.get("all")),
            to_size=arg(d, "to_size", int),
        )


@dataclass(frozen=True)
class Owned:
    """An evicted pin a manifest still names (it comes back when that manifest is reconciled)."""

    label: str
    model: str
    manifest: str
    watched: bool


@dataclass(frozen=True)
class Unknown:
    """An entry `--stale` kept: its staleness cannot be judged here."""

    key: str  # hex
    label: str
    model: str
    reason: str


@dataclass(frozen=True)
class EvictReply(Message):
    evicted: int = 0
    bytes: int = 0
    owned: list[Owned] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # hex
    unknown: list[Unknown] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "evicted": self.evicted,
            "bytes": self.bytes,
            "owned": [vars(o).copy() for o in self.owned],
            "keys": list(self.keys),
            "unknown": [vars(u).copy() for u in self.unknown],
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> EvictReply:
        return cls(
            evicted=d.get("evicted", 0),
            bytes=d.get("bytes", 0),
            owned=[Owned(**o) for o in d.get("owned") or []],
            keys=list(d.get("keys") or []),
            unknown=[Unknown(**u) for u in d.get("unknown") or []],
        )


@dataclass(frozen=True)
class Problem:
    key: bytes
    reason: str


@dataclass(frozen=True)
class RepairReply(Message):
    entries: int = 0
    problems: list[Problem] = field(default_factory=list)
    records: int = 0  # an older daemon checks entries only
    record_problems: list[Problem] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "entries": self.entries,
            "problems": [{"key": p.key, "reason": p.reason} for p in self.problems],
            "records": self.records,
            "record_problems": [{"key": p.key, "reason": p.reason} for p in self.record_problems],
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RepairReply:
        def problems(rows: Any) -> list[Problem]:
            return [Problem(bytes(p["key"]), p["reason"]) for p in rows or []]

        return cls(
            entries=d.get("entries", 0),
            problems=problems(d.get("problems")),
            records=d.get("records", 0),
            record_problems=problems(d.get("record_problems")),
        )


@dataclass(frozen=True)
class WarmRequest(Message):
    manifest: str | None = None  # None: every manifest the daemon watches

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> WarmRequest:
        return cls(manifest=arg(d, "manifest", str))


@dataclass(frozen=True)
class WarmReply(Message):
    reports: list[dict[str, Any]] = field(default_factory=list)  # kvstore.ops.warm: to_wire


@dataclass(frozen=True)
class ManifestsReply(Message):
    watched: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ManifestRemoveRequest(Message):
    path: str = ""

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ManifestRemoveRequest:
        return cls(path=arg(d, "path", str, required=True))


@dataclass(frozen=True)
class ManifestRemoveReply(Message):
    removed: bool = False
    unwatched: bool = False
    still_watched: bool = False


@dataclass(frozen=True)
class TouchRequest(Message):
    keys: list[bytes] = field(default_factory=list)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> TouchRequest:
        return cls(keys=key_list(d, "keys", KEY_BYTES, required=True))


@dataclass(frozen=True)
class TouchReply(Message):
    touched: int = 0


@dataclass(frozen=True)
class RecordRequest(Message):
    records: list[dict[str, Any]] = field(default_factory=list)  # kvstore.store.ledger records

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RecordRequest:
        from kvstore.store.ledger import validate

        return cls(records=validate(d.get("records")))


@dataclass(frozen=True)
class RecordReply(Message):
    recorded: int = 0


@dataclass(frozen=True)
class ShutdownReply(Message):
    pid: int = 0


@dataclass(frozen=True)
class PutRequest(Message):
    """A put's arguments, typed; its fields and sizes are checked by kvstore.ops.put."""

    key: bytes = b""
    fields: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    checksum: int = 0
    blob: Any = None  # bytes inline, or None: streamed after the request

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PutRequest:
        return cls(
            key=arg(d, "key", bytes, required=True),
            fields=dict(arg(d, "fields", dict, required=True)),
            nbytes=arg(d, "nbytes", int, required=True),
            checksum=arg(d, "checksum", int, required=True),
            blob=d.get("blob"),
        )


@dataclass(frozen=True)
class PutReply(Message):
    key: bytes = b""
    meta: bytes = b""


@dataclass(frozen=True)
class LearnRequest(Message):
    fingerprint: bytes = b""
    tokens: bytes = b""
    sliceable: bool = False
    model: str = ""
    label: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> LearnRequest:
        fp, tokens = prompt(d)
        return cls(
            fingerprint=fp,
            tokens=tokens,
            sliceable=bool(arg(d, "sliceable", bool, False)),
            model=arg(d, "model", str, ""),
            label=d.get("label"),
            extra=d.get("extra") or {},
        )


@dataclass(frozen=True)
class LearnReply(Message):
    want: list[list[int]] = field(default_factory=list)
    snapshot_at: list[int] = field(default_factory=list)
    paused: str | None = None
    paused_by: str | None = None  # "write_budget" or "learned_budget" (older daemons: None)

    @classmethod
    def from_wire(cls, d: Any) -> LearnReply:
        d = d if isinstance(d, dict) else {}
        return cls(
            want=[[int(s), int(e)] for s, e in d.get("want") or []],
            snapshot_at=[int(p) for p in d.get("snapshot_at") or []],
            paused=d.get("paused"),
            paused_by=d.get("paused_by") if isinstance(d.get("paused_by"), str) else None,
        )


@dataclass(frozen=True)
class Record:
    start: int
    end: int
    blob: bytes


@dataclass(frozen=True)
class PutBlocksRequest(Message):
    fingerprint: bytes = b""
    tokens: bytes = b""
    records: list[Record] = field(default_factory=list)
    label: str = "learned"
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        d = super().to_wire()
        d["records"] = [vars(r).copy() for r in self.records]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PutBlocksRequest:
        fp, tokens = prompt(d)
        records = arg(d, "records", list, required=True)
        label = arg(d, "label", str, "learned")
        model = arg(d, "model", str, "")
        extra = arg(d, "extra", dict, {})
        if len(records) > MAX_RECORDS:
            raise ValueError(f"at most {MAX_RECORDS} records in one put_blocks")
        rows = []
        for i, r in enumerate(records):
            if not isinstance(r, dict):
                raise ValueError(f"record {i} is not a map")
            start, end = arg(r, "start", int, required=True), arg(r, "end", int, required=True)
            rows.append(Record(start, end, arg(r, "blob", bytes, required=True)))
        return cls(fp, tokens, rows, label, model, extra)


@dataclass(frozen=True)
class PutBlocksReply(Message):
    stored: int = 0  # records accepted
    bytes: int = 0  # bytes newly written


@dataclass(frozen=True)
class TouchBlocksRequest(Message):
    fingerprint: bytes = b""
    keys: list[bytes] = field(default_factory=list)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> TouchBlocksRequest:
        fp = arg(d, "fingerprint", bytes, required=True)
        keys = arg(d, "keys", list, required=True)
        if len(fp) != FINGERPRINT_BYTES or len(keys) > MAX_RECORDS:
            raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, at most "
                             f"{MAX_RECORDS} keys")  # fmt: skip
        if not all(isinstance(k, bytes) and len(k) == 2 * FINGERPRINT_BYTES and k.startswith(fp)
                   for k in keys):  # fmt: skip
            raise ValueError("argument 'keys' must be record keys (fingerprint + position hash)")
        return cls(fp, keys)


@dataclass(frozen=True)
class TouchBlocksReply(Message):
    touched: int = 0  # records still stored


@dataclass(frozen=True)
class FleetCheckedRequest(Message):
    """The semantic check's verdicts on pending fetched entries (kvstore.fleet.check)."""

    passed: list[bytes] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)  # key, what, uploader, label

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> FleetCheckedRequest:
        passed = key_list(d, "passed", KEY_BYTES)
        refused = arg(d, "refused", list, [])
        if len(passed) + len(refused) > MAX_RECORDS:
            raise ValueError(f"at most {MAX_RECORDS} verdicts in one fleet_checked")
        for r in refused:
            if not (isinstance(r, dict) and isinstance(r.get("key"), bytes)
                    and len(r["key"]) == KEY_BYTES):  # fmt: skip
                raise ValueError("argument 'refused' must be maps with a 32-byte 'key'")
            for name in ("what", "uploader", "label"):
                if not isinstance(r.get(name), (str, type(None))):
                    raise ValueError(f"argument 'refused': {name!r} must be a string")
        return cls(passed, refused)


@dataclass(frozen=True)
class FleetCheckedReply(Message):
    passed: int = 0  # entries marked checked
    deleted: int = 0  # entries deleted: refused, or pending from a box now quarantined


# name -> (Request, Reply); `reload` answers as `warm` does.
OPS: dict[str, tuple[type[Message], type[Message]]] = {
    "ping": (Empty, PingReply),
    "stats": (Empty, StatsReply),
    "ls": (LsRequest, LsReply),
    "manifests": (Empty, ManifestsReply),
    "put": (PutRequest, PutReply),
    "evict": (EvictRequest, EvictReply),
    "repair": (Empty, RepairReply),
    "warm": (WarmRequest, WarmReply),
    "manifest_remove": (ManifestRemoveRequest, ManifestRemoveReply),
    "touch": (TouchRequest, TouchReply),
    "record": (RecordRequest, RecordReply),
    "reload": (Empty, WarmReply),
    "shutdown": (Empty, ShutdownReply),
    "learn": (LearnRequest, LearnReply),
    "put_blocks": (PutBlocksRequest, PutBlocksReply),
    "touch_blocks": (TouchBlocksRequest, TouchBlocksReply),
    "fleet_checked": (FleetCheckedRequest, FleetCheckedReply),
}
READS = frozenset({"ping", "stats", "ls", "manifests"})  # not worth a log line each
