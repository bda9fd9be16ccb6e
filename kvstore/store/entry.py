"""What an entry is and how it is keyed: its 32-byte key, its meta record, and the checks that
tie them together.

Keys: model fingerprint (16 bytes) + xxh3-128 of the prefix token ids (16 bytes). Keys sort by
fingerprint, so one model's entries are one LMDB range scan. The hash only finds the candidate:
stored token ids are compared on every hit.

The meta record is what is stored beside each blob (msgpack). LMDB keeps no page checksums, so the
record carries its own: schema 2 stores the msgpack body with its xxh3-64
(`{"v": 2, "body": bytes, "sum": int}`). Schema 1 records (a bare map, no checksum) are still
read. Every read also checks that the tokens hash to the key's second half, so a flipped byte in
either is a CorruptEntryError naming the key, never a hit. The put operation records in the
meta's extra where the model resolved (kvstore.identity.fingerprint.model_location).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, get_args, get_origin, get_type_hints

import msgpack
import xxhash

from kvstore import tokens as tk
from kvstore.degrade import UNREADABLE
from kvstore.errors import CorruptEntryError
from kvstore.store.keys import FINGERPRINT_BYTES as FINGERPRINT_BYTES
from kvstore.store.keys import KEY_BYTES as KEY_BYTES
from kvstore.store.keys import digest_of, fingerprint_of

# -- keys ----------------------------------------------------------------------------------------
pack_tokens = tk.pack  # token ids as meta and keys hold them (kvstore.tokens: one layout)
unpack_tokens = tk.unpack


def prefix_hash(tokens: Sequence[int]) -> bytes:
    return packed_prefix_hash(pack_tokens(tokens))


def packed_prefix_hash(packed: bytes) -> bytes:
    """The key's second half from packed token ids (what every read re-checks)."""
    return xxhash.xxh3_128_digest(packed)


def entry_key(fingerprint: bytes, tokens: Sequence[int]) -> bytes:
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    return fingerprint + prefix_hash(tokens)


# -- meta ----------------------------------------------------------------------------------------
SCHEMA_VERSION = 2
LEGACY_SCHEMA_VERSION = 1  # a bare map without a checksum: read, re-checked, rewritten as 2
_META_FIELDS = (
    "tokens", "ntokens", "label", "pinned", "model", "fingerprint", "template_hash", "created",
    "last_used", "hits", "nbytes", "checksum", "codec", "classes",
)  # fmt: skip


def blob_checksum(blob) -> int:
    return xxhash.xxh3_64_intdigest(blob)


# A blob larger than this also records the xxh3-64 of each of its chunks of this size (in the
# sealed meta's extra, `chunk_sums`), so hydrate checks a large blob on the bytes it copies, chunk
# by chunk while they are in cache, instead of in a pass of its own (kvstore.codec.materialize).
CHUNK_SUM_BYTES = 4 << 20
CHUNK_SUMS_KEY = "chunk_sums"  # the extra key that holds them
# KV another box computed (fetched by a warm's read-through) holds FLEET_CHECK: "pending" until it
# is checked against this box's model, then "passed" (kvstore.fleet.check)
FLEET_CHECK, CHECK_PENDING, CHECK_PASSED = "fleet_check", "pending", "passed"


def checksums(blob) -> tuple[int, dict | None]:
    """The blob's xxh3-64 and, when it is larger than CHUNK_SUM_BYTES, its chunk sums record
    (`{"bytes": chunk size, "sums": [xxh3-64 of each chunk]}`), in one pass over the blob."""
    mv = memoryview(blob).cast("B")
    size = CHUNK_SUM_BYTES
    if len(mv) <= size:
        return xxhash.xxh3_64_intdigest(mv), None
    whole, sums = xxhash.xxh3_64(), []
    piece = min(size, 2 << 20)  # each piece hashed twice while it is in cache
    for begin in range(0, len(mv), size):
        chunk = xxhash.xxh3_64()
        for at in range(begin, min(begin + size, len(mv)), piece):
            part = mv[at : min(at + piece, begin + size)]
            whole.update(part)
            chunk.update(part)
        sums.append(chunk.intdigest())
    return whole.intdigest(), {"bytes": size, "sums": sums}


