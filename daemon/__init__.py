"""The kvstore daemon: the store's one writer (socket server, warmer, watcher, service files)."""

from kvstore.daemon.server import Daemon, run

__all__ = ["Daemon", "run"]
