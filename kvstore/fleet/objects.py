"""The fleet tier's object store (any S3 API, through boto3): one object per entry.

Layout: `[prefix/]kvstore/v<FORMAT>/<fingerprint hex>/<prefix-hash hex>`, so one model is one
listing prefix (retiring it is one `gc --model`) and another format version never shares a key.
An object is a header (magic, format version, meta length), the entry's msgpack meta, then the
blob. Everything fetched is verified before a caller may store it: format, key, fingerprint,
tokens, length, checksum and a full decode (`verify_object`).

Learned block records are objects too, one per record, under `.../<fingerprint hex>/blocks/<H(end)
hex>` (entry listings skip them: that name is not an entry key). Their meta is the record's
sealed BlockMeta plus the tokens before its start and the block size it was cut at, so one object
verifies alone as an entry does: its tokens hash to its key (`verify_record`).

After the blob, both kinds carry a trailer: the provenance (msgpack: the box that computed it,
its mlx and mlx-lm versions), then TRAILER (magic, provenance length, MAC). The MAC is
HMAC-SHA256 under the fleet key over everything before it (header, meta, blob, provenance); 32
zero bytes when the uploader had no key. A box with a key refuses an object whose MAC is missing
or matches none of its keys (cause "unauthentic"). Objects of older kvstores have no trailer:
taken when this box has no key, refused when it has one. Older kvstores refuse objects with a
trailer cleanly: their blob is longer than its meta says ("corrupt"), so they prefill.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import xxhash

from kvstore import tokens as tk
from kvstore.codec import codec
from kvstore.degrade import UNREADABLE
from kvstore.errors import CodecError, CorruptEntryError, RemoteError, counted
from kvstore.fleet.remote_settings import RemoteSettings
from kvstore.store.entry import EntryMeta
from kvstore.store.keys import KEY_BYTES, digest_of, fingerprint_of, pack_key

if TYPE_CHECKING:
    from kvstore.learned.blockstore import BlockMeta

log = logging.getLogger("kvstore")

FORMAT_VERSION = 1
MAGIC = b"KVSR"
HEADER = struct.Struct("<4sHI")  # magic, format version, meta length
MAX_META_BYTES = 64 * 2**20  # a meta holds token ids: 4 bytes a token
READ_CHUNK = 1 << 20
TRAILER_MAGIC = b"KVSM"
TRAILER = struct.Struct("<4sI32s")  # magic, provenance length, HMAC-SHA256 (zeros: no key)
NO_MAC = bytes(32)
UNSIGNED_FIX = (
    "`kvstore remote key new` makes a fleet key; `allow_unsigned = true` in the home's "
    "settings.toml takes objects unauthenticated"
)
MAX_PROVENANCE_BYTES = 4096

_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"}
_BUCKET_CODES = {"NoSuchBucket"}


@dataclass
class RemoteObject:
    key: bytes  # the entry key
    name: str  # the object's key in the bucket
    size: int
    modified: float  # epoch seconds


@dataclass(frozen=True)
class Provenance:
    """Who computed an object: the uploading box's id and the mlx / mlx-lm it ran. `signed`:
    its MAC checked under one of this box's keys (False with no key configured)."""

    box: str
    mlx: str
    mlx_lm: str
    signed: bool = False
    previous: bool = False  # signed under fleet_key_previous: `remote push --reseal` renews it

    @classmethod
    def unknown(cls) -> Provenance:
        return cls("an unknown box (no provenance: an older kvstore's object)", "?", "?")

    def shown(self) -> str:
        return f"{self.box} (mlx {self.mlx}, mlx-lm {self.mlx_lm})"


def provenance_of(rs: RemoteSettings) -> bytes:
    from kvstore.identity.codehash import runtime_versions

    v = runtime_versions()
    return msgpack.packb({"box": rs.box_id, "mlx": v["mlx"], "mlx_lm": v["mlx_lm"]})


