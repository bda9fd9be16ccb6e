"""The prefill ledger: per-call stats that clients report, kept for `kvstore stats`.

The daemon appends; `kvstore stats` reads the same file when no daemon runs.

Records append to one msgpack stream in the home (a crash loses at most a torn tail, which is
skipped on load); the per model+label summary is rebuilt from it at start and kept in memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import msgpack

from kvstore.degrade import UNREADABLE
from kvstore.errors import StoreError
from kvstore.reasons import clean as clean_reasons

log = logging.getLogger("kvstore")

LEDGER_NAME = "ledger.msgpack"
FIELDS: dict[str, type | tuple[type, ...]] = {
    "model": str,
    "label": str,
    "prompt_tokens": int,
    "cached_tokens": int,
    "prefilled_tokens": int,
    "prefill_s": (int, float),
    "decode_s": (int, float),
}
OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "generated_tokens": int,
    "ts": (int, float),
    "fleet_tokens": int,  # of cached_tokens, read through from the fleet (kvstore.fleet.reads)
}
SUMMED = ("prompt_tokens", "cached_tokens", "prefilled_tokens", "generated_tokens", "prefill_s",
          "decode_s")  # fmt: skip
MAX_BATCH = 10_000  # records per request


def validate(records: Any) -> list[dict[str, Any]]:
    """A batch as sent by a client; raises ValueError naming the first bad record or field."""
    if not isinstance(records, list) or len(records) > MAX_BATCH:
        raise ValueError(f"records must be a list of at most {MAX_BATCH} maps")
    out = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"record {i} is not a map")
        for name, kind in FIELDS.items():
            v = r.get(name)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise ValueError(f"record {i}: field {name!r} missing or not {kind}")
        rec = {name: r[name] for name in FIELDS}
        for name, kind in OPTIONAL.items():  # kept when well-typed; anything else is dropped
            if isinstance(r.get(name), kind) and not isinstance(r[name], bool):
                rec[name] = r[name]
        reasons = clean_reasons(r.get("reasons"))  # why its prefilled tokens were (older: none)
        if reasons is not None:
            rec["reasons"] = reasons
        out.append(rec)
    return out


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a short write would tear a record: write the rest
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(0, "write made no progress")
        view = view[n:]


class Ledger:
    def __init__(self, home: Path):
        self.path = home / LEDGER_NAME
        self.summary: dict[tuple[str, str], dict[str, float]] = {}
        self.records = 0
        if self.path.is_file():
            self._load()

    def _load(self) -> None:
        unpacker = msgpack.Unpacker(raw=False)
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 20):
                unpacker.feed(chunk)
                try:
                    for rec in unpacker:
                        if isinstance(rec, dict):
                            self._add(rec)
                except UNREADABLE as e:  # a torn or foreign tail: keep what parsed
                    log.warning("ledger %s: unreadable tail skipped (%s)", self.path, e)
                    return

    def _add(self, rec: dict[str, Any]) -> None:
        try:
            key = (rec["model"], rec["label"])
            s = self.summary.setdefault(key, dict.fromkeys(("calls", *SUMMED), 0))
            s["calls"] += 1
            for name in SUMMED:
                s[name] += rec.get(name, 0)
            self.records += 1
        except (KeyError, TypeError):
            pass

    def append(self, records: list[dict[str, Any]]) -> int:
        """Persist a validated batch (one write, then fsync) and fold it into the summary. A
        failed write (a full disk) is cut back off, so the records after it still load, and
        raised as one StoreError naming the file, the error and the space left (`errno` kept)."""
        data = b"".join(msgpack.packb(r, use_bin_type=True) for r in records)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as e:
            raise self._failed(e) from None
        try:
            size = os.fstat(fd).st_size
            try:
                _write_all(fd, data)
                os.fsync(fd)
            except OSError as e:
                with contextlib.suppress(OSError):  # no torn record before the next batch
                    os.ftruncate(fd, size)
                raise self._failed(e) from None
        finally:
            os.close(fd)
        for r in records:
            self._add(r)
        return len(records)

    def _failed(self, e: OSError) -> StoreError:
        try:
            free = f"; {shutil.disk_usage(self.path.parent).free // 2**20} MiB free there"
        except OSError:
            free = ""
        return StoreError(
            f"{self.path}: prefill stats not recorded: {e.strerror or e}{free}", errno=e.errno
        )

    def stats(self) -> dict[str, Any]:
        rows = []
        for (model, label), s in sorted(self.summary.items()):
            prompt = s["prompt_tokens"]
            rows.append(
                {
                    "model": model,
                    "label": label,
                    **s,
                    "cached_ratio": s["cached_tokens"] / prompt if prompt else 0.0,
                    # seconds saved, estimated at this label's own measured prefill rate
                    "saved_s": s["cached_tokens"] * s["prefill_s"] / s["prefilled_tokens"]
                    if s["prefilled_tokens"]
                    else 0.0,
                }
            )
        return {"records": self.records, "by_model_label": rows}
