"""The one argument validator for socket requests: bad input is an error reply, not a crash.

A bool is not an int (`True` where a size is wanted is refused, not read as 1); None is absent.
The sizes of what requests carry are the protocol's: kvstore.store.keys lays its keys out the
same way (tests/wire holds the two equal).
"""

from __future__ import annotations

from typing import Any

FINGERPRINT_BYTES = 16  # a model fingerprint (xxh3-128)
KEY_BYTES = 32  # an entry key: fingerprint + xxh3-128 of the prefix's packed tokens


def arg(
    args: dict[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    default: Any = None,
    *,
    required: bool = False,
) -> Any:
    """One argument of a request, type-checked; ValueError names it."""
    value = args.get(name)
    if value is None:
        if required:
            raise ValueError(f"argument {name!r} is required")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kinds):
        raise ValueError(f"argument {name!r} must be {kind}, not {type(value).__name__}")
    return value


def key_list(
    args: dict[str, Any], name: str, nbytes: int, *, required: bool = False
) -> list[bytes]:
    """A list of `nbytes`-byte keys."""
    keys = arg(args, name, list, [], required=required)
    if not all(isinstance(k, bytes) and len(k) == nbytes for k in keys):
        raise ValueError(f"argument {name!r} must be a list of {nbytes}-byte keys")
    return keys


def prompt(args: dict[str, Any]) -> tuple[bytes, bytes]:
    """A learned-prefix request's model fingerprint and packed uint32 tokens."""
    fp = arg(args, "fingerprint", bytes, required=True)
    tokens = arg(args, "tokens", bytes, required=True)
    if len(fp) != FINGERPRINT_BYTES or len(tokens) % 4:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, tokens packed uint32")
    return fp, tokens
