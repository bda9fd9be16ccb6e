"""Limits and collisions: reader slots exhausted, the map full at its cap, the disk full (a file
size limit, and a small tmpfs where one can be mounted), and every prefix hashed to one key.

Each limit is hit through a real daemon: the request that hits it gets a clear error, the daemon
keeps serving, the store stays readable, and nothing acknowledged is lost.
"""

from __future__ import annotations

import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import battery
import pytest
from full_disk import mounted_tmpfs
from helpers import Proc

from kvstore.errors import DaemonError, StoreError
from kvstore.ops import put as put_ops
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store
from kvstore.wire.daemon_client import DaemonClient

MiB = 2**20


def _daemon(tmp: Path, home: Path, settings: str = "", **kw) -> Proc:
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    (home / "settings.toml").write_text(settings)
    d = Proc(home, log=tmp / f"{home.name}.log", **kw)
    d.wait_ready()
    return d


def _fill(home: Path, size: int, limit: int = 400) -> tuple[list[bytes], str]:
    """Put entries through the daemon until one is refused: (acknowledged keys, the error)."""
    acked = []
    with DaemonClient(home) as c:
        for seed in range(limit):
            key, blob, fields = battery.entry(seed, size)
            try:
                put_ops.send(c, key, blob, fields)
            except DaemonError as e:
                return acked, str(e)
            acked.append(key)
    raise AssertionError(f"{limit} puts of {size} bytes were all accepted")


def _still_serving(d: Proc, acked: list[bytes]) -> dict:
    """After the limit: ping, ls and a second refused put answer; the store checks clean and
    holds every acknowledged entry."""
    t = time.monotonic()
    assert d.request("ping")["pid"] == d.pid
    listed = {e["key"] for e in d.request("ls")}
    assert {k.hex() for k in acked} <= listed
    with Store(d.home, readonly=True) as store:
        problems = store.check()
        missing = [why for k in acked if (why := battery.verify_key(store, k))]
    assert not problems and not missing, (problems, missing)
    return {"served_after_ms": round(1000 * (time.monotonic() - t), 1)}


def _cleared_slots(log: str) -> int:
    """Stale reader slots the daemon's reader_check passes have cleared so far, all together."""
    return sum(int(n) for n in re.findall(r"reader_check: cleared (\d+) stale reader slot", log))


def test_reader_slots_exhausted_then_freed_by_the_daemons_reader_check(tmp_path):
    home = tmp_path / "slots"
    home.mkdir(mode=0o700)
    # The first process to open the environment sizes the reader table; the daemon adopts it.
    first = Store(home, max_readers=4)
    try:
        acked = [first.put(*battery.entry(s, 8192)[:2], **battery.entry(s, 8192)[2]).key
                 for s in range(5)]  # fmt: skip
        d = _daemon(tmp_path, home, "reader_check_interval = 0.3\n")
        holders = []
        try:
            for i in range(4):
                ready = tmp_path / f"hold-{i}"
                p = subprocess.Popen(
                    [sys.executable, battery.__file__, "hold", str(home), str(ready)],
                    stderr=subprocess.DEVNULL,
                )
                holders.append(p)
                while not ready.exists():
                    assert p.poll() is None
                    time.sleep(0.02)
            with pytest.raises(DaemonError, match="reader slots are in use"):
                d.request("ls")
            with pytest.raises(StoreError, match="reader slots are in use"):
                first.metas()
            assert d.request("ping")["pid"] == d.pid
            for p in holders:  # die holding their slots
                p.send_signal(signal.SIGKILL)
                p.wait()
            t = time.monotonic()
            # A reader_check may run between two kills: the four are cleared over its passes.
            while (cleared := _cleared_slots(d.text())) < 4:
                assert time.monotonic() < t + 10, f"{cleared} of 4 slots cleared:\n{d.text()}"
                time.sleep(0.05)
            cleared_after = time.monotonic() - t
            assert cleared == 4, d.text()
            extra = _still_serving(d, acked)
        finally:
            for p in holders:
                p.kill()
                p.wait()
            assert d.stop()[0] == 0, d.text()
    finally:
        first.close()
    battery.record(
        "4_limits_reader_slots",
        max_readers=4,
        held_by_live_readers=4,
        ls_refused_clearly=True,
        cleared_by_daemon_reader_check=4,
        cleared_within_s=round(cleared_after, 2),
        acknowledged_missing=0,
        **extra,
    )


def test_map_full_at_its_cap(tmp_path):
    home = tmp_path / "map"
    d = _daemon(tmp_path, home, f"map_size = {1 * MiB}\nmax_map_size = {4 * MiB}\n")
    try:
        acked, error = _fill(home, 256 * 1024)
        assert "map is full" in error and "max_map_size" in error, error
        map_size = d.request("stats")["map_size"]
        extra = _still_serving(d, acked)
        d.request("evict", keys=acked[:4])  # room again: writes resume without a restart
        # LMDB reuses pages freed by a transaction only from the second write after it on.
        d.request("touch", keys=acked[4:5])
        with DaemonClient(home) as c:
            put_ops.send(c, *battery.entry(10_000, 256 * 1024))
    finally:
        assert d.stop()[0] == 0, d.text()
    battery.record(
        "4_limits_map_full",
        initial_map=1 * MiB,
        cap=4 * MiB,
        grown_to=map_size,
        acknowledged=len(acked),
        error=error.split("store: ", 1)[-1][:200],
        acknowledged_missing=0,
        writes_after_evict=True,
        **extra,
    )
    assert map_size == 4 * MiB


