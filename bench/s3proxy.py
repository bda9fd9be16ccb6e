"""A small HTTP proxy in front of an S3 endpoint (the fleet benchmark's bucket): it counts every
request that passes through it (by method: the exact number of bucket requests the boxes made,
uploads and read-through alike) and the bytes it moves each way; optionally it is a slow LAN,
moving at most `bps` bytes a second towards the box and waiting `delay` seconds before it
forwards each request to the server.

It reads just enough HTTP/1.1 to find where each request ends (Content-Length, or a chunked body
and its trailers); responses go back as a plain byte stream, so keep-alive connections work.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter

CHUNK = 16384


class _Closed(Exception):
    """The client closed its connection between requests."""


class _Reader:
    """Buffered reads from a socket: up to a delimiter, or a number of bytes."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def _more(self) -> None:
        chunk = self.sock.recv(CHUNK)
        if not chunk:
            raise _Closed
        self.buf += chunk

    def until(self, delim: bytes) -> bytes:
        while delim not in self.buf:
            self._more()
        head, self.buf = self.buf.split(delim, 1)
        return head + delim

    def some(self, n: int) -> bytes:
        """At most `n` bytes, at least one."""
        if not self.buf:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


class S3Proxy:
    """Listens on a free loopback port; `endpoint` is what a box's settings point at."""

    def __init__(self, target_port: int, *, bps: float = 0.0, delay: float = 0.0):
        self.target, self.bps, self.delay = target_port, bps, delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.methods: Counter[str] = Counter()
        self.bytes_up = self.bytes_down = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def requests(self) -> int:
        with self._lock:
            return sum(self.methods.values())

    def snapshot(self) -> dict:
        """Requests by method and bytes each way, so far."""
        with self._lock:
            return {"methods": dict(self.methods), "bytes_up": self.bytes_up,
                    "bytes_down": self.bytes_down}  # fmt: skip

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._up, args=(client, server), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket) -> None:
        """Requests, one at a time: counted, delayed, forwarded with their bodies."""
        src = _Reader(client)
        try:
            while True:
                head = src.until(b"\r\n\r\n")
                method, headers = _parse_head(head)
                with self._lock:
                    self.methods[method] += 1
                if self.delay:
                    time.sleep(self.delay)
                self._send(server, head)
                if "chunked" in headers.get("transfer-encoding", ""):
                    self._chunked(src, server)
                else:
                    self._body(src, server, int(headers.get("content-length", "0") or 0))
        except (_Closed, OSError, ValueError):
            pass
        finally:
            _close(client, server)

    def _send(self, sock: socket.socket, data: bytes) -> None:
        sock.sendall(data)
        with self._lock:
            self.bytes_up += len(data)

    def _body(self, src: _Reader, server: socket.socket, n: int) -> None:
        while n > 0:
            part = src.some(n)
            self._send(server, part)
            n -= len(part)

    def _chunked(self, src: _Reader, server: socket.socket) -> None:
        while True:
            line = src.until(b"\r\n")
            self._send(server, line)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                break
            self._body(src, server, size + 2)  # the chunk and its CRLF
        while (trailer := src.until(b"\r\n")) != b"\r\n":
            self._send(server, trailer)
        self._send(server, b"\r\n")

    def _down(self, server: socket.socket, client: socket.socket) -> None:
        """Responses as they come, at most `bps` bytes a second."""
        try:
            while chunk := server.recv(CHUNK):
                client.sendall(chunk)
                with self._lock:
                    self.bytes_down += len(chunk)
                if self.bps:
                    time.sleep(len(chunk) / self.bps)
        except OSError:
            pass
        finally:
            _close(server, client)

    def close(self) -> None:
        self.sock.close()


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method = lines[0].split(" ", 1)[0]
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip().lower()
    return method, headers


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.close()
        except OSError:
            pass
