"""The clock a chat template sees while kvstore renders a pin.

Templates read the time through transformers' `strftime_now` jinja global, which calls
`datetime.now()` from `transformers.utils.chat_template_utils` at render time (Llama 3.1/3.2
JSON, gpt-oss). kvstore replaces that module's `datetime` name once with a subclass whose `now()`
answers from a context variable: unset (every render outside `clock_at`) it is the real clock, so
nothing changes for other code, and the setting is per thread and per context, so a daemon render
never moves the clock of a request rendered concurrently.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
from collections.abc import Iterator
from contextvars import ContextVar

log = logging.getLogger("kvstore")
_NOW: ContextVar[_dt.datetime | None] = ContextVar("kvstore_template_now", default=None)


class TemplateClock(_dt.datetime):
    """`datetime` as transformers' chat template globals see it."""

    @classmethod
    def now(cls, tz: _dt.tzinfo | None = None) -> _dt.datetime:  # type: ignore[override]
        fixed = _NOW.get()
        if fixed is None:
            return _dt.datetime.now(tz)
        return fixed.astimezone(tz) if tz is not None and fixed.tzinfo is not None else fixed

    @classmethod
    def today(cls) -> _dt.datetime:  # type: ignore[override]
        return cls.now()


def install() -> bool:
    """Route transformers' template clock through `clock_at`; False when transformers no longer
    has the `datetime` name there (then probes cannot move the clock, and say so)."""
    try:
        from transformers.utils import chat_template_utils as ctu
    except ImportError:  # pragma: no cover - transformers is a dependency of mlx-lm
        return False
    current = getattr(ctu, "datetime", None)
    if current is TemplateClock:
        return True
    if current is not _dt.datetime:
        return False
    ctu.datetime = TemplateClock
    return True


@contextlib.contextmanager
def clock_at(now: _dt.datetime) -> Iterator[None]:
    """Templates rendered inside this block (in this thread or context) see `now`."""
    if not install():
        # Someone else replaced transformers' clock: probes cannot move it; say so, go on.
        log.warning("kvstore: cannot set the chat template clock; dates are not probed")
    token = _NOW.set(now)
    try:
        yield
    finally:
        _NOW.reset(token)


def local_now() -> _dt.datetime:
    """The real local wall clock: what `strftime_now` prints for a real request."""
    return _dt.datetime.now()