class Sealer:
    """The trailer of one upload, MACed as its bytes stream by in order (a multipart upload
    reads its blob a part at a time): feed every byte before the trailer, then `trailer()`."""

    def __init__(self, rs: RemoteSettings):
        self.provenance = provenance_of(rs)
        self._mac = hmac.new(rs.fleet_keys[0], digestmod=hashlib.sha256) if rs.fleet_keys else None
        self.size = len(self.provenance) + TRAILER.size

    def feed(self, data: bytes) -> bytes:
        if self._mac is not None:
            self._mac.update(data)
        return data

    def trailer(self) -> bytes:
        if self._mac is None:
            mac = NO_MAC
        else:
            self._mac.update(self.provenance)
            mac = self._mac.digest()
        return self.provenance + TRAILER.pack(TRAILER_MAGIC, len(self.provenance), mac)


def seal(rs: RemoteSettings, body: bytes) -> bytes:
    """The trailer of an object whose bytes before it are `body` (one piece)."""
    sealer = Sealer(rs)
    sealer.feed(body)
    return sealer.trailer()


def blob_end(data: bytes | bytearray) -> int:
    """Where the blob of an object with a trailer ends (the provenance starts)."""
    _, plen, _ = TRAILER.unpack_from(data, len(data) - TRAILER.size)
    return len(data) - TRAILER.size - plen


def authenticate(
    data: memoryview, blob_end: int, keys: tuple[bytes, ...], where: str, unsigned: bool = True
) -> Provenance:
    """The provenance of an object whose blob ends at `blob_end`, its MAC checked when this box
    has keys; raises RemoteError "unauthentic" (MAC missing or wrong, or no key here to check it
    with and `unsigned` False: the home's allow_unsigned) or "corrupt"."""
    tail = data[blob_end:]
    prov: Provenance | None = None
    mac = NO_MAC
    if len(tail):
        if len(tail) < TRAILER.size:
            raise RemoteError("corrupt", f"{where}: {len(tail)} bytes after its blob")
        magic, plen, mac = TRAILER.unpack_from(tail, len(tail) - TRAILER.size)
        if (
            magic != TRAILER_MAGIC
            or plen != len(tail) - TRAILER.size
            or plen > MAX_PROVENANCE_BYTES
        ):
            raise RemoteError("corrupt", f"{where}: unreadable trailer after its blob")
        try:
            p = msgpack.unpackb(bytes(tail[:plen]), raw=False)
            prov = Provenance(str(p["box"]), str(p["mlx"]), str(p["mlx_lm"]))
        except UNREADABLE:
            raise RemoteError("corrupt", f"{where}: unreadable provenance") from None
    shown = (prov or Provenance.unknown()).shown()
    if not keys and unsigned:
        return prov or Provenance.unknown()
    if not keys:
        why = f"uploaded by {shown}, and this box has no fleet_key to check it"
        raise RemoteError("unauthentic", f"{where}: {why}; refused ({UNSIGNED_FIX})")
    if mac == NO_MAC:
        raise RemoteError("unauthentic", f"{where}: no MAC (uploaded by {shown}); refused, "
                                         "this box holds a fleet key")  # fmt: skip
    body = data[: len(data) - TRAILER.size]
    for i, k in enumerate(keys):
        if hmac.compare_digest(hmac.new(k, body, hashlib.sha256).digest(), mac):
            assert prov is not None
            return Provenance(prov.box, prov.mlx, prov.mlx_lm, signed=True, previous=i > 0)
    raise RemoteError("unauthentic", f"{where}: MAC does not match this fleet's key (uploaded "
                                     f"by {shown}); refused")  # fmt: skip


def object_root(rs: RemoteSettings) -> str:
    return f"{rs.prefix}/kvstore/" if rs.prefix else "kvstore/"


def version_prefix(rs: RemoteSettings, version: int = FORMAT_VERSION) -> str:
    return f"{object_root(rs)}v{version}/"


def object_name(rs: RemoteSettings, key: bytes) -> str:
    return f"{version_prefix(rs)}{fingerprint_of(key).hex()}/{digest_of(key).hex()}"


