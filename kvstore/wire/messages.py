"""Every request and reply on the daemon's socket: one definition, used by both ends.

Frames are kvstore.wire.protocol's: a request is `{"cmd": Request.op, "args": Request.to_wire()}`,
a reply `{"ok": True, "result": Reply.to_wire()}` or `{"ok": False, "error": message, "code":
ErrorCode}` (kvstore.wire.codes). Each Request class names its operation (`op`) and its Reply
class (`reply`), so `DaemonClient.send(request)` is typed by what it sends, and the daemon's
handler for an operation takes that Request and returns that Reply. `from_wire` checks a
request's arguments (kvstore.wire.args: a bad one is a ValueError naming it, sent back as
BAD_ARGUMENT) and reads a reply leniently (a field the map lacks takes its default). Field names
are the wire's keys. `OPS` maps each operation to its Request; `ping` answers PROTOCOL_VERSION and
the operations the daemon has, and a client refuses a daemon of another version at connect.

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
  learn {fingerprint, tokens (the request's prompt), sliceable: bool, model: str,
         label: str | None, extra: map}
    -> {want: [[start, end], ...] (records to send, cut at block_tokens; [] if none),
        snapshot_at: [p, ...] (state layouts: boundaries to put as learned entries),
        paused: str | None (why learning is paused; the client says it once), paused_by}
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

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Generic, TypeVar

from kvstore.wire.args import FINGERPRINT_BYTES, KEY_BYTES, arg, key_list, prompt

PROTOCOL_VERSION = 2  # the one version a client and a daemon both speak (checked at connect)
MAX_RECORDS = 4096  # records in one put_blocks, keys in one touch_blocks

WireMap = dict[str, Any]  # a request's arguments, and most replies' result
Wire = WireMap | list[Any]  # a reply's result (`ls` answers a list)

Q = TypeVar("Q", bound="Request[Any]")
P = TypeVar("P", bound="Reply")
R = TypeVar("R", bound="Reply")


def _fields_map(message: Any) -> WireMap:
    """A dataclass message's fields as the wire map's keys, in order."""
    return {f.name: getattr(message, f.name) for f in fields(message)}


class Reply:
    """What the daemon answers to one operation."""

    def to_wire(self) -> Wire:
        return _fields_map(self)

    @classmethod
    def from_wire(cls: type[P], d: object) -> P:
        """Lenient: a field the map lacks takes its default."""
        got = d if isinstance(d, dict) else {}
        return cls(**{f.name: got[f.name] for f in fields(cls) if f.name in got})  # type: ignore[arg-type]


class Request(Generic[R]):
    """One operation's arguments. A subclass sets `op` (its name on the wire) and `reply` (the
    Reply class it is answered with, and the type parameter R); `waits`: its reply may take as
    long as the work (a put queues behind a warm), so the client waits without a timeout."""

    op: ClassVar[str]
    reply: ClassVar[type[Reply]]
    waits: ClassVar[bool] = False

    def to_wire(self) -> WireMap:
        return _fields_map(self)

    @classmethod
    def from_wire(cls: type[Q], d: WireMap) -> Q:
        return cls()

    @classmethod
    def streams(cls, args: WireMap) -> bool:
        """Whether frames beyond the request follow it (a put's blob): a failure before they are
        read must close the connection rather than parse them as requests."""
        return False


# -- ping, stats, ls, manifests: the reads ----------------------------------------------------


@dataclass(frozen=True)
class PingReply(Reply):
    pid: int = 0
    home: str = ""
    uptime: float = 0.0
    protocol: int = 0  # a daemon that does not say speaks no version a client accepts
    ops: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PingRequest(Request[PingReply]):
    op = "ping"
    reply = PingReply


@dataclass(frozen=True)
class StatsReply(Reply):
    """`stats`: the store's own numbers first, then the tables."""

    store: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    daemon: dict[str, Any] | None = None
    ledger: dict[str, Any] = field(default_factory=dict)
    learned: dict[str, Any] | None = None

    def to_wire(self) -> WireMap:
        data = dict(self.store)
        data.update(settings=self.settings, daemon=self.daemon, ledger=self.ledger)
        data["learned"] = self.learned
        return data

    @classmethod
    def from_wire(cls, d: object) -> StatsReply:
        got = dict(d) if isinstance(d, dict) else {}
        tables = {k: got.pop(k) for k in ("settings", "daemon", "ledger", "learned") if k in got}
        return cls(store=got, **tables)

    def to_local_json(self) -> WireMap:
        """What `kvstore stats --json` prints when it read the store itself (its key order)."""
        data = dict(self.store)
        if self.learned is not None:
            data["learned"] = self.learned
        data["ledger"] = self.ledger
        data["settings"] = self.settings
        return data


@dataclass(frozen=True)
class StatsRequest(Request[StatsReply]):
    op = "stats"
    reply = StatsReply


@dataclass(frozen=True)
class LsReply(Reply):
    entries: list[dict[str, Any]] = field(default_factory=list)  # EntryMeta.to_json() each

    def to_wire(self) -> list[dict[str, Any]]:
        return list(self.entries)

    @classmethod
    def from_wire(cls, d: object) -> LsReply:
        return cls(entries=list(d) if isinstance(d, list) else [])


@dataclass(frozen=True)
class LsRequest(Request[LsReply]):
    op = "ls"
    reply = LsReply

    model: str | None = None  # a model's name (kvstore.identity.model.model_name, the sender's)
    label: str | None = None

    @classmethod
    def from_wire(cls, d: WireMap) -> LsRequest:
        return cls(model=arg(d, "model", str), label=arg(d, "label", str))


@dataclass(frozen=True)
class ManifestsReply(Reply):
    watched: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ManifestsRequest(Request[ManifestsReply]):
    op = "manifests"
    reply = ManifestsReply


# -- entries -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PutReply(Reply):
    key: bytes = b""
    meta: bytes = b""  # the stored entry's meta, packed (kvstore.store.entry.EntryMeta.unpack)


@dataclass(frozen=True)
class PutRequest(Request[PutReply]):
    """A put's arguments, typed; its fields and sizes are checked by kvstore.ops.put. A blob
    over protocol.CHUNK_BYTES is not in the request: the client streams it after it."""

    op = "put"
    reply = PutReply
    waits = True  # the put queues behind any warm in progress

    key: bytes = b""
    fields: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    checksum: int = 0
    blob: bytes | bytearray | None = None  # inline, or None: streamed after the request

    @classmethod
    def from_wire(cls, d: WireMap) -> PutRequest:
        blob = d.get("blob")
        if blob is not None and not isinstance(blob, bytes):
            raise ValueError("argument 'blob' must be bytes")
        return cls(
            key=arg(d, "key", bytes, required=True),
            fields=dict(arg(d, "fields", dict, required=True)),
            nbytes=arg(d, "nbytes", int, required=True),
            checksum=arg(d, "checksum", int, required=True),
            blob=blob,
        )

    @classmethod
    def streams(cls, args: WireMap) -> bool:
        return args.get("blob") is None


EVICT_FILTERS = ("keys", "label", "model", "unpinned", "stale", "all", "to_size")


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
class EvictReply(Reply):
    evicted: int = 0
    bytes: int = 0
    owned: list[Owned] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # hex
    unknown: list[Unknown] = field(default_factory=list)

    def to_wire(self) -> WireMap:
        return {
            "evicted": self.evicted,
            "bytes": self.bytes,
            "owned": [vars(o).copy() for o in self.owned],
            "keys": list(self.keys),
            "unknown": [vars(u).copy() for u in self.unknown],
        }

    @classmethod
    def from_wire(cls, d: object) -> EvictReply:
        got = d if isinstance(d, dict) else {}
        return cls(
            evicted=got.get("evicted", 0),
            bytes=got.get("bytes", 0),
            owned=[Owned(**o) for o in got.get("owned") or []],
            keys=list(got.get("keys") or []),
            unknown=[Unknown(**u) for u in got.get("unknown") or []],
        )


@dataclass(frozen=True)
class EvictRequest(Request[EvictReply]):
    """The filters of `kvstore evict`; full 32-byte keys (the CLI resolves hex prefixes)."""

    op = "evict"
    reply = EvictReply

    keys: list[bytes] = field(default_factory=list)
    label: str | None = None
    model: str | None = None  # a model's name, as LsRequest's
    unpinned: bool = False
    stale: bool = False
    all: bool = False
    to_size: int | None = None

    @classmethod
    def from_wire(cls, d: WireMap) -> EvictRequest:
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
class Problem:
    key: bytes
    reason: str


@dataclass(frozen=True)
class RepairReply(Reply):
    entries: int = 0
    problems: list[Problem] = field(default_factory=list)
    records: int = 0
    record_problems: list[Problem] = field(default_factory=list)

    def to_wire(self) -> WireMap:
        return {
            "entries": self.entries,
            "problems": [{"key": p.key, "reason": p.reason} for p in self.problems],
            "records": self.records,
            "record_problems": [{"key": p.key, "reason": p.reason} for p in self.record_problems],
        }

    @classmethod
    def from_wire(cls, d: object) -> RepairReply:
        got = d if isinstance(d, dict) else {}

        def problems(rows: Any) -> list[Problem]:
            return [Problem(bytes(p["key"]), p["reason"]) for p in rows or []]

        return cls(
            entries=got.get("entries", 0),
            problems=problems(got.get("problems")),
            records=got.get("records", 0),
            record_problems=problems(got.get("record_problems")),
        )


@dataclass(frozen=True)
class RepairRequest(Request[RepairReply]):
    op = "repair"
    reply = RepairReply
    waits = True  # it decodes every entry


@dataclass(frozen=True)
class TouchReply(Reply):
    touched: int = 0


@dataclass(frozen=True)
class TouchRequest(Request[TouchReply]):
    op = "touch"
    reply = TouchReply

    keys: list[bytes] = field(default_factory=list)

    @classmethod
    def from_wire(cls, d: WireMap) -> TouchRequest:
        return cls(keys=key_list(d, "keys", KEY_BYTES, required=True))


@dataclass(frozen=True)
class RecordReply(Reply):
    recorded: int = 0


@dataclass(frozen=True)
class RecordRequest(Request[RecordReply]):
    """Prefill ledger records; each record's fields are checked where they are kept
    (kvstore.home.ledger `validate`, by the daemon's handler)."""

    op = "record"
    reply = RecordReply

    records: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_wire(cls, d: WireMap) -> RecordRequest:
        records = d.get("records")
        if not isinstance(records, list):
            raise ValueError("records must be a list of maps")
        return cls(records=records)


# -- manifests -----------------------------------------------------------------------------


# What a warm did (kvstore.warm.warm makes it; the daemon's warm reply carries it).
class PinStatus(str, Enum):
    """What a warm did with one pin. The values are what the CLI prints and the wire carries."""

    PRESENT = "present"  # stored already
    WARMED = "warmed"  # prefilled here
    FETCHED = "fetched"  # from the fleet tier
    FAILED = "failed"  # `error` says why
    DEFERRED = "deferred"  # not enough memory to load the model now (the daemon retries)

    def __str__(self) -> str:  # "warmed", never "PinStatus.WARMED", in an f-string
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass
class PinResult:
    model: str
    name: str
    key: str
    tokens: int
    status: PinStatus  # a plain string (from the wire) is read as its member
    seconds: float = 0.0
    nbytes: int = 0
    warning: str | None = None
    error: str | None = None
    valid_date: str | None = None  # clock-bound pin: the local date it holds for
    multi_turn: bool | None = None  # also prefixes 2nd and later turns
    remote: str | None = None  # why the fleet tier was or was not used for this pin

    def __post_init__(self) -> None:
        self.status = PinStatus(self.status)


@dataclass
class WarmReport:
    pins: list[PinResult] = field(default_factory=list)
    purged: list[Purged] = field(default_factory=list)
    released: list[Purged] = field(default_factory=list)  # kept for their other owners
    adopted: int = 0  # present pins this manifest became an owner of
    models_loaded: int = 0
    seconds: float = 0.0
    stopped: str | None = None  # why warming stopped early (a full disk): the rest is unwarmed
    manifest: str | None = None  # its path, where the daemon warmed it

    def to_wire(self) -> WireMap:
        """Its fields, then counts for a reader's glance (the warm reply's map)."""
        failed, deferred = len(self.failed), len(self.deferred)
        return {**asdict(self), "warmed": self.warmed, "failed": failed, "deferred": deferred}

    @classmethod
    def from_wire(cls, d: WireMap) -> WarmReport:
        return cls(
            pins=[PinResult(**p) for p in d.get("pins", [])],
            purged=[Purged(**p) for p in d.get("purged", [])],
            released=[Purged(**p) for p in d.get("released", [])],
            adopted=d.get("adopted", 0),
            models_loaded=d.get("models_loaded", 0),
            seconds=d.get("seconds", 0.0),
            stopped=d.get("stopped"),
            manifest=d.get("manifest"),
        )

    @property
    def warmed(self) -> int:
        return sum(p.status is PinStatus.WARMED for p in self.pins)

    @property
    def fetched(self) -> int:
        return sum(p.status is PinStatus.FETCHED for p in self.pins)

    @property
    def failed(self) -> list[PinResult]:
        return [p for p in self.pins if p.status is PinStatus.FAILED]

    @property
    def deferred(self) -> list[PinResult]:
        return [p for p in self.pins if p.status is PinStatus.DEFERRED]


@dataclass
class Purged:
    key: str
    label: str
    model: str
    cause: str
    released: bool = False  # only this manifest's ownership went: other owners keep the entry


@dataclass(frozen=True)
class WarmReply(Reply):
    reports: list[WarmReport] = field(default_factory=list)

    def to_wire(self) -> WireMap:
        return {"reports": [r.to_wire() for r in self.reports]}

    @classmethod
    def from_wire(cls, d: object) -> WarmReply:
        reports = d.get("reports") if isinstance(d, dict) else None
        return cls([WarmReport.from_wire(r) for r in reports or ()])


@dataclass(frozen=True)
class WarmRequest(Request[WarmReply]):
    op = "warm"
    reply = WarmReply
    waits = True  # a warm prefills

    manifest: str | None = None  # None: every manifest the daemon watches

    @classmethod
    def from_wire(cls, d: WireMap) -> WarmRequest:
        return cls(manifest=arg(d, "manifest", str))


@dataclass(frozen=True)
class ManifestRemoveReply(Reply):
    removed: bool = False
    unwatched: bool = False
    still_watched: bool = False


@dataclass(frozen=True)
class ManifestRemoveRequest(Request[ManifestRemoveReply]):
    op = "manifest_remove"
    reply = ManifestRemoveReply

    path: str = ""

    @classmethod
    def from_wire(cls, d: WireMap) -> ManifestRemoveRequest:
        return cls(path=arg(d, "path", str, required=True))


# -- learned prefixes ------------------------------------------------------------------------


@dataclass(frozen=True)
class LearnReply(Reply):
    want: list[list[int]] = field(default_factory=list)
    snapshot_at: list[int] = field(default_factory=list)
    paused: str | None = None
    paused_by: str | None = None  # "write_budget" or "learned_budget"

    @classmethod
    def from_wire(cls, d: object) -> LearnReply:
        got = d if isinstance(d, dict) else {}
        return cls(
            want=[[int(s), int(e)] for s, e in got.get("want") or []],
            snapshot_at=[int(p) for p in got.get("snapshot_at") or []],
            paused=got.get("paused"),
            paused_by=got.get("paused_by") if isinstance(got.get("paused_by"), str) else None,
        )


@dataclass(frozen=True)
class LearnRequest(Request[LearnReply]):
    op = "learn"
    reply = LearnReply

    fingerprint: bytes = b""
    tokens: bytes = b""
    sliceable: bool = False
    model: str = ""
    label: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, d: WireMap) -> LearnRequest:
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
class Record:
    start: int
    end: int
    blob: bytes


