"""The kvstore daemon: the store's one writer (socket server, warmer, watcher, service files)."""

__all__: list[str] = []
