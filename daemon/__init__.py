"""The kvstore daemon: the store's one writer (socket server, warmer, watcher, service files).

`kvstore daemon --help` and `kvstore service` import this package: the server (and mlx with it)
loads on first use of `Daemon` or `run`.
"""

from __future__ import annotations

from kvstore.lazy import lazy_exports

_LAZY = {"Daemon": "kvstore.daemon.server", "run": "kvstore.daemon.boot"}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
