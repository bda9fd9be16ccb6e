"""An entry's meta record: what is stored beside each blob (msgpack), and how it is checked."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from kvstore.errors import CorruptEntryError
from kvstore.keys import FINGERPRINT_BYTES, unpack_tokens

SCHEMA_VERSION = 1
_META_FIELDS = (
    "tokens", "ntokens", "label", "pinned", "model", "fingerprint", "template_hash", "created",
    "last_used", "hits", "nbytes", "checksum", "codec", "classes",
)  # fmt: skip


DEFAULT_QUANTIZED_KV_START = 5000  # mlx_lm.generate's default: KV quantized from this offset on


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

    def ident(self) -> tuple:
        """The model as it was run: path, adapter and KV quantization (what a manifest names)."""
        kv_bits = self.extra.get("kv_bits")
        return (
            self.model,
            self.extra.get("adapter"),
            kv_bits,
            self.extra.get("kv_group_size", 64) if kv_bits else None,
            self.extra.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START) if kv_bits else None,
        )

    def token_ids(self) -> list[int]:
        return unpack_tokens(self.tokens)

    def pack(self) -> bytes:
        d = asdict(self)
        d.pop("key")
        d["v"] = SCHEMA_VERSION
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> EntryMeta:
        try:
            d = msgpack.unpackb(raw, raw=False)
            if not isinstance(d, dict) or d.pop("v", None) != SCHEMA_VERSION:
                raise ValueError("unknown meta schema")
            meta = cls(key=key, **d)
        except Exception as e:
            raise CorruptEntryError(key, f"unreadable meta ({type(e).__name__}: {e})") from None
        if problem := meta.type_error():
            raise CorruptEntryError(key, f"unreadable meta ({problem})")
        if len(meta.tokens) != 4 * meta.ntokens or meta.fingerprint != key[:FINGERPRINT_BYTES]:
            raise CorruptEntryError(key, "meta does not match its key or token count")
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


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "tokens": bytes, "ntokens": int, "label": str, "pinned": bool, "model": str,
    "fingerprint": bytes, "template_hash": bytes, "created": (int, float),
    "last_used": (int, float), "hits": int, "nbytes": int, "checksum": int, "codec": int,
    "classes": list, "extra": dict,
}  # fmt: skip
