"""What an error reply is, as a code a client matches (never its message text).

An error reply is `{"ok": False, "error": message, "code": ErrorCode}`; the message is for people.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    UNKNOWN_OP = "unknown_op"  # no such operation (a typo, or a daemon of another version)
    BAD_ARGUMENT = "bad_argument"  # a missing or ill-typed argument, or args not a map
    REFUSED = "refused"  # the operation ran and refused (a KVStoreError: no such manifest ...)
    INTERNAL = "internal"  # a bug in the daemon: it cost this request only
    BUSY = "busy"  # over max_connections: the connection was refused
    PROTOCOL = "protocol"  # a malformed frame, or a peer of another protocol version


def code_of(value: object) -> ErrorCode | None:
    """The code an error reply carries, or None (absent, or one this version does not know)."""
    try:
        return ErrorCode(value) if isinstance(value, str) else None
    except ValueError:
        return None
