"""Where the CLI runs an operation: in the daemon when one holds the home (it is the one writer),
else here, on the store directly. The test is the daemon's lock (kvstore.wire.daemon_client
`connect_writer`): a daemon that holds it but does not answer is DaemonNotAnswering, and nothing
is written beside it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvstore.wire.daemon_client import DaemonClient, connect_writer
from kvstore.wire.messages import Reply, Request

R = TypeVar("R", bound=Reply)


class Route:
    """`with Route(home) as r: r.run(request, local)`: through `r.client` when a daemon answers,
    else `local()` (the same operation, called here); either way the request's reply type."""

    def __init__(
        self,
        home: Path,
        *,
        wait: float = 0.0,
        timeout: float = 30.0,
        connect: bool = True,
    ):
        self.client: DaemonClient | None = (
            connect_writer(home, timeout=timeout, wait=wait) if connect else None
        )

    @property
    def local(self) -> bool:
        return self.client is None

    def run(
        self, request: Request[R], local: Callable[[], R], *, timeout: float | None = -1.0
    ) -> R:
        if self.client is None:
            return local()
        return self.client.send(request, timeout=timeout)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def __enter__(self) -> Route:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