@dataclass(frozen=True, slots=True)
class EntryExtra:
    """An entry's (or a learned record's) `extra`: one named field per key the code writes. The
    stored map is the contract (keys unchanged since schema 1): `from_map` reads it, `to_map`
    gives it back with the same keys in the same order, so a read-modify-write stores the same
    bytes. A key no field names (a newer writer's), or a value of the wrong type, is kept as
    stored in `_unknown` (its field reads None)."""

    # the model's identity (kvstore.identity.model.ModelIdentity.state)
    adapter: str | None = None
    kv_bits: int | None = None
    kv_group_size: int | None = None
    quantized_kv_start: int | None = None
    model_config: dict | None = None
    model: str | None = None  # a learned record's model name (an entry's is the meta's)
    model_dir: str | None = None  # where its model resolved on the box that stored it
    adapter_dir: str | None = None
    fingerprint_parts: dict | None = None  # what a later `model_changed` names
    runtime: dict | None = None  # the mlx / mlx-lm versions that made it
    # who stored it, and who keeps it (kvstore.pins.ownership)
    source: str | None = None  # "manifest", "pin", "chain", "serve", "import", "learned", ...
    manifest: str | None = None  # the manifest of a manifest pin (before owners were recorded)
    owners: list[str] | None = None
    pinned_before_manifests: bool | None = None  # the pinned flag before the first manifest owner
    # a pin's rendering (kvstore.pins.render.pin_extra)
    chat_template_kwargs: dict | None = None  # the template arguments a chat pin was rendered with
    valid_date: str | None = None  # the local day (ISO date) a clock-bound pin holds for
    # an import's check (kvstore.warm.transfer)
    trusted: bool | None = None  # imported with --trust: never compared with a re-prefill
    checked: bool | None = None
    check: str | None = None  # what its re-prefill compared, in words
    # the fleet (kvstore.fleet)
    origin: str | None = None  # "remote": pulled from the bucket
    uploader: str | None = None  # the box that computed it
    fleet_check: str | None = None  # CHECK_PENDING until checked here, then CHECK_PASSED
    # a learned snapshot (kvstore.learned)
    learned: bool | None = None
    prompt_end: bool | None = None
    kv_layers: list[int] | None = None  # a state-only snapshot's KV layers, kept as records
    kv_block: int | None = None
    chunk_sums: dict | None = None  # CHUNK_SUMS_KEY: computed by Store.put, never given
    _keys: tuple[str, ...] = ()  # the stored keys, in order (a None value stored is kept)
    _unknown: Mapping[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"EntryExtra({self.to_map()!r})"

    @classmethod
    def from_map(cls, stored: Mapping[str, Any]) -> EntryExtra:
        known: dict[str, Any] = {}
        unknown: dict[str, Any] = {}
        for k, v in stored.items():
            kinds = _EXTRA_TYPES.get(k)
            if kinds is not None and (v is None or isinstance(v, kinds)):
                known[k] = v
            else:
                unknown[k] = v
        return cls(**known, _keys=tuple(stored), _unknown=unknown)

    @classmethod
    def of(cls, extra: EntryExtra | Mapping[str, Any] | None) -> EntryExtra:
        return extra if isinstance(extra, EntryExtra) else cls.from_map(extra or {})

    def to_map(self) -> dict[str, Any]:
        """The stored map: its keys in their stored order, then fields set since (in field
        order); a key kept as stored (unknown, or of the wrong type) keeps its value."""
        out = {}
        for k in self._keys:
            value = getattr(self, k) if k in _EXTRA_TYPES else None
            out[k] = self._unknown[k] if value is None and k in self._unknown else value
        for k in _EXTRA_TYPES:
            if k not in out and (value := getattr(self, k)) is not None:
                out[k] = value
        return out

    def updated(self, *maps: Mapping[str, Any], **values: Any) -> EntryExtra:
        """`{**self, *maps, **values}` as a dict would merge them (a key given again keeps its
        place)."""
        merged = self.to_map()
        for m in maps:
            merged.update(m)
        return EntryExtra.from_map({**merged, **values})

    def without(self, *names: str) -> EntryExtra:
        return EntryExtra.from_map({k: v for k, v in self.to_map().items() if k not in names})


_EXTRA_TYPES: dict[str, type | tuple[type, ...]] = {
    f.name: tuple(get_origin(a) or a for a in get_args(hint) if a is not type(None))
    for f in dataclass_fields(EntryExtra)
    if not f.name.startswith("_") and (hint := get_type_hints(EntryExtra)[f.name])
}


@dataclass
class EntryMeta:
    key: bytes
    tokens: bytes  # packed little-endian uint32 token ids
    ntokens: int
    label: str
    pinned: bool
    model: str  # the model's name (kvstore.identity.model.model_name; older: the path as given)
    fingerprint: bytes
    template_hash: bytes
    created: float
    last_used: float
    hits: int
    nbytes: int
    checksum: int  # xxh3-64 of the blob
    codec: int
    classes: list[str]
    extra: EntryExtra = field(default_factory=EntryExtra)

    def type_error(self) -> str | None:
        """The first field whose type is wrong (stored or sent by a client), or None."""
        for name, kind in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                shown = "dict" if kind is EntryExtra else getattr(kind, "__name__", kind)
                return f"field {name!r} must be {shown}"
        if not all(isinstance(c, str) for c in self.classes):
            return "field 'classes' must be a list of str"
        if not all(isinstance(k, str) for k in self.extra.to_map()):
            return "field 'extra' must have str keys"
        return None

    # What `extra` holds (EntryExtra), a few read through the entry.

    @property
    def chat_template_kwargs(self) -> dict | None:
        return self.extra.chat_template_kwargs

    @property
    def source(self) -> str | None:
        return self.extra.source

    @property
    def manifest(self) -> str | None:
        return self.extra.manifest

    @property
    def valid_date(self) -> str | None:
        return self.extra.valid_date

    @property
    def chunk_sums(self) -> tuple[int, list[int]] | None:
        """(chunk size, xxh3-64 of each chunk) of the blob, as stored with a large entry; None
        for a small or older entry, or a record of the wrong shape (the whole checksum then)."""
        rec = self.extra.chunk_sums
        if rec is None:
            return None
        size, sums = rec.get("bytes"), rec.get("sums")
        if not (isinstance(size, int) and size >= 4096 and isinstance(sums, list)):
            return None
        if len(sums) != -(-self.nbytes // size) or not all(isinstance(x, int) for x in sums):
            return None
        return size, sums

    @property
    def trusted(self) -> bool:
        return self.extra.trusted is True

    @property
    def model_dir(self) -> str | None:
        return self.extra.model_dir

    def token_ids(self) -> list[int]:
        return unpack_tokens(self.tokens)

    def pack(self) -> bytes:
        return seal(packed_fields(self))

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> EntryMeta:
        """Decode and check one stored record; any inconsistency raises CorruptEntryError."""
        try:
            d = msgpack.unpackb(raw, raw=False)
            if not isinstance(d, dict):
                raise ValueError("not a map")
            version = d.pop("v", None)
            if version == SCHEMA_VERSION:
                body = d.get("body")
                if not isinstance(body, bytes) or set(d) != {"body", "sum"}:
                    raise ValueError("schema 2 record without body and sum")
                if xxhash.xxh3_64_intdigest(body) != d["sum"]:
                    raise CorruptEntryError(key, "meta checksum mismatch (the record was altered)")
                d = msgpack.unpackb(body, raw=False)
                if not isinstance(d, dict):
                    raise ValueError("body is not a map")
            elif version != LEGACY_SCHEMA_VERSION:
                raise ValueError(f"unknown meta schema {version!r}")
            meta = cls(key=key, **with_extra(d))
        except CorruptEntryError:
            raise
        except UNREADABLE as e:
            raise CorruptEntryError(key, f"unreadable meta ({type(e).__name__}: {e})") from None
        if problem := meta.type_error():
            raise CorruptEntryError(key, f"unreadable meta ({problem})")
        if len(meta.tokens) != tk.nbytes(meta.ntokens) or meta.fingerprint != fingerprint_of(key):
            raise CorruptEntryError(key, "meta does not match its key or token count")
        if not tokens_match_key(key, meta.tokens):
            raise CorruptEntryError(key, "its tokens do not hash to its key")
        return meta

    def to_json(self) -> dict[str, Any]:
        extra = self.extra.without(CHUNK_SUMS_KEY).to_map()  # a list of hashes
        return {
            **extra,  # first: it can never shadow the fields below
            "key": self.key.hex(),
            "model": self.model,
            "fingerprint": self.fingerprint.hex(),
            "template_hash": self.template_hash.hex(),
            "label": self.label,
            "tokens": self.ntokens,
            "nbytes": self.nbytes,
            "pinned": self.pinned,
            "created": self.created,
            "last_used": self.last_used,
            "hits": self.hits,
            "classes": self.classes,
            "codec": self.codec,
        }


def unchecked(meta: EntryMeta) -> bool:
    """An entry fetched from the fleet and not yet checked: a restore on a request's path (a
    miss the store could serve, a pin already stored) skips it; the next start checks it."""
    return meta.extra.fleet_check == CHECK_PENDING


def packed_fields(meta: Any) -> bytes:
    """The msgpack body of a meta dataclass (an entry's, a learned record's): its fields but the
    key, in order, `extra` as the stored map."""
    d = {f.name: getattr(meta, f.name) for f in dataclass_fields(meta) if f.name != "key"}
    d["extra"] = meta.extra.to_map()
    return msgpack.packb(d, use_bin_type=True)


def with_extra(d: dict[str, Any]) -> dict[str, Any]:
    """A stored meta map with its `extra` map read as EntryExtra (one of the wrong shape stays
    as it is, for the meta's type check to name)."""
    extra = d.get("extra", {})
    if isinstance(extra, dict) and all(isinstance(k, str) for k in extra):
        d["extra"] = EntryExtra.from_map(extra)
    return d


def seal(body: bytes) -> bytes:
    """A schema-2 record: the msgpack body of the meta and its checksum."""
    return msgpack.packb(
        {"v": SCHEMA_VERSION, "body": body, "sum": xxhash.xxh3_64_intdigest(body)},
        use_bin_type=True,
    )


def tokens_match_key(key: bytes, tokens: bytes) -> bool:
    """The key's second half is the xxh3-128 of the packed token ids ."""
    return packed_prefix_hash(tokens) == digest_of(key)


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "tokens": bytes, "ntokens": int, "label": str, "pinned": bool, "model": str,
    "fingerprint": bytes, "template_hash": bytes, "created": (int, float),
    "last_used": (int, float), "hits": int, "nbytes": int, "checksum": int, "codec": int,
    "classes": list, "extra": EntryExtra,
}  # fmt: skip


# -- what a put gives ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PutFields(Mapping[str, Any]):
    """The meta fields a put sets, the one description of them: built by `entry_fields`,
    checked once by `from_map` where they arrive as a map (a request, a Store-shaped writer's
    keywords), carried on the wire as `as_kwargs()` and stored by Store.put; the store adds
    the rest (key, sizes, checksum, times). Also a read-only map of the same (`**fields`)."""

    tokens: bytes  # packed uint32 token ids of the prefix
    label: str = ""
    pinned: bool = False
    model: str = ""  # the model's name (the put names it: kvstore.ops.put.request)
    template_hash: bytes | None = None
    classes: list[str] = field(default_factory=list)  # the cache class of each layer
    extra: EntryExtra = field(default_factory=EntryExtra)  # identity, where it came from, ...

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as Store.put takes them (and a put request carries them), in that order."""
        # not asdict: that would deep-copy extra
        return {f.name: getattr(self, f.name) for f in dataclass_fields(self)}

    def __getitem__(self, name: str) -> Any:  # the map a put request carries: extra as stored
        if name not in _PUT_TYPES:
            raise KeyError(name)
        return self.extra.to_map() if name == "extra" else getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(_PUT_TYPES)

    def __len__(self) -> int:
        return len(_PUT_TYPES)

    @classmethod
    def from_map(cls, fields: Mapping[str, Any]) -> PutFields:
        """The fields of a map, each checked against its type here; raises ValueError naming the
        first bad one (an unknown name included). Missing ones take their defaults."""
        for name, value in fields.items():
            if name not in _PUT_TYPES:
                names = ", ".join(_PUT_TYPES)
                raise ValueError(f"field {name!r} is not one a put may set ({names})")
            kind, what = _PUT_TYPES[name]
            if not isinstance(value, kind) or not _PUT_CHECKS.get(name, _any)(value):
                got = "" if isinstance(value, kind) else f", not {type(value).__name__}"
                raise ValueError(f"field {name!r} must be {what}{got}")
        if "tokens" not in fields:
            raise ValueError(f"field 'tokens' must be {_PUT_TYPES['tokens'][1]}")
        return cls(**{**fields, "extra": EntryExtra.of(fields.get("extra"))})


_PUT_TYPES: dict[str, tuple[type | tuple[type, ...], str]] = {
    "tokens": (bytes, "packed uint32 token ids (bytes)"),
    "label": (str, "str"),
    "pinned": (bool, "bool"),
    "model": (str, "str"),
    "template_hash": ((bytes, type(None)), "bytes"),
    "classes": (list, "a list of str"),
    "extra": ((dict, EntryExtra), "a map with str keys and msgpack-simple values"),
}
_SIMPLE = (type(None), bool, int, float, str, bytes)
_MAX_DEPTH = 8


def _any(value: Any) -> bool:
    return True


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


_PUT_CHECKS: dict[str, Any] = {
    "tokens": lambda t: len(t) % tk.SIZE == 0,
    "classes": lambda c: all(isinstance(x, str) for x in c),
    "extra": lambda e: isinstance(e, EntryExtra) or _simple(e),
}


def entry_fields(
    tokens: Sequence[int] | bytes,
    *,
    label: str,
    pinned: bool,
    model: str,
    template_hash: bytes | None,
    classes: list[str],
    state: Mapping[str, Any] | None = None,
    source: str,
    extra: Mapping[str, Any] | None = None,
    **more: Any,
) -> PutFields:
    """An entry's put fields, built one way everywhere: `extra` holds the model's identity state
    (`ModelIdentity.state`), then `source`, then `more` in the order given, then `extra` (which
    may override any of them in place)."""
    packed = tokens if isinstance(tokens, bytes) else pack_tokens(tokens)
    return PutFields(
        tokens=packed,
        label=label,
        pinned=pinned,
        model=model,
        template_hash=template_hash,
        classes=classes,
        extra=EntryExtra.from_map({**(state or {}), "source": source, **more, **(extra or {})}),
    )
