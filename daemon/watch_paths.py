"""How the watcher names paths: one key per file however an event spells it, and which
directories a schedule covers."""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path


def path_key(path: str | bytes | os.PathLike[str]) -> str:
    """How an event path is matched against watched ones: real path (macOS reports /private/var
    for /var), NFC (HFS+ and FSEvents may hand back NFD), case-folded (APFS and HFS+ are
    case-insensitive by default). Folding on a case-sensitive volume only over-matches, and an
    over-match costs one re-hash that finds nothing: events are hints."""
    real = os.path.realpath(os.fsdecode(path))
    return unicodedata.normalize("NFC", real).casefold()


def identity(d: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(d)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def covers(d: Path, other: Path, *, tree: bool) -> bool:
    """Whether a schedule on directory `d` sees events of `other`'s files: under a tree observer
    when `other` is `d` or below it; under inotify only when `other` is `d` itself."""
    d, other = Path(path_key(d)), Path(path_key(other))
    return other == d or (tree and d in other.parents)


def nearest_dir(path: Path) -> Path | None:
    """The closest existing directory above `path`: a file in a not-yet-created directory is
    found when that directory's creation shows up in its parent."""
    for d in path.parents:
        if d.is_dir():
            return d
    return None
