"""What an error reply is, as a code a client matches (never its message text).

An error reply is `{"ok": False, "error": message, "code": ErrorCode}`; the message is for people.
A daemon of protocol version 1 sent no code: `legacy_code` reads those replies' text, the one
place a message is matched.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    UNKNOWN_OP = "unknown_op"  # no such operation (an older daemon, or a typo)
    BAD_ARGUMENT = "bad_argument"  # a missing or ill-typed argument, or args not a map
    REFUSED = "refused"  # the operation ran and refused (a KVStoreError: no such manifest ...)
    INTERNAL = "internal"  # a bug in the daemon: it cost this request only
    BUSY = "busy"  # over max_connections: the connection was refused
    PROTOCOL = "protocol"  # a malformed frame: the connection is closed after it


def code_of(value: object) -> ErrorCode | None:
    """The code an error reply carries, or None (absent, or one this version does not know)."""
    try:
        return ErrorCode(value) if isinstance(value, str) else None
    except ValueError:
        return None


# What a version-1 daemon said, for the codes a client acts on.
_LEGACY = (("unknown command", ErrorCode.UNKNOWN_OP), ("too many connections", ErrorCode.BUSY))


def legacy_code(text: str) -> ErrorCode | None:
    """The code of a code-less error reply from an older daemon, read from its text."""
    for words, code in _LEGACY:
        if words in text:
            return code
    return None
