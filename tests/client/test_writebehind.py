"""The write-behind's warnings (issue 43 item 4): a daemon that refuses every prefill-stats batch
for one reason (its disk is full) is one warning, not one per batch; once a batch goes through,
the same refusal is news again."""

from __future__ import annotations

import logging
import shutil

import pytest
from full_disk import mounted_tmpfs
from helpers import Proc

from kvstore.client.writebehind import Job, WriteBehind
from kvstore.wire.messages import RecordRequest

pytestmark = pytest.mark.slow

RECORD = {"model": "m", "label": "l", "prompt_tokens": 100, "cached_tokens": 90,
          "prefilled_tokens": 10, "prefill_s": 0.5, "decode_s": 0.25}  # fmt: skip


def _batches(writer: WriteBehind, sizes: list[int]) -> None:
    for n in sizes:
        batch = [RECORD] * n
        assert writer.submit(
            Job(f"{n} prefill stats records", lambda c, b=batch: c.send(RecordRequest(b)))
        )
        assert writer.flush()


def test_a_refusal_repeated_by_every_batch_is_one_warning(tmp_path, caplog):
    with mounted_tmpfs(tmp_path / "fs", "16m") as mnt:
        home = mnt / "home"
        d = Proc(home, log=tmp_path / "d.log")
        writer = None
        try:
            d.wait_ready()
            writer = WriteBehind(home)
            _batches(writer, [1])  # the ledger file exists
            with (mnt / "filler").open("wb") as f:
                f.write(b"\0" * shutil.disk_usage(mnt).free)
            caplog.set_level(logging.WARNING, logger="kvstore.client")
            _batches(writer, [2000, 3000, 2500, 2000, 4000, 2200])
            refused = [r.getMessage() for r in caplog.records if "could not send" in r.getMessage()]
            assert len(refused) == 1 and "No space left on device" in refused[0], refused
            assert writer.failed == 6
            (mnt / "filler").unlink()
            _batches(writer, [1])  # goes through: a later refusal is said again
            with (mnt / "filler").open("wb") as f:
                f.write(b"\0" * shutil.disk_usage(mnt).free)
            _batches(writer, [2000, 3000])
            refused = [r.getMessage() for r in caplog.records if "could not send" in r.getMessage()]
            assert len(refused) == 2, refused
        finally:
            if writer is not None:
                writer.close()
            rc, _ = d.stop()
        assert rc == 0, d.text()
