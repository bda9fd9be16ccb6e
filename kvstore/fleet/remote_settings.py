"""The `[remote]` table of HOME/settings.toml: where the fleet's object store is, and how to use it.

Without the table the fleet tier is off and everything is local, as before. The secret lives in a
separate credentials file that must be 0600 (like ~/.ssh keys); it is never logged or shown.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.home.settings import Settings, write_private

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# The least a [remote] table holds: `kvstore remote --help` shows it, a missing table points to it
REMOTE_SAMPLE = """\
[remote]                                   # in HOME/settings.toml
endpoint = "http://kv.lan:8333"            # the S3 API: SeaweedFS, AWS S3, Ceph RGW, R2
bucket = "kvstore"
# credentials = "~/.config/kvstore/s3.toml"  # access_key_id, secret_access_key; chmod 600
"""


class RemoteSettingsError(KVStoreError):
    """The [remote] table or its credentials file is wrong."""


@dataclass(frozen=True)
class RemoteSettings:
    """The [remote] table (units in comments). `endpoint` and `bucket` are required."""

    endpoint: str = ""  # http(s)://host:port of the S3 API (SeaweedFS, AWS S3, Ceph RGW, R2)
    bucket: str = ""
    prefix: str = ""  # optional key prefix inside the bucket (a team, a fleet)
    region: str = "us-east-1"
    credentials: str = ""  # TOML file with access_key_id, secret_access_key; must be 0600
    ca_bundle: str = ""  # PEM file of the CA that signed an https endpoint's certificate (a LAN CA)
    upload: bool = True  # write-behind upload of every local commit
    download: bool = True  # read-through when warming, and `kvstore remote pull`
    fetch_deadline: float = 30.0  # seconds: a fetch still running after this is dropped (prefill)
    connect_timeout: float = 2.0  # seconds to open a connection to the endpoint
    read_timeout: float = 10.0  # seconds a socket read may stall
    max_bytes: int = 100 * 2**30  # bytes (100 GiB): the bucket's budget, held by `remote gc`
    multipart_threshold: int = 64 * 2**20  # bytes (64 MiB): larger blobs upload in parts
    part_size: int = 16 * 2**20  # bytes (16 MiB) per part (S3's minimum is 5 MiB)
    retry_interval: float = 30.0  # seconds the uploader waits after the remote failed
    access_key_id: str | None = field(default=None, repr=False)  # from `credentials`, never shown
    secret_access_key: str | None = field(default=None, repr=False)
    # the fleet key(s) every object's MAC is made and checked with (credentials: fleet_key,
    # fleet_key_previous while a rotation re-uploads); none: objects are taken unauthenticated
    fleet_keys: tuple[bytes, ...] = field(default=(), repr=False)
    box_id: str = ""  # this box, named in what it uploads (HOME/box_id, made at first use)
    # from the home's top-level `allow_unsigned` (not the table): without a fleet key, objects are
    # taken unauthenticated only when it is true, else refused; with a key it changes nothing
    allow_unsigned: bool = False

    def shown(self) -> dict[str, Any]:
        """What `kvstore stats` and `remote status` show: every setting, never the secret."""
        out = {k: getattr(self, k) for k in REMOTE_DEFAULTS}
        out["access_key_id"] = self.access_key_id
        out["secret_access_key"] = "(set)" if self.secret_access_key else None
        out["fleet_key"] = "(set)" if self.fleet_keys else None
        out["fleet_key_previous"] = "(set)" if len(self.fleet_keys) > 1 else None
        out["box_id"] = self.box_id
        out["allow_unsigned"] = self.allow_unsigned
        return out


SECRETS = (
    "access_key_id",
    "secret_access_key",
    "fleet_keys",
    "box_id",
)  # read from the credentials file, not the table
HOME_KEYS = ("allow_unsigned",)  # top-level settings of the home (kvstore.home.settings)
# Every key the table may hold, and its default: RemoteSettings' fields less the secrets.
REMOTE_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(RemoteSettings) if f.name not in SECRETS + HOME_KEYS
}

_TYPES: dict[str, type | tuple[type, ...]] = {
    k: (int, float) if isinstance(v, float) else type(v) for k, v in REMOTE_DEFAULTS.items()
}


FLEET_KEY_BYTES = 32  # HMAC-SHA256 key, written as 64 hex digits


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str
    fleet_keys: tuple[bytes, ...]  # fleet_key, then fleet_key_previous when set


def _fleet_key(data: dict, name: str, path: Path) -> bytes | None:
    text = data.get(name)
    if text is None:
        return None
    try:
        raw = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != FLEET_KEY_BYTES:
        raise RemoteSettingsError(
            f"[remote] credentials {path}: {name} must be {2 * FLEET_KEY_BYTES} hex digits "
            "(make one with `kvstore remote key new`)"
        )
    return raw


def read_credentials(path: Path) -> Credentials:
    """access_key_id, secret_access_key and the fleet key(s) from a TOML file that only its owner
    can read."""
    try:
        st = path.stat()
    except OSError as e:
        raise RemoteSettingsError(
            f"[remote] credentials {path}: cannot read: {e.strerror}"
        ) from None
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise RemoteSettingsError(
            f"[remote] credentials {path}: mode {stat.S_IMODE(st.st_mode):04o} lets others read "
            f"the secret; refused (chmod 600 {path})"
        )
    if st.st_uid != os.getuid():
        raise RemoteSettingsError(f"[remote] credentials {path}: not owned by this user; refused")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        # the parser's message may quote the file's text: name the file, not its content
        raise RemoteSettingsError(
            f"[remote] credentials {path}: not valid TOML ({type(e).__name__})"
        ) from None
    key, secret = data.get("access_key_id"), data.get("secret_access_key")
    if not isinstance(key, str) or not isinstance(secret, str) or not key or not secret:
        raise RemoteSettingsError(
            f"[remote] credentials {path}: needs string keys access_key_id and secret_access_key"
        )
    keys = [_fleet_key(data, n, path) for n in ("fleet_key", "fleet_key_previous")]
    if keys[0] is None and keys[1] is not None:
        raise RemoteSettingsError(
            f"[remote] credentials {path}: fleet_key_previous without a fleet_key"
        )
    return Credentials(key, secret, tuple(k for k in keys if k is not None))


def credentials_path(credentials: str, source: Path) -> Path:
    """The credentials file a [remote] table names (relative: beside settings.toml)."""
    path = Path(credentials).expanduser()
    return path if path.is_absolute() else source.parent / path


def box_id(home: Path) -> str:
    """This box's id (HOME/box_id), made at first use: what it uploads names it."""
    import secrets

    path = home / "box_id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise RemoteSettingsError(f"{path}: cannot read this box's id: {e.strerror}") from None
    made = f"box-{secrets.token_hex(6)}"
    tmp = path.with_name(f".box_id.{os.getpid()}")
    try:
        write_private(tmp, f"{made}\n".encode())
        os.link(tmp, path)  # atomic and exclusive: two first uses agree on the first one linked
    except FileExistsError:
        return path.read_text().strip()
    except OSError as e:
        raise RemoteSettingsError(f"{path}: cannot make this box's id: {e.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return made


def parse_remote(table: Any, *, source: Path, box: str = "") -> RemoteSettings:
    """The [remote] table as read from `source`, checked field by field."""
    if not isinstance(table, dict):
        raise RemoteSettingsError(f"{source}: [remote] must be a table")
    unknown = sorted(set(table) - set(REMOTE_DEFAULTS))
    if unknown:
        raise RemoteSettingsError(f"{source}: unknown [remote] setting(s) {', '.join(unknown)}")
    merged = {**REMOTE_DEFAULTS, **table}
    for k, kind in _TYPES.items():
        v = merged[k]
        if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
            raise RemoteSettingsError(f"{source}: [remote] {k} must be {kind}, not {v!r}")
    for k in ("endpoint", "bucket"):
        if not merged[k]:
            raise RemoteSettingsError(f"{source}: [remote] {k} is required")
    if not merged["endpoint"].startswith(("http://", "https://")):
        raise RemoteSettingsError(
            f"{source}: [remote] endpoint must start with http:// or https://"
        )
    if merged["part_size"] < 5 * 2**20:
        raise RemoteSettingsError(f"{source}: [remote] part_size must be at least 5 MiB (S3)")
    merged["prefix"] = merged["prefix"].strip("/")
    if not merged["credentials"]:
        return RemoteSettings(**merged, box_id=box)
    c = read_credentials(credentials_path(merged["credentials"], source))
    return RemoteSettings(
        **merged, access_key_id=c.access_key_id, secret_access_key=c.secret_access_key,
        fleet_keys=c.fleet_keys, box_id=box,
    )  # fmt: skip


def remote_settings(settings: Settings, home: Path) -> RemoteSettings | None:
    """The fleet tier's settings from load_settings()'s result, or None when there is no table."""
    table = settings.remote
    if table is None:
        return None
    rs = parse_remote(table, source=home / "settings.toml", box=box_id(home))
    unsigned = settings.allow_unsigned
    if not isinstance(unsigned, bool):
        raise RemoteSettingsError(
            f"{home / 'settings.toml'}: allow_unsigned must be true or false, not {unsigned!r}"
        )
    return replace(rs, allow_unsigned=unsigned)
