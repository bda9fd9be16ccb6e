"""One settings table (units in comments) and where the home lives.

Precedence: DEFAULT (the `Settings` table) < `settings.toml` in the home < command line / env.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class Settings:
    """Every setting and its default (the one table): the keys `settings.toml` may hold."""

    max_bytes: int = 8 * 2**30  # bytes (8 GiB): the store's budget; LRU evicts unpinned above it
    map_size: int = 64 * 2**20  # bytes (64 MiB): initial LMDB map size; doubled on MapFullError
    max_map_size: int = 1 * 2**40  # bytes (1 TiB): growth cap of the LMDB map
    max_frame_bytes: int = 64 * 2**20  # bytes (64 MiB): largest socket frame accepted
    header_timeout: float = 5.0  # s to receive a frame's header once a connection opens
    idle_timeout: float = 60.0  # s a connection may stay silent between frames
    max_connections: int = 32  # concurrent socket connections served
    debounce: float = 0.5  # s: file events are collected this long before re-hashing
    poll_interval: float = 5.0  # s between re-hash passes when no file observer can run
    reader_check_interval: float = 60.0  # s between LMDB reader_check() passes in the daemon
    version_check_interval: float = 30.0  # s between reads of the installed mlx/mlx-lm versions
    memory_check_interval: float = 15.0  # s between checks whether a deferred warm now fits
    max_pin_tokens: int = 32768  # tokens: a longer pin is refused before its prefill (one line)
    learn: bool = True  # serve learns recurring prefixes (PersistentPromptCache: learn=False)
    learn_min_requests: int = 2  # distinct requests that must share a prefix before it is learned
    block_tokens: int = 256  # tokens per learned block record (cut at multiples, plus exact ends)
    learned_max_bytes: int = 2 * 2**30  # bytes (2 GiB): learned data's budget inside max_bytes
    learn_write_bytes_per_day: int = 4 * 2**30  # bytes/day (4 GiB) learned, then learning pauses
    max_snapshots_per_prefix: int = 2  # state-layer models: learned whole-cache entries per chain
    allow_unsigned: bool = False  # a box without a fleet key takes fleet objects unauthenticated
    remote: Mapping[str, Any] | None = None  # the [remote] table (kvstore.fleet.remote_settings)

    @classmethod
    def of(cls, value: Settings | Mapping[str, object]) -> Settings:
        """`value` itself, or the settings a mapping names (the defaults for those it leaves out,
        other keys dropped)."""
        if isinstance(value, Settings):
            return value
        names = {f.name for f in fields(cls)}
        known: dict[str, Any] = {k: v for k, v in value.items() if k in names}
        return cls(**known)

    def table(self) -> dict[str, object]:
        """The settings as `kvstore stats` shows them: each by name, `remote` only when set."""
        table = asdict(self)
        if table["remote"] is None:
            del table["remote"]
        return table


DEFAULT = Settings()
DEFAULTS: dict[str, object] = asdict(DEFAULT)  # the same table as a plain map

# The unit each setting is in, for `kvstore stats` to show it in (--json gives the raw numbers).
UNITS: dict[str, str] = {
    "max_bytes": "bytes",
    "map_size": "bytes",
    "max_map_size": "bytes",
    "max_frame_bytes": "bytes",
    "header_timeout": "s",
    "idle_timeout": "s",
    "debounce": "s",
    "poll_interval": "s",
    "reader_check_interval": "s",
    "version_check_interval": "s",
    "memory_check_interval": "s",
    "block_tokens": "tokens",
    "learned_max_bytes": "bytes",
    "learn_write_bytes_per_day": "bytes/day",
}

STORE_DIR = "store"
SOCKET_NAME = "kvstore.sock"
LOCK_NAME = "daemon.lock"
MANIFEST_NAME = "manifest.toml"
FILEHASH_NAME = "filehash.msgpack"


def default_home() -> Path:
    """`$KVSTORE_HOME`, else the platform's per-user data directory."""
    if env := os.environ.get("KVSTORE_HOME"):
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "kvstore"
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "kvstore"


def resolve_home(home: str | Path | None) -> Path:
    return Path(home).expanduser() if home else default_home()


def home_problem(home: Path) -> str | None:
    """Why `home` cannot be a kvstore home, found without creating anything: it, or the nearest
    part of its path that exists, is no directory, or cannot be reached. None when it can be."""
    for part in (home, *home.parents):
        try:
            mode = part.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # missing (or under a file): the next part up tells
        except OSError as e:
            return f"kvstore home {home}: cannot reach {part}: {e.strerror}"
        if stat.S_ISDIR(mode):
            return None
        if part == home:
            return f"kvstore home {home}: is a file, not a directory; give --home a directory"
        return f"kvstore home {home}: {part} is a file, not a directory; give --home a directory"
    return None


