"""The kvstore error hierarchy: every message names the file, key or setting at fault.

`counted` words the counts those messages (and the CLI's output) carry: "1 entry", "2 entries";
`got` shows the wrong value a message is about.
"""

import datetime as _datetime
import errno as _errno
from typing import Any


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it takes: counted(1, "entry") is "1 entry", counted(2,
    "entry") "2 entries"; give `plural` where adding -s (or y -> -ies) is wrong."""
    if n == 1:
        return f"{n} {noun}"
    if plural is None:
        consonant_y = noun.endswith("y") and noun[-2:-1] not in ("a", "e", "i", "o", "u")
        plural = noun[:-1] + "ies" if consonant_y else noun + "s"
    return f"{n} {plural}"


_KINDS = (  # TOML's names for what a value is (bool before int: True is an int in Python)
    (bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
    (list, "an array"), (tuple, "an array"), (dict, "a table"),
    (_datetime.datetime, "a date-time"), (_datetime.date, "a date"), (_datetime.time, "a time"),
)  # fmt: skip


def got(value: Any) -> str:
    """A wrong value as an error shows it: its text, cut short, and its type in TOML's words."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = next((k for t, k in _KINDS if isinstance(value, t)), type(value).__name__)
    return f"{text} ({kind})"


# OS errors that pass: a full disk or quota, an I/O error, memory or descriptors short for now.
# A process that failed on one of these is worth starting again; a permission or a bad path is not.
TRANSIENT_ERRNOS = frozenset(
    {
        _errno.ENOSPC,
        _errno.EDQUOT,
        _errno.EIO,
        _errno.ENOMEM,
        _errno.EAGAIN,
        _errno.EBUSY,
        _errno.EINTR,
        _errno.ETIMEDOUT,
        _errno.ENFILE,
        _errno.EMFILE,
        _errno.ESTALE,
    }
)
DISK_FULL_ERRNOS = frozenset({_errno.ENOSPC, _errno.EDQUOT})


class KVStoreError(Exception):
    """Base class for every error kvstore raises on purpose."""


class ManifestError(KVStoreError):
    """A manifest (or a file it references) is malformed; names file, model, prefix, field."""


class CodecError(KVStoreError):
    """A stored blob failed validation before mlx touched its bytes."""


class CorruptEntryError(KVStoreError):
    """A stored entry is unreadable: bad meta, checksum mismatch, truncated value, or a bad blob."""

    def __init__(self, key: bytes, reason: str):
        self.key = key
        self.reason = reason
        super().__init__(f"entry {key.hex()}: {reason}")


class StoreError(KVStoreError):
    """The LMDB store cannot be opened or written; `errno` is the OS error behind it, if any."""

    def __init__(self, message: str, *, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class StoreDamaged(StoreError):
    """The store file is damaged (truncated, overwritten, pages that are no LMDB pages): no
    retry or restart mends it; the message names the file and says to restore or move it aside."""


class ModelError(KVStoreError):
    """A model path cannot be resolved, fingerprinted or loaded."""


class ProtocolError(KVStoreError):
    """A socket frame is malformed, too large, or timed out."""


class DaemonError(KVStoreError):
    """The daemon answered a request with an error; `code` is its kvstore.wire.codes.ErrorCode
    (None: none given, or one this version does not know)."""

    def __init__(self, message: str, *, code: Any = None):
        self.code = code
        super().__init__(message)


class PrefillStopped(KVStoreError):
    """A prefill's stop check said stop: it stopped between chunks and its cache is discarded."""


class RemoteError(KVStoreError):
    """The fleet tier's object store failed or refused a request; `cause` says which way."""

    def __init__(self, cause: str, message: str):
        self.cause = cause  # "unreachable" | "credentials" | "bucket" | "corrupt" | "version" ...
        super().__init__(message)


class ChecksumError(CodecError):
    """A blob's bytes do not hash to the checksum its meta recorded."""


def os_errno(e: BaseException | None) -> int | None:
    """The OS error number behind `e`: its own `errno`, else its cause's or context's."""
    for _ in range(8):  # a short chain; never a cycle
        if e is None:
            return None
        code = getattr(e, "errno", None)
        if isinstance(code, int):
            return code
        e = e.__cause__ or e.__context__
    return None


def transient(e: BaseException) -> bool:
    """Whether `e` comes from an OS error that passes (TRANSIENT_ERRNOS)."""
    return os_errno(e) in TRANSIENT_ERRNOS
