"""kvstore.degrade: the entry points' degrade kinds log one line and go on, foreign failures
become one error of ours, worker jobs hand everything to their caller, and UNREADABLE holds
every error msgpack raises for bad bytes. Also: the broad handlers stay few."""

from __future__ import annotations

import logging
import random
import re
from concurrent.futures import Future
from pathlib import Path

import msgpack
import pytest

from kvstore.degrade import (
    UNREADABLE,
    cli_command,
    daemon_handler,
    foreign,
    library_call,
    serve_hook,
    settle,
)
from kvstore.errors import KVStoreError, ModelError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("kind", "level"),
    [(library_call, logging.WARNING), (serve_hook, logging.WARNING), (cli_command, logging.DEBUG)],
)
def test_a_degrade_kind_logs_one_line_and_goes_on(caplog, kind, level):
    caplog.set_level(logging.DEBUG, logger="kvstore")
    with kind("kvstore: learned chains not read") as failed:
        raise ValueError("torn record")
    assert isinstance(failed.error, ValueError)
    [rec] = caplog.records
    assert rec.levelno == level
    assert rec.getMessage() == "kvstore: learned chains not read: ValueError: torn record"
    assert rec.exc_info is None


def test_a_daemon_handler_logs_the_traceback_at_error(caplog):
    caplog.set_level(logging.DEBUG, logger="kvstore")
    with daemon_handler("reconcile: warming pins.toml failed") as failed:
        raise RuntimeError("a bug")
    [rec] = caplog.records
    assert rec.levelno == logging.ERROR and rec.exc_info is not None
    assert rec.exc_info[1] is failed.error
    assert rec.getMessage() == "reconcile: warming pins.toml failed: RuntimeError: a bug"


def test_a_line_worded_at_the_failure_tells_how_far_the_block_got(caplog):
    done = 0
    with serve_hook(lambda: f"kvstore: warm-up request failed ({done} of 3 done)"):
        done += 1
        raise TimeoutError("no answer")
    [rec] = caplog.records
    assert (
        rec.getMessage() == "kvstore: warm-up request failed (1 of 3 done): TimeoutError: no answer"
    )


def test_a_block_that_runs_through_logs_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger="kvstore")
    with library_call("kvstore: x") as failed:
        pass
    assert failed.error is None and caplog.records == []


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_degrade_never_swallows_an_interrupt_or_an_exit(stop):
    with pytest.raises(stop), library_call("kvstore: x"):
        raise stop()


def test_a_degrade_block_keeps_its_return():
    def f() -> int:
        with serve_hook("kvstore: x"):
            return 1
        return 0  # what the hook does when the block failed

    assert f() == 1


def test_foreign_turns_anything_into_the_error_it_builds():
    def failing() -> None:
        with foreign(lambda e: ModelError(f"model m: cannot load: {e}")):
            raise Exception("data did not match any variant")  # as tokenizers raises

    with pytest.raises(ModelError, match="model m: cannot load: data did not match") as got:
        failing()
    assert got.value.__cause__ is None and got.value.__suppress_context__


def test_foreign_passes_our_own_errors_unchanged():
    ours = KVStoreError("named already")
    with pytest.raises(KVStoreError) as got, foreign(lambda e: ModelError("wrapped")):
        raise ours
    assert got.value is ours


def test_settle_hands_the_result_or_anything_raised_to_the_caller():
    ok: Future = Future()
    settle(ok, lambda: 42)
    assert ok.result() == 42
    for raised in (ValueError("bad"), SystemExit(3)):
        failed: Future = Future()

        def job(raised: BaseException = raised) -> None:
            raise raised

        settle(failed, job)  # returns: the worker lives on
        assert failed.exception() is raised


def _mutations(rng: random.Random, good: bytes) -> bytes:
    b = bytearray(good)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(b))
        b[i] = rng.randrange(256)
    return bytes(b[: rng.randint(0, len(b))]) if rng.random() < 0.3 else bytes(b)


def test_unreadable_holds_whatever_msgpack_raises_for_bad_bytes():
    rng = random.Random(35)
    good = msgpack.packb(
        {"v": 2, "body": b"\x00" * 9, "tokens": [1, 2, 3], "label": "sys", "n": 1.5, "t": None},
        use_bin_type=True,
    )
    raised: set[type] = set()
    for i in range(4000):
        data = _mutations(rng, good) if i % 2 else bytes(rng.randrange(256) for _ in range(i % 40))
        for kw in ({"raw": False}, {"raw": False, "strict_map_key": False}):
            try:
                d = msgpack.unpackb(data, **kw)
                int(d["n"]), bytes(d["body"]), d["tokens"][0]  # as a reader takes fields
            except UNREADABLE as e:
                raised.add(type(e))
    assert raised  # the fuzz reached the error paths (any other type would have failed the test)


# As `grep -rn "except Exception\|except BaseException\|except:" kvstore client daemon` counts.
BROAD = re.compile(r"except (Exception|BaseException)|except:")
# Issue 35 (item 7) asks for at most 30; the two left are kvstore.degrade's own catch-alls.
MAX_BROAD = 2


def test_broad_handlers_stay_few():
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for folder in ("kvstore", "client", "daemon")
        for p in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if BROAD.search(line)
    ]
    assert len(found) <= MAX_BROAD, "broad handlers (route them through kvstore.degrade):\n" + (
        "\n".join(found)
    )
