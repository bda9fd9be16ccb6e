"""The prefill ledger on a full disk (issue 34 item 5): a failed append is one StoreError naming
the file and the space left, with its errno, and leaves no torn record behind. A real tmpfs that
fills up (the daemon's side: tests/daemon/test_daemon_disk_full.py)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
from full_disk import mounted_tmpfs

from kvstore.errors import StoreError
from kvstore.home.ledger import Ledger, validate

RECORD = {"model": "m", "label": "l", "prompt_tokens": 100, "cached_tokens": 90,
          "prefilled_tokens": 10, "prefill_s": 0.5, "decode_s": 0.25}  # fmt: skip


def fill(mnt: Path, leave: int = 0) -> Path:
    """A file that takes all of `mnt`'s space but `leave` bytes."""
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(mnt).free - leave))
        f.flush()
    assert shutil.disk_usage(mnt).free <= leave
    return filler


@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "tmpfs", "1m") as mnt:
        yield mnt


def test_an_append_on_a_full_disk_is_one_line_and_tears_nothing(small_tmpfs):
    home = small_tmpfs / "home"
    home.mkdir()
    ledger = Ledger(home)
    ledger.append(validate([RECORD] * 3))
    before = ledger.path.stat().st_size
    filler = fill(small_tmpfs)
    with pytest.raises(StoreError) as failed:
        ledger.append(validate([RECORD] * 2000))  # more than a page: a short write first
    e = failed.value
    assert e.errno == errno.ENOSPC
    text = str(e)
    assert "\n" not in text and str(ledger.path) in text, text
    assert "No space left on device" in text and "MiB free there" in text, text
    assert ledger.path.stat().st_size == before  # what a short write added is cut back off
    assert ledger.records == 3
    filler.unlink()
    ledger.append(validate([RECORD]))
    again = Ledger(home)
    assert again.records == 4  # the batch after the failure loads: no torn record before it
