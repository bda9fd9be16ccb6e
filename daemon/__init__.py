"""The kvstore daemon: the store's one writer (socket server, warmer, watcher, service files).

`kvstore daemon --help` and `kvstore service` import this package: the server (and mlx with it)
loads on first use of `Daemon` or `run`.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"Daemon": "kvstore.daemon.server", "run": "kvstore.daemon.boot"}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore.daemon' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