@dataclass(frozen=True)
class PutBlocksReply(Reply):
    stored: int = 0  # records accepted
    bytes: int = 0  # bytes newly written


@dataclass(frozen=True)
class PutBlocksRequest(Request[PutBlocksReply]):
    op = "put_blocks"
    reply = PutBlocksReply

    fingerprint: bytes = b""
    tokens: bytes = b""
    records: list[Record] = field(default_factory=list)
    label: str = "learned"
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> WireMap:
        d = super().to_wire()
        d["records"] = [vars(r).copy() for r in self.records]
        return d

    @classmethod
    def from_wire(cls, d: WireMap) -> PutBlocksRequest:
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
class TouchBlocksReply(Reply):
    touched: int = 0  # records still stored


@dataclass(frozen=True)
class TouchBlocksRequest(Request[TouchBlocksReply]):
    op = "touch_blocks"
    reply = TouchBlocksReply

    fingerprint: bytes = b""
    keys: list[bytes] = field(default_factory=list)

    @classmethod
    def from_wire(cls, d: WireMap) -> TouchBlocksRequest:
        fp = arg(d, "fingerprint", bytes, required=True)
        keys = arg(d, "keys", list, required=True)
        if len(fp) != FINGERPRINT_BYTES or len(keys) > MAX_RECORDS:
            raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, at most "
                             f"{MAX_RECORDS} keys")  # fmt: skip
        if not all(isinstance(k, bytes) and len(k) == 2 * FINGERPRINT_BYTES and k.startswith(fp)
                   for k in keys):  # fmt: skip
            raise ValueError("argument 'keys' must be record keys (fingerprint + position hash)")
        return cls(fp, keys)