def parse_object_name(rs: RemoteSettings, name: str) -> bytes | None:
    """The entry key an object name of this format version stands for, or None."""
    rest = name.removeprefix(version_prefix(rs))
    fp, _, h = rest.partition("/")
    try:
        key = pack_key(bytes.fromhex(fp), bytes.fromhex(h))
    except ValueError:
        return None
    return key if rest != name and len(key) == KEY_BYTES else None


RECORD_MAGIC = b"KVSB"
RECORDS_DIR = "blocks"


def record_name(rs: RemoteSettings, key: bytes) -> str:
    """The object name of a learned record (key = fingerprint + H(end))."""
    fp, h = fingerprint_of(key).hex(), digest_of(key).hex()
    return f"{version_prefix(rs)}{fp}/{RECORDS_DIR}/{h}"


def parse_record_name(rs: RemoteSettings, name: str) -> bytes | None:
    """The record key a learned record's object name stands for, or None."""
    rest = name.removeprefix(version_prefix(rs))
    parts = rest.split("/")
    if rest == name or len(parts) != 3 or parts[1] != RECORDS_DIR:
        return None
    try:
        key = pack_key(bytes.fromhex(parts[0]), bytes.fromhex(parts[2]))
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None


def _framed(data: bytes | bytearray, magic: bytes, where: str) -> tuple[memoryview, memoryview]:
    """An object's meta bytes and blob, after its header (magic, format version, meta length) is
    checked; views, so a 1 GB object is not copied again."""
    if len(data) < HEADER.size:
        raise RemoteError("corrupt", f"{where}: {len(data)} bytes, shorter than its header")
    view = memoryview(data)
    got, version, meta_len = HEADER.unpack_from(view)
    if got != magic:
        raise RemoteError("corrupt", f"{where}: not a kvstore object of this kind (bad magic)")
    if version != FORMAT_VERSION:
        raise RemoteError(
            "version", f"{where}: format version {version}, this kvstore reads {FORMAT_VERSION}"
        )
    if meta_len > min(MAX_META_BYTES, len(view) - HEADER.size):
        raise RemoteError("corrupt", f"{where}: meta length {meta_len} runs past the object")
    return view[HEADER.size : HEADER.size + meta_len], view[HEADER.size + meta_len :]


def _blob_and_provenance(
    data: bytes | bytearray,
    rest: memoryview,
    meta: Any,
    keys: tuple[bytes, ...],
    where: str,
    unsigned: bool,
) -> tuple[memoryview, Provenance]:
    """The blob the meta sizes, and the provenance after it (MAC checked under `keys`); the MAC
    comes first: nothing of an unauthentic object is decoded."""
    if len(rest) < meta.nbytes:
        raise RemoteError("corrupt", f"{where}: blob is {len(rest)} bytes, meta says {meta.nbytes}")
    view = memoryview(data)
    end = len(view) - len(rest) + meta.nbytes
    return rest[: meta.nbytes], authenticate(view, end, keys, where, unsigned)


def _check_blob(blob: memoryview, meta: Any, where: str, *, record: bool = False) -> None:
    """Length and checksum as the meta says, then a full decode holding its token count (and, for
    a learned record, only record classes)."""
    from kvstore.learned.records import inspect

    if len(blob) != meta.nbytes:
        raise RemoteError("corrupt", f"{where}: blob is {len(blob)} bytes, meta says {meta.nbytes}")
    if xxhash.xxh3_64_intdigest(blob) != meta.checksum:
        raise RemoteError("corrupt", f"{where}: blob checksum mismatch")
    try:
        if record:
            inspect(bytes(blob), meta.ntokens, name=where)
        cache, _ = codec.decode(blob, name=where)
    except CodecError as e:
        raise RemoteError("corrupt", f"{where}: {e}") from None
    layers = None if record else meta.extra.to_map().get("kv_layers")  # as stored, checked here
    if layers:  # a state-only snapshot: its KV layers are records, empty here (as Store.load)
        if not isinstance(layers, list) or not all(type(i) is int for i in layers):
            raise RemoteError("corrupt", f"{where}: extra.kv_layers is not a list of layers")
        cache = [c for i, c in enumerate(cache) if i not in set(layers)]
    held = codec.cache_tokens(cache)
    if held != meta.ntokens and (record or not (held is None and codec.keeps_no_offset(cache))):
        raise RemoteError("corrupt", f"{where}: its KV holds {held} tokens, not {meta.ntokens}")


