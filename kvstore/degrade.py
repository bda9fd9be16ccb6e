"""kvstore's edges: the only places that catch whatever they are handed.

The cache is never a hard dependency (docs/apps.md): daemon down, store missing or corrupt,
fingerprint mismatch, and the app prefills as it would have without kvstore. Code inside raises
narrow errors (KVStoreError, OSError, RemoteError, UNREADABLE below) and lets the rest go; a
catch-all lives at an entry point only, as one of the four `degrade` kinds:

- `library_call`: work an app's call into kvstore.client does for it (hydrate, restore, offer);
  the app goes on as without kvstore. Logged as a warning.
- `serve_hook`: a hook `kvstore serve` puts into mlx_lm.server; the request is served as mlx-lm
  alone would. Logged as a warning.
- `daemon_handler`: one request, timer tick or warm of the daemon; the daemon goes on. An error
  here is a bug: logged with its traceback.
- `cli_command`: an optional part of a command's output (a preview, a hint); the command goes on.
  Logged at debug.

Each logs one line naming what it swallowed, `<what>: <Type>: <message>`, and keeps it on
`.error` so the caller continues as it would have without kvstore (`what` may be a function,
called at the failure, for a line that tells how far the block got):

    with library_call("kvstore: learned chains not read into memory") as failed:
        n = warm_chains()
    if failed.error is not None:
        n = 0

Two more edges catch broadly and swallow nothing:

- `foreign(error)`: a library kvstore drives with input it did not write (transformers, a
  model's own code, a chat template, a plugin) may raise any type; it becomes the one
  KVStoreError `error` builds, naming the model or file at fault (bad input gets no traceback).
- `settle(future, fn)`: a job a worker thread runs for a caller waiting on `future`; its result,
  or whatever it raised, is the caller's, and the worker lives on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import msgpack

from kvstore.errors import KVStoreError, StoreDamaged

if TYPE_CHECKING:
    from concurrent.futures import Future

T = TypeVar("T")

log = logging.getLogger("kvstore")

What = str | Callable[[], str]  # a degrade block's line, or what words it at the failure

# What reading bytes another process or box wrote can raise when they are bad: msgpack's own
# errors (FormatError, StackError, ExtraData, OutOfData: some are ValueErrors, some not), a
# UnicodeDecodeError, and the TypeError / KeyError / IndexError / OverflowError of taking a
# field of the wrong shape (`int(d["n"])`, `cls(**d)`). Narrow: a bug elsewhere still raises.
UNREADABLE: tuple[type[Exception], ...] = (
    msgpack.UnpackException,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
)


class Degrade:
    """A block at an entry point whose failure must not reach the app, the server or the daemon:
    an Exception raised in it is logged as one line and kept on `error` (None: it ran through).
    Built by the four kinds below, not directly."""

    __slots__ = ("what", "level", "trace", "logger", "error")

    def __init__(self, what: What, level: int, trace: bool, logger: logging.Logger):
        self.what, self.level, self.trace, self.logger = what, level, trace, logger
        self.error: Exception | None = None

    def __enter__(self) -> Degrade:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if not isinstance(error, Exception):  # none, or KeyboardInterrupt / SystemExit: passed on
            return False
        self.error = error
        self.logger.log(
            self.level,
            "%s: %s: %s",
            self.what if isinstance(self.what, str) else self.what(),
            type(error).__name__,
            error,
            # a damaged store file is a condition its line explains, never a bug to trace
            exc_info=error if self.trace and not isinstance(error, StoreDamaged) else None,
        )
        return True


def library_call(
    what: What, *, level: int = logging.WARNING, logger: logging.Logger = log
) -> Degrade:
    """A library call's work for the app (kvstore.client): the app goes on without kvstore."""
    return Degrade(what, level, False, logger)


def serve_hook(
    what: What, *, level: int = logging.WARNING, logger: logging.Logger = log
) -> Degrade:
    """A hook in mlx_lm.server: the request is served as mlx-lm alone would serve it."""
    return Degrade(what, level, False, logger)


def daemon_handler(what: What, *, logger: logging.Logger = log) -> Degrade:
    """One request, tick or warm of the daemon: it costs that one, never the daemon. Logged at
    error with the traceback: nothing narrower caught it, so it is a bug to fix (a damaged store
    file, StoreDamaged, is logged without one: the daemon stops on it)."""
    return Degrade(what, logging.ERROR, True, logger)


def cli_command(what: What, *, level: int = logging.DEBUG, logger: logging.Logger = log) -> Degrade:
    """An optional part of a CLI command's output (a preview, a hint): the command goes on."""
    return Degrade(what, level, False, logger)


@contextmanager
def foreign(error: Callable[[Exception], Exception]) -> Iterator[None]:
    """Around a call into a library kvstore drives with input it did not write: whatever it
    raises (tokenizers raises bare Exception) becomes `error(e)`, raised without the library's
    traceback. A KVStoreError raised in the block passes unchanged."""
    try:
        yield
    except KVStoreError:
        raise
    except Exception as e:
        raise error(e) from None


def settle(future: Future[T], fn: Callable[[], T]) -> None:
    """Run `fn` for the caller waiting on `future`: its result, or whatever it raised, set there.
    BaseException too: a SystemExit in a job is the caller's to see, not the end of the worker
    (which would leave the caller waiting for ever)."""
    try:
        result = fn()
    except BaseException as e:
        future.set_exception(e)
    else:
        future.set_result(result)