def _fsize_limit(limit: int):
    def preexec() -> None:  # in the daemon child, before exec; Python ignores SIGXFSZ itself
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def test_disk_full_by_file_size_limit(tmp_path):
    home = tmp_path / "fsize"
    limit = 6 * MiB
    d = _daemon(tmp_path, home, preexec_fn=_fsize_limit(limit))
    try:
        acked, error = _fill(home, 256 * 1024)
        assert "write failed" in error and "file size limit 6291456" in error, error
        extra = _still_serving(d, acked)
        with pytest.raises(DaemonError, match="write failed"):  # and again, still clearly
            with DaemonClient(home) as c:
                put_ops.send(c, *battery.entry(10_000, 256 * 1024))
    finally:
        assert d.stop()[0] == 0, d.text()
    battery.record(
        "4_limits_fsize",
        rlimit_fsize=limit,
        acknowledged=len(acked),
        error=error.split("store: ", 1)[-1][:200],
        acknowledged_missing=0,
        **extra,
    )


@pytest.fixture
def tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "tmpfs", "8m") as mnt:
        yield mnt


def test_disk_full_on_a_small_tmpfs(tmp_path, tmpfs):
    home = tmpfs / "home"
    d = _daemon(tmp_path, home)
    try:
        acked, error = _fill(home, 256 * 1024)
        assert "write failed" in error and "disk full" in error, error
        extra = _still_serving(d, acked)
    finally:
        assert d.stop()[0] == 0, d.text()
    battery.record(
        "4_limits_tmpfs",
        tmpfs_bytes=8 * MiB,
        acknowledged=len(acked),
        error=error.split("store: ", 1)[-1][:200],
        acknowledged_missing=0,
        **extra,
    )


def test_an_evict_after_a_full_disk_makes_room_for_the_next_put(tmp_path):
    """Issue 43 item 4, through a real daemon on a 3 MiB tmpfs: after the disk fills, `evict
    --label` of one entry lets the same entry be put again at the first try (before, every
    retry said "disk full" until `evict --all`), and the evict leaves no temporary file."""
    with mounted_tmpfs(tmp_path / "small", "3m") as mnt:
        home = mnt / "home"
        d = _daemon(tmp_path, home)
        try:
            acked, error = _fill(home, 600 * 1024)
            assert "disk full" in error and len(acked) >= 2, error
            assert d.request("evict", label="r1")["evicted"] == 1
            key, blob, fields = battery.entry(1, 600 * 1024)
            with DaemonClient(home) as c:
                put_ops.send(c, key, blob, fields)  # the first try
            _still_serving(d, acked)
            assert not list(home.glob("*.tmp")), sorted(p.name for p in home.iterdir())
        finally:
            assert d.stop()[0] == 0, d.text()


def test_every_prefix_hashed_to_one_key_gives_no_wrong_hit(tmp_path, llama_path):
    """Stored token ids are compared on every hit: a collision costs a miss, never wrong KV."""
    from mlx_lm.models.cache import LRUPromptCache

    from kvstore.client import hydrate
    from kvstore.identity.fingerprint import model_fingerprint

    n = 100
    home = tmp_path / "collide"
    fp = model_fingerprint(llama_path).digest
    # none a prefix of another, every id inside the tiny model's vocabulary (512): hydrate checks
    prefixes = [[400 + i, *range(i % 7 + 3)] for i in range(n)]
    wrong = right = lookups = 0
    with mock.patch("kvstore.store.entry.packed_prefix_hash", return_value=b"\x00" * 16):
        keys = {entry_key(fp, p) for p in prefixes}
        assert len(keys) == 1  # the patch took: every prefix lands on one key
        (key,) = keys
        with Store(home) as store:
            for i, tokens in enumerate(prefixes):
                _, blob, fields = battery.entry(tokens[0], 4096, tokens=tokens)  # seed = 1st token
                store.put(key, blob, **fields)
                for j in range(i + 1):  # every prefix so far, looked up by its own tokens
                    lookups += 1
                    try:
                        meta, cache = store.load(key, pack_tokens(prefixes[j]))
                    except KeyError:
                        continue
                    ok = j == i and battery.verify_loaded(meta, cache) is None
                    right += ok
                    wrong += not ok
        lru = LRUPromptCache(max_size=200)
        report = hydrate(lru, "m", llama_path, home=home)
        hits = [lru.fetch_nearest_cache("m", p + [5])[0] is not None for p in prefixes]
    wrong += sum(hits[:-1])  # only the last prefix written may be served
    battery.record(
        "5_collisions",
        prefixes=n,
        store_lookups=lookups,
        right_hits=right,
        wrong_hits=wrong,
        hydrated=report.entries,
        lru_hits=sum(hits),
    )
    assert wrong == 0 and right == n and report.entries == 1 and hits[-1]