def record_header(meta: BlockMeta, prefix: bytes, block: int) -> bytes:
    """Header of a record's object: its sealed meta, the packed tokens before its start and the
    block size the chain was cut at (the key's hash depends on both)."""
    packed = msgpack.packb(
        {"record": meta.pack(), "prefix": prefix, "block": block}, use_bin_type=True
    )
    return HEADER.pack(RECORD_MAGIC, FORMAT_VERSION, len(packed)) + packed


@dataclass
class VerifiedRecord:
    meta: BlockMeta
    tokens: bytes  # the chain's packed tokens up to its end
    block: int  # the block size its chain was cut at
    blob: memoryview
    provenance: Provenance


def verify_record(
    key: bytes, data: bytes | bytearray, *, keys: tuple[bytes, ...] = (), unsigned: bool = False
) -> VerifiedRecord:
    """A fetched record object verified in full: format, meta seal, MAC under `keys` (when any;
    without, taken only when `unsigned`), its tokens (the prefix and its own) hashing to its key
    under its fingerprint, blob length and checksum, and a full decode holding its token count in
    record classes. Raises RemoteError ("corrupt", "version" or "unauthentic")."""
    from kvstore.learned.blockstore import BlockMeta
    from kvstore.learned.chain import position_hash

    where = f"remote object for learned record {key.hex()}"
    head_bytes, rest = _framed(data, RECORD_MAGIC, where)
    try:
        head = msgpack.unpackb(bytes(head_bytes), raw=False)
        prefix, block = bytes(head["prefix"]), int(head["block"])
        meta = BlockMeta.unpack(key, bytes(head["record"]))
    except CorruptEntryError as e:
        raise RemoteError("corrupt", f"{where}: {e.reason}") from None
    except UNREADABLE as e:
        raise RemoteError("corrupt", f"{where}: unreadable meta ({type(e).__name__})") from None
    blob, prov = _blob_and_provenance(data, rest, meta, keys, where, unsigned)
    if len(prefix) != tk.nbytes(meta.start) or block <= 0:
        raise RemoteError("corrupt", f"{where}: {tk.count(prefix)} tokens before a record at "
                                     f"{meta.start}")  # fmt: skip
    tokens = prefix + meta.tokens
    fp = fingerprint_of(key)
    if position_hash(fp, tokens, meta.end, block) != digest_of(key):
        raise RemoteError("corrupt", f"{where}: its tokens do not hash to its key")
    _check_blob(blob, meta, where, record=True)
    return VerifiedRecord(meta, tokens, block, blob, prov)


def object_header(meta: EntryMeta) -> bytes:
    packed = meta.pack()
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(packed)) + packed


def verify_object(
    key: bytes,
    data: bytes | bytearray,
    *,
    tokens: bytes | None = None,
    keys: tuple[bytes, ...] = (),
    unsigned: bool = False,
) -> tuple[EntryMeta, memoryview, Provenance]:
    """Meta, blob and provenance of a fetched object, verified in full (MAC under `keys` when
    any, else taken unauthenticated only when `unsigned`; the decode too); raises RemoteError
    with cause "corrupt", "version" or "unauthentic" naming what is wrong. Nothing is stored
    here."""
    where = f"remote object for entry {key.hex()}"
    meta_bytes, rest = _framed(data, MAGIC, where)
    try:
        meta = EntryMeta.unpack(key, bytes(meta_bytes))
    except CorruptEntryError as e:
        raise RemoteError("corrupt", f"{where}: {e.reason}") from None
    blob, prov = _blob_and_provenance(data, rest, meta, keys, where, unsigned)
    if xxhash.xxh3_128(meta.tokens).digest() != digest_of(key):
        raise RemoteError("corrupt", f"{where}: its tokens do not hash to its key")
    if tokens is not None and meta.tokens != tokens:
        raise RemoteError("corrupt", f"{where}: its tokens are not the pin's")
    _check_blob(blob, meta, where)
    return meta, blob, prov