# -- the fleet tier --------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetCheckedReply(Reply):
    passed: int = 0  # entries marked checked
    deleted: int = 0  # entries deleted: refused, or pending from a box now quarantined


@dataclass(frozen=True)
class FleetCheckedRequest(Request[FleetCheckedReply]):
    """The semantic check's verdicts on pending fetched entries (kvstore.fleet.check)."""

    op = "fleet_checked"
    reply = FleetCheckedReply

    passed: list[bytes] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)  # key, what, uploader, label

    @classmethod
    def from_wire(cls, d: WireMap) -> FleetCheckedRequest:
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


# The operations table: name -> Request (its `reply` is the Reply). The daemon registers one
# handler per entry and refuses to start when one is missing.
REQUESTS: tuple[type[Request[Any]], ...] = (
    PingRequest,
    StatsRequest,
    LsRequest,
    ManifestsRequest,
    PutRequest,
    EvictRequest,
    RepairRequest,
    WarmRequest,
    ManifestRemoveRequest,
    TouchRequest,
    RecordRequest,
    LearnRequest,
    PutBlocksRequest,
    TouchBlocksRequest,
    FleetCheckedRequest,
)
OPS: dict[str, type[Request[Any]]] = {r.op: r for r in REQUESTS}
READS = frozenset({"ping", "stats", "ls", "manifests"})  # not worth a log line each
