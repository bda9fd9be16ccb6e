"""The metrics port: the Prometheus registry served on 127.0.0.1 (off without --metrics-port)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvstore import metrics
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.daemon")


class MetricsPort:
    """`on_start` runs once the port listens (it sets the gauges that are computed, not
    counted)."""

    def __init__(self, port: int | None, on_start: Callable[[], Any]):
        self.port = port
        self.on_start = on_start
        self._server: Any = None

    def start(self) -> None:
        if self.port is None:
            return
        from prometheus_client import start_http_server

        try:
            server, _ = start_http_server(self.port, addr="127.0.0.1", registry=metrics.REGISTRY)
        except OSError as e:
            raise KVStoreError(
                f"--metrics-port {self.port}: cannot listen on 127.0.0.1: {e}"
            ) from None
        self._server = server
        self.on_start()
        log.info("metrics on http://127.0.0.1:%d/metrics", server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