def store_dir_problem(path: Path) -> str | None:
    """Why `path` (a home's store/) cannot hold the store although it exists, or None."""
    if path.exists() and not path.is_dir():
        return f"{path}: is a file, not the store's directory; move it aside"
    return None


def given_home(value: str | Path | None, *, check: bool = True) -> Path:
    """The home a command was given (--home, else $KVSTORE_HOME, else the per-user default),
    resolved. With `check`, a KVStoreError in one line when it cannot be one: an empty path, a
    file, a path under a file, unreachable (the daemon says so itself: its log line and exit
    status)."""
    if value is not None and not str(value):  # `--home ""`: not the current directory
        raise KVStoreError("--home is empty; give a directory (or leave it out)")
    home = resolve_home(value)
    if check and (problem := home_problem(home) or store_dir_problem(home / STORE_DIR)):
        raise KVStoreError(problem)
    return home


# Names a kvstore home holds (store/, the socket, the daemon's lock and log, the home's files):
# a directory holding one of them is a home already; one holding other files only is not.
HOME_MARKERS = frozenset({
    STORE_DIR, SOCKET_NAME, LOCK_NAME, MANIFEST_NAME, FILEHASH_NAME, "settings.toml",
    "ledger.msgpack", "evicted.msgpack", "manifests.json", "runtime.json", "daemon.log",
})  # fmt: skip


def foreign_dir_problem(home: Path) -> str | None:
    """Why an existing `home` is another program's directory (it holds files and none of a
    kvstore home's), or None. kvstore never takes such a directory over."""
    try:
        names = [p.name for p in home.iterdir()]
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"kvstore home {home}: cannot list it: {e.strerror}"
    if not names or HOME_MARKERS.intersection(names):
        return None
    return (
        f"kvstore home {home}: holds other files ({len(names)}) and no kvstore home; give "
        "--home a new or empty directory (kvstore never changes a directory it did not create)"
    )


def ensure_home(home: Path) -> Path:
    """Create the home (0700) if missing. An existing directory is used as it is: kvstore never
    changes the mode of a directory it did not create (`--home /tmp` or `--home .` must not lock
    other users out); one that holds other files and no kvstore home is refused, and the files
    kvstore creates in a home are 0600 whatever the directory's mode. A home that cannot be made
    or used (a path under a file, no permission) raises KVStoreError naming it."""
    if problem := home_problem(home):
        raise KVStoreError(problem)
    if home.is_dir():
        if problem := foreign_dir_problem(home):
            raise KVStoreError(problem)
        return home
    try:
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise KVStoreError(
            f"kvstore home {home}: cannot create it: {e.strerror}; check the permissions of "
            "its parent, or give --home a directory you can write"
        ) from e
    return home


def write_private(path: Path, data: bytes) -> None:
    """Create `path` (owner-only, 0600 whatever the umask: a home given as an existing directory
    may let others in) holding `data`, fsynced. A file already there is replaced by a new one, so
    a stale one's mode never carries over. Raises OSError."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` (0600, write_private) so that a crash or power cut leaves the
    old file or the new, and a return means the new one is on disk: temp file fsynced, renamed
    over, and the directory fsynced (the rename is an entry in it, lost with it otherwise).
    Raises OSError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with ExitStack() as undo:  # the temp file removed again if anything stops the write
        undo.callback(tmp.unlink, missing_ok=True)
        write_private(tmp, data)
        os.replace(tmp, path)
        undo.pop_all()
    fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: a file system that cannot sync a directory
            raise
    finally:
        os.close(fd)


def load_settings(home: Path, **overrides: object) -> Settings:
    """DEFAULT < home/settings.toml < overrides (None values are ignored). A file that cannot be
    read or names an unknown setting raises KVStoreError naming it."""
    path = home / "settings.toml"
    stored: dict[str, object] = {}
    if path.is_file():
        try:
            stored = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise KVStoreError(f"{path}: cannot read settings: {e}") from e
        unknown = sorted(set(stored) - set(DEFAULTS))
        if unknown:
            raise KVStoreError(f"{path}: unknown setting(s) {', '.join(unknown)}")
    stored.update({k: v for k, v in overrides.items() if v is not None})
    return Settings.of(stored)
