"""`manifests remove`: forget a registered manifest."""

from __future__ import annotations

from pathlib import Path

from kvstore.home.registry import canonical, unregister


def remove(home: Path, path: str | Path) -> tuple[Path, bool]:
    """The manifest's canonical path, and whether it was registered (it is not now)."""
    target = canonical(path)
    return target, unregister(home, target)
