"""One client's connection to the daemon: its socket, the frame size and timeouts that apply to
it, and the streamed put's frames gathered into one buffer."""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from typing import Any

from kvstore.errors import ProtocolError
from kvstore.home.settings import Settings
from kvstore.wire import protocol

log = logging.getLogger("kvstore.daemon")


class Connection:
    """One client socket and the timeouts that apply to it."""

    def __init__(self, sock: socket.socket, settings: Settings | Mapping[str, object]):
        self.sock = sock
        limits = Settings.of(settings)  # a mapping as Settings.of takes one
        self.max_bytes = int(limits.max_frame_bytes)
        self.header_timeout = float(limits.header_timeout)
        self.idle_timeout = float(limits.idle_timeout)
        self.close_after_reply = False
        self.requests = 0

    def next_request(self) -> dict[str, Any] | None:
        # The first frame must come quickly (a connection that says nothing holds a slot);
        # later ones may wait idle_timeout. Once a frame starts, all of it within header_timeout.
        wait = self.header_timeout if self.requests == 0 else self.idle_timeout
        if self.requests and not self._readable(wait):
            self._close_idle()
            return None
        msg = protocol.recv(
            self.sock, max_bytes=self.max_bytes, timeout=wait, frame_timeout=self.header_timeout
        )
        self.requests += 1
        return msg

    def _readable(self, timeout: float) -> bool:
        """Whether something (a frame, the peer's close, an error) arrives within `timeout`."""
        self.sock.settimeout(timeout)
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            return False
        except OSError:
            pass  # protocol.recv meets it again and says what it was
        return True

    def _close_idle(self) -> None:
        """A client silent for idle_timeout between requests (an app between calls) is normal
        operation: logged below warning, and told why before the daemon hangs up, as before."""
        log.debug("closed a connection idle for %gs (idle_timeout)", self.idle_timeout)
        try:
            self.sock.settimeout(1.0)
            msg = f"timed out waiting for a frame: idle for {self.idle_timeout:g}s (idle_timeout)"
            protocol.send(self.sock, protocol.error(msg), max_bytes=self.max_bytes)
        except (OSError, ProtocolError):
            pass

    def receive_stream(self, nbytes: int) -> bytearray:
        """The `{"data": bytes}` frames of a streamed put, exactly `nbytes` in all, appended to
        one buffer that grows with the bytes that arrive (never past `nbytes`, which the caller
        caps): a client that claims 8 GiB and sends 1 MiB costs the daemon 1 MiB, not 8 GiB of
        zeroed pages. The blob is still held once (plus CPython's ~1/8 growth slack and one
        frame); large blocks grow in place through glibc's mremap."""
        buf = bytearray()
        while (got := len(buf)) < nbytes:
            msg = protocol.recv(
                self.sock,
                max_bytes=self.max_bytes,
                timeout=self.idle_timeout,
                frame_timeout=self.header_timeout,
            )
            if msg is None:
                raise ProtocolError(f"connection closed after {got} of {nbytes} streamed bytes")
            data = msg.get("data")
            if not isinstance(data, bytes) or not data or got + len(data) > nbytes:
                raise ProtocolError("a streamed put frame must hold the next `data` bytes")
            buf += data
        return buf

    def reply(self, obj: dict[str, Any]) -> None:
        self.sock.settimeout(self.idle_timeout)  # a client that never reads cannot pin a thread
        try:
            protocol.send(self.sock, obj, max_bytes=self.max_bytes)
        except ProtocolError as e:  # e.g. an `ls` too large for one frame
            protocol.send(self.sock, protocol.error(str(e)), max_bytes=self.max_bytes)
