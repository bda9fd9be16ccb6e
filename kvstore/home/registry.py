"""The manifests a daemon keeps true, remembered in the home across restarts.

`kvstore warm --manifest X` through a daemon registers X here; a daemon reconciles and watches
every registered manifest at boot, beside its `--manifest` (or the home's default manifest).
`kvstore manifests` lists them and `kvstore manifests remove X` forgets one. One small JSON file,
rewritten whole (settings.write_atomically) under a lock, so a crash leaves the old list or the new.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import KVStoreError
from kvstore.home.settings import write_atomically

REGISTRY_NAME = "manifests.json"
_LOCK_NAME = ".manifests.lock"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Registered:
    path: Path  # resolved, as kvstore.pins.manifest.load_manifest names the file
    added: float  # when it was registered (time.time())

    @property
    def present(self) -> bool:
        return self.path.is_file()


def canonical(path: str | Path) -> Path:
    """One name per manifest file, symlinks resolved (what load_manifest calls `path`)."""
    return Path(path).expanduser().resolve()


def registered(home: Path) -> list[Registered]:
    """The registered manifests, oldest first; none when the file does not exist yet."""
    path = home / REGISTRY_NAME
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise KVStoreError(f"{path}: cannot read the manifest registry: {e}") from None
    try:
        data = json.loads(raw)
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"unknown version {data.get('version')!r}")
        return [Registered(Path(m["path"]), float(m["added"])) for m in data["manifests"]]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise KVStoreError(
            f"{path}: the manifest registry is damaged ({type(e).__name__}: {e}); "
            "fix it, or remove it and warm the manifests again"
        ) from None


def register(home: Path, manifest: str | Path) -> bool:
    """Remember `manifest`; False when it was registered already."""
    target = canonical(manifest)
    with _locked(home):
        entries = registered(home)
        if any(r.path == target for r in entries):
            return False
        _write(home, [*entries, Registered(target, time.time())])
        return True


def unregister(home: Path, manifest: str | Path) -> bool:
    """Forget `manifest` (named by any path to it); False when it was not registered."""
    target = canonical(manifest)
    if not (home / REGISTRY_NAME).exists():
        return False
    with _locked(home):
        entries = registered(home)
        kept = [r for r in entries if r.path != target]
        if len(kept) == len(entries):
            return False
        _write(home, kept)
        return True


@contextmanager
def _locked(home: Path) -> Iterator[None]:
    """Read-modify-write under flock: the daemon and a CLI may edit at once."""
    try:
        fd = os.open(home / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise KVStoreError(f"{home}: cannot lock the manifest registry: {e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write(home: Path, entries: list[Registered]) -> None:
    path = home / REGISTRY_NAME
    data = {
        "version": FORMAT_VERSION,
        "manifests": [{"path": str(r.path), "added": r.added} for r in entries],
    }
    try:
        write_atomically(path, json.dumps(data, indent=1).encode())
    except OSError as e:
        raise KVStoreError(f"{path}: cannot write the manifest registry: {e}") from None
