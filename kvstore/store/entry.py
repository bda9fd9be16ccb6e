"""An entry's meta record: what is stored beside each blob (msgpack), and how it is checked.

LMDB keeps no page checksums, so the record carries its own: schema 2 stores the msgpack body with
its xxh3-64 (`{"v": 2, "body": bytes, "sum": int}`). Schema 1 records (a bare map, no checksum) are
still read. Every read also checks that the tokens hash to the key's second half, so a flipped byte
in either is a CorruptEntryError naming the key, never a hit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import xxhash

from kvstore.errors import CorruptEntryError
from kvstore.identity.model import DEFAULT_QUANTIZED_KV_START as DEFAULT_QUANTIZED_KV_START
from kvstore.identity.model import ModelIdentity
from kvstore.store import keys
from kvstore.store.keys import FINGERPRINT_BYTES, unpack_tokens

SCHEMA_VERSION = 2
LEGACY_SCHEMA_VERSION = 1  # a bare map without a checksum: read, re-checked, rewritten as 2
_META_FIELDS = (
    "tokens", "ntokens", "label", "pinned", "model", "fingerprint", "template_hash", "created",
    "last_used", "hits", "nbytes", "checksum", "codec", "classes",
)  # fmt: skip


def blob_checksum(blob) -> int:
    return xxhash.xxh3_64_intdigest(blob)


@dataclass
class EntryMeta:
    key: bytes
    tokens: bytes  # packed little-endian uint32 token ids
    ntokens: int
    label: str
    pinned: bool
    model: str  # model path as given
    fingerprint: bytes
    template_hash: bytes
    created: float
    last_used: float
    hits: int
    nbytes: int
    checksum: int  # xxh3-64 of the blob
    codec: int
    classes: list[str]
    extra: dict[str, Any] = field(default_factory=dict)  # adapter, kv_bits, source ...

    def type_error(self) -> str | None:
        """The first field whose type is wrong (stored or sent by a client), or None."""
        for name, kind in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                return f"field {name!r} must be {getattr(kind, '__name__', kind)}"
        if not all(isinstance(c, str) for c in self.classes):
            return "field 'classes' must be a list of str"
        if not all(isinstance(k, str) for k in self.extra):
            return "field 'extra' must have str keys"
        return None

    # What `extra` holds, read here only: the stored keys are the schema-1 ones, unchanged.

    @property
    def identity(self) -> ModelIdentity:
        """The model as the entry was made with it (path, adapter, KV quantization, overrides)."""
        return ModelIdentity.from_state(self.extra, self.model)

    @property
    def chat_template_kwargs(self) -> Any:
        """The template arguments a chat pin was rendered with, as stored (a dict, or None)."""
        return self.extra.get("chat_template_kwargs")

    @property
    def source(self) -> Any:
        """What stored it: "manifest", "pin", "chain", "serve", "import", "remote", ..."""
        return self.extra.get("source")

    @property
    def manifest(self) -> Any:
        """The manifest that stored a manifest pin (entries from before owners were recorded)."""
        return self.extra.get("manifest")

    @property
    def recorded_owners(self) -> Any:
        """The owners list as stored (kvstore.store.ownership.owners reads it with fallbacks)."""
        return self.extra.get("owners")

    @property
    def valid_date(self) -> str | None:
        """The local day (ISO date) a clock-bound pin holds for; None for any other entry."""
        valid = self.extra.get("valid_date")
        return valid if isinstance(valid, str) else None

    @property
    def trusted(self) -> bool:
        """Imported with --trust: its KV was never compared with a re-prefill."""
        return self.extra.get("trusted") is True

    @property
    def import_check(self) -> Any:
        """What an import's re-prefill compared, in words (None for other entries)."""
        return self.extra.get("check")

    @property
    def runtime(self) -> Any:
        """The mlx / mlx-lm versions that made it, as recorded (a dict), or None."""
        return self.extra.get("runtime")

    @property
    def model_dir(self) -> Any:
        """Where its model resolved on the box that stored it (kvstore.store.write)."""
        return self.extra.get("model_dir")

    @property
    def adapter_dir(self) -> Any:
        """Where its adapter resolved on the box that stored it."""
        return self.extra.get("adapter_dir")

    def token_ids(self) -> list[int]:
        return unpack_tokens(self.tokens)

    def pack(self) -> bytes:
        d = asdict(self)
        d.pop("key")
        return seal(msgpack.packb(d, use_bin_type=True))

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
            meta = cls(key=key, **d)
        except CorruptEntryError:
            raise
        except Exception as e:
            raise CorruptEntryError(key, f"unreadable meta ({type(e).__name__}: {e})") from None
        if problem := meta.type_error():
            raise CorruptEntryError(key, f"unreadable meta ({problem})")
        if len(meta.tokens) != 4 * meta.ntokens or meta.fingerprint != key[:FINGERPRINT_BYTES]:
            raise CorruptEntryError(key, "meta does not match its key or token count")
        if not tokens_match_key(key, meta.tokens):
            raise CorruptEntryError(key, "its tokens do not hash to its key")
        return meta

    def to_json(self) -> dict[str, Any]:
        return {
            **self.extra,  # first: it can never shadow the fields below
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


def seal(body: bytes) -> bytes:
    """A schema-2 record: the msgpack body of the meta and its checksum."""
    return msgpack.packb(
        {"v": SCHEMA_VERSION, "body": body, "sum": xxhash.xxh3_64_intdigest(body)},
        use_bin_type=True,
    )


def tokens_match_key(key: bytes, tokens: bytes) -> bool:
    """The key's second half is the xxh3-128 of the packed token ids (kvstore.store.keys)."""
    return keys.packed_prefix_hash(tokens) == key[FINGERPRINT_BYTES:]


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "tokens": bytes, "ntokens": int, "label": str, "pinned": bool, "model": str,
    "fingerprint": bytes, "template_hash": bytes, "created": (int, float),
    "last_used": (int, float), "hits": int, "nbytes": int, "checksum": int, "codec": int,
    "classes": list, "extra": dict,
}  # fmt: skip
