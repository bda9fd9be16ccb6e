"""The daemon's wire format, shared by both ends: length-prefixed msgpack frames.

A frame is a 4-byte big-endian payload length, then that many bytes of msgpack holding one map.
Requests are `{"cmd": name, "args": {...}}`; replies are `{"ok": True, "result": ...}` or
`{"ok": False, "error": message, "code": code}`. Every malformed frame raises ProtocolError, the
one error type for bad frames; a claimed length over the cap is refused before anything is
allocated for it.

What the requests and replies hold, and the error codes: kvstore.wire.messages and
kvstore.wire.codes (the one definition).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import msgpack

from kvstore.degrade import UNREADABLE
from kvstore.errors import ProtocolError
from kvstore.home.settings import DEFAULT

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES: int = DEFAULT.max_frame_bytes
CHUNK_BYTES = 4 * 2**20  # 4 MiB: a put streams larger blobs in frames of this size


def pack(obj: dict[str, Any], *, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """One frame: header and payload. Refuses payloads the other end would refuse."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a frame holds a map, not {type(obj).__name__}")
    payload = msgpack.packb(obj, use_bin_type=True)
    if len(payload) > max_bytes:
        raise ProtocolError(f"frame of {len(payload)} bytes is over the cap of {max_bytes}")
    return HEADER.pack(len(payload)) + payload


def send(sock: socket.socket, obj: dict[str, Any], *, max_bytes: int = MAX_FRAME_BYTES) -> None:
    """Write one frame (uses the socket's own timeout)."""
    sock.sendall(pack(obj, max_bytes=max_bytes))


def unpack_payload(payload: bytes) -> dict[str, Any]:
    """Decode a frame's payload; anything but one msgpack map is a ProtocolError."""
    if not payload:
        raise ProtocolError("empty frame")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except UNREADABLE as e:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"frame is not msgpack ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame holds {type(obj).__name__}, expected a map")
    return obj


def _read_exact(sock: socket.socket, view: memoryview, deadline: float, what: str) -> int:
    """Fill `view`; returns the bytes read (fewer only at EOF). ProtocolError past the deadline."""
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(f"timed out reading the {what}")
        sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            raise ProtocolError(f"timed out reading the {what}") from None
        except OSError as e:
            raise ProtocolError(f"connection failed reading the {what}: {e}") from None
        if n == 0:
            return got
        got += n
    return got


def recv(
    sock: socket.socket,
    *,
    max_bytes: int = MAX_FRAME_BYTES,
    timeout: float | None,
    frame_timeout: float | None = None,
) -> dict[str, Any] | None:
    """Read one frame. None when the peer closed cleanly between frames.

    `timeout` bounds the wait for the frame to start (None: wait forever); once its first byte is
    in, the rest must arrive within `frame_timeout` (default `timeout`), so a peer that trickles
    bytes cannot hold a connection open forever.
    """
    header = bytearray(HEADER.size)
    view = memoryview(header)
    sock.settimeout(timeout)
    try:
        first = sock.recv_into(view[:1])
    except TimeoutError:
        raise ProtocolError("timed out waiting for a frame") from None
    except OSError as e:
        raise ProtocolError(f"connection failed waiting for a frame: {e}") from None
    if first == 0:
        return None
    rest = frame_timeout if frame_timeout is not None else timeout
    deadline = time.monotonic() + (rest if rest is not None else 365 * 86400.0)
    if _read_exact(sock, view[1:], deadline, "frame header") < HEADER.size - 1:
        raise ProtocolError("connection closed inside a frame header")
    (length,) = HEADER.unpack(header)
    if length == 0:
        raise ProtocolError("empty frame")
    if length > max_bytes:  # checked before allocating: the claim may be a lie or an attack
        raise ProtocolError(f"frame claims {length} bytes, over the cap of {max_bytes}")
    payload = bytearray(length)
    if _read_exact(sock, memoryview(payload), deadline, "frame body") < length:
        raise ProtocolError(f"connection closed inside a frame of {length} bytes")
    return unpack_payload(bytes(payload))


def ok(result: Any = None) -> dict[str, Any]:
    return {"ok": True, "result": result}


def error(message: str, code: str | None = None) -> dict[str, Any]:
    """An error reply; `code` (a kvstore.wire.codes.ErrorCode) is what a client matches."""
    reply: dict[str, Any] = {"ok": False, "error": message}
    if code is not None:
        reply["code"] = str(getattr(code, "value", code))
    return reply