class Remote:
    """A boto3 client for one bucket; every failure comes out as a RemoteError naming its cause."""

    def __init__(self, rs: RemoteSettings):
        try:
            import boto3
            from botocore import exceptions as bx
            from botocore.config import Config
        except ImportError:
            raise RemoteError(
                "unavailable", "the fleet tier needs boto3: pip install 'mlx-kvstore[fleet]'"
            ) from None

        self.settings = rs
        self.bucket = rs.bucket
        # What a call through boto3 raises when the remote refuses, fails or is out of reach (and
        # the RemoteError of a check of ours): `_error` words each; anything else is a bug.
        failures = (RemoteError, OSError, bx.ClientError, bx.BotoCoreError)
        self.failures: tuple[type[Exception], ...] = failures
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=rs.endpoint,
            region_name=rs.region,
            aws_access_key_id=rs.access_key_id,
            aws_secret_access_key=rs.secret_access_key,
            verify=rs.ca_bundle or None,  # None: the system's trust store; http: unused
            config=Config(
                connect_timeout=rs.connect_timeout,
                read_timeout=rs.read_timeout,
                retries={"max_attempts": 2, "mode": "standard"},
                s3={"addressing_style": "path"},  # SeaweedFS and most LAN servers: no DNS names
            ),
        )

    def where(self) -> str:
        return f"remote {self.settings.endpoint} bucket {self.bucket!r}"

    def _error(self, e: Exception, what: str) -> RemoteError:
        from botocore import exceptions as bx

        if isinstance(e, RemoteError):
            return e
        if isinstance(e, bx.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _CREDENTIAL_CODES or status == 403:
                return RemoteError(
                    "credentials", f"{self.where()}: {what}: credentials refused ({code})"
                )
            if code in _BUCKET_CODES:
                return RemoteError("bucket", f"{self.where()}: {what}: no such bucket")
            return RemoteError("error", f"{self.where()}: {what}: {code or status}")
        if isinstance(e, bx.SSLError):
            return RemoteError(
                "tls",
                f"{self.where()}: {what}: TLS failed ({e}); for a certificate signed by your own "
                "CA, set [remote] ca_bundle to its PEM file",
            )
        if isinstance(e, bx.NoCredentialsError):
            return RemoteError("credentials", f"{self.where()}: {what}: no credentials set")
        if isinstance(e, (bx.EndpointConnectionError, bx.ConnectionError, bx.HTTPClientError)):
            return RemoteError("unreachable", f"{self.where()}: {what}: unreachable ({e})")
        if isinstance(e, (OSError, bx.BotoCoreError)):
            return RemoteError("unreachable", f"{self.where()}: {what}: {type(e).__name__}: {e}")
        raise e  # not among self.failures: a bug, raised as it came

    @staticmethod
    def _status(e: Exception) -> int | None:
        from botocore.exceptions import ClientError

        if isinstance(e, ClientError):
            return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return None

    # -- reads --------------------------------------------------------------------------------

    def check(self) -> None:
        """The bucket exists and these credentials may use it."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except self.failures as e:
            if self._status(e) == 404:
                raise RemoteError("bucket", f"{self.where()}: no such bucket") from None
            raise self._error(e, "checking the bucket") from None

    def uploader(self, name: str) -> str | None:
        """The box an object's S3 metadata names (unsigned: for listing; None: not recorded)."""
        try:
            res = self.client.head_object(Bucket=self.bucket, Key=name)
        except self.failures as e:
            raise self._error(e, f"looking up {name}") from None
        return res.get("Metadata", {}).get("box")

    def head(self, key: bytes, *, name: str | None = None) -> int | None:
        """The object's size in bytes, or None when the remote does not have it (`name`: another
        object than the entry's, a learned record's)."""
        try:
            return int(
                self.client.head_object(
                    Bucket=self.bucket, Key=name or object_name(self.settings, key)
                )["ContentLength"]
            )
        except self.failures as e:
            if self._status(e) == 404:
                return None
            raise self._error(
                e, f"looking up {'record' if name else 'entry'} {key.hex()}"
            ) from None

    def fetch(
        self, key: bytes, *, deadline: float | None = None, name: str | None = None
    ) -> tuple[bytearray, float]:
        """The object's bytes (read into one buffer of its length) and the seconds the transfer
        took; over `deadline` seconds it is dropped with cause "slow". `name`: another object
        than the entry's (a learned record's)."""
        deadline = self.settings.fetch_deadline if deadline is None else deadline
        name = name or object_name(self.settings, key)
        t0 = time.monotonic()
        try:
            res = self.client.get_object(Bucket=self.bucket, Key=name)
            body, size = res["Body"], int(res["ContentLength"])
            buf, got = bytearray(size), 0
            try:
                while got < size and (chunk := body.read(min(READ_CHUNK, size - got))):
                    buf[got : got + len(chunk)] = chunk
                    got += len(chunk)
                    if time.monotonic() - t0 > deadline:
                        raise RemoteError(
                            "slow",
                            f"{self.where()}: fetching entry {key.hex()} passed fetch_deadline="
                            f"{deadline:g}s",
                        )
            finally:
                body.close()
        except self.failures as e:
            raise self._error(e, f"fetching entry {key.hex()}") from None
        if got != size:
            raise RemoteError("corrupt", f"{self.where()}: entry {key.hex()}: object cut short")
        return buf, time.monotonic() - t0

    def objects(self, fingerprint: bytes = b"") -> Iterator[RemoteObject]:
        """Every entry's object of this format version (of one model with `fingerprint`)."""
        return self._listed(fingerprint, parse_object_name, "listing objects")

    def records(self, fingerprint: bytes = b"") -> Iterator[RemoteObject]:
        """Every learned record's object of this format version (of one model's fingerprint)."""
        return self._listed(fingerprint, parse_record_name, "listing learned records")

    def _listed(self, fingerprint: bytes, parse, what: str) -> Iterator[RemoteObject]:
        """The objects under this version's (and model's) prefix whose names `parse` takes."""
        prefix = version_prefix(self.settings) + (f"{fingerprint.hex()}/" if fingerprint else "")
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                for o in page.get("Contents", []):
                    key = parse(self.settings, o["Key"])
                    if key is not None:
                        yield RemoteObject(
                            key, o["Key"], int(o["Size"]), o["LastModified"].timestamp()
                        )
        except self.failures as e:
            raise self._error(e, what) from None

    def other_versions(self) -> list[str]:
        """Format-version prefixes in the bucket other than ours (another kvstore's objects)."""
        root = object_root(self.settings)
        try:
            res = self.client.list_objects_v2(Bucket=self.bucket, Prefix=root, Delimiter="/")
        except self.failures as e:
            raise self._error(e, "listing format versions") from None
        found = [p["Prefix"][len(root) :].rstrip("/") for p in res.get("CommonPrefixes", [])]
        return [v for v in found if v != f"v{FORMAT_VERSION}"]

    # -- writes -------------------------------------------------------------------------------

    def upload(
        self, meta: EntryMeta, read_blob: Callable[[int, int], bytes], *, replace: bool = False
    ) -> str:
        """Create the entry's object unless it exists: "uploaded", or "exists" when it was there
        already or another box created it first (If-None-Match: * makes the create conditional,
        so two racing uploads end with one object). `read_blob(offset, size)` gives blob bytes;
        large blobs go up in parts, each read on its own."""
        return self._create(
            object_name(self.settings, meta.key), object_header(meta), meta.nbytes, read_blob,
            what=f"uploading entry {meta.key.hex()}", replace=replace,
        )  # fmt: skip

    def upload_record(
        self, meta: BlockMeta, prefix: bytes, block: int, blob: bytes, *, replace: bool = False
    ) -> str:
        """Create a learned record's object unless it exists ("uploaded" or "exists", as
        `upload`). `prefix`: the packed tokens before its start; `block`: its chain's cut.
        `replace`: overwrite it (a re-seal under a new fleet key)."""
        return self._create(
            record_name(self.settings, meta.key), record_header(meta, prefix, block), meta.nbytes,
            lambda offset, size: blob[offset : offset + size],
            what=f"uploading learned record {meta.key.hex()}", replace=replace,
        )  # fmt: skip

    def _create(
        self,
        name: str,
        header: bytes,
        nbytes: int,
        read_blob: Callable[[int, int], bytes],
        *,
        what: str,
        replace: bool = False,
    ) -> str:
        if not replace and self.head(b"", name=name) is not None:
            return "exists"
        cond = {} if replace else {"IfNoneMatch": "*"}  # a re-seal overwrites its own object
        sealer = Sealer(self.settings)
        total = len(header) + nbytes + sealer.size
        meta = {
            "box": self.settings.box_id
        }  # for `remote ls`, unsigned: the trailer is what counts
        try:
            if total <= self.settings.multipart_threshold:
                body = header + read_blob(0, nbytes)
                self.client.put_object(
                    Bucket=self.bucket, Key=name, Body=body + seal(self.settings, body),
                    Metadata=meta, **cond,
                )  # fmt: skip
                return "uploaded"
            return self._upload_parts(name, header, nbytes, read_blob, sealer, meta, cond)
        except self.failures as e:
            if self._status(e) == 412:  # someone created it between our HEAD and our create
                return "exists"
            raise self._error(e, what) from None

    def _upload_parts(
        self,
        name: str,
        header: bytes,
        nbytes: int,
        read_blob: Callable[[int, int], bytes],
        sealer: Sealer,
        meta: dict[str, str],
        cond: dict[str, str],
    ) -> str:
        size, blob_end = self.settings.part_size, len(header) + nbytes
        total = blob_end + sealer.size
        upload_id = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=name, Metadata=meta
        )["UploadId"]
        trailer, completed = b"", False
        try:
            parts = []
            for number, start in enumerate(range(0, total, size), 1):
                stop = min(start + size, total)
                head = sealer.feed(header[start:stop])
                lo, hi = max(start - len(header), 0), min(stop, blob_end) - len(header)
                body = head + (sealer.feed(read_blob(lo, hi - lo)) if hi > lo else b"")
                if stop > blob_end:  # the part that ends the object: the blob is all MACed
                    trailer = trailer or sealer.trailer()
                    body += trailer[max(start - blob_end, 0) : stop - blob_end]
                res = self.client.upload_part(
                    Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=number, Body=body
                )
                parts.append({"PartNumber": number, "ETag": res["ETag"]})
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload_id,
                MultipartUpload={"Parts": parts}, **cond,
            )  # fmt: skip
            completed = True
            return "uploaded"
        finally:
            if not completed:  # failed or interrupted: parts nobody completes are billed
                self._abort(name, upload_id)

    def _abort(self, name: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
        except self.failures as e:  # `remote gc` aborts uploads left behind
            log.debug("remote: %s: aborting the upload of %s: %s", self.where(), name, e)

    def delete(self, names: list[str]) -> int:
        n = 0
        try:
            for i in range(0, len(names), 1000):  # DeleteObjects takes at most 1000 keys
                batch = [{"Key": k} for k in names[i : i + 1000]]
                res = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch})
                n += len(res.get("Deleted", []))
                if errors := res.get("Errors"):  # per key, e.g. a key that may not delete
                    first = errors[0]
                    raise RemoteError(
                        "credentials" if first.get("Code") == "AccessDenied" else "error",
                        f"{self.where()}: deleting {first.get('Key')}: {first.get('Code')} "
                        f"({counted(len(errors), 'object')} not deleted)",
                    )
        except self.failures as e:
            raise self._error(e, "deleting objects") from None
        return n

    def abort_stale_uploads(self, older_than: float) -> int:
        """Abort multipart uploads started more than `older_than` seconds ago (a crash's)."""
        n, now = 0, time.time()
        try:
            res = self.client.list_multipart_uploads(
                Bucket=self.bucket, Prefix=object_root(self.settings)
            )
            for u in res.get("Uploads", []):
                if now - u["Initiated"].timestamp() > older_than:
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]
                    )
                    n += 1
        except self.failures as e:
            raise self._error(e, "aborting stale multipart uploads") from None
        return n
