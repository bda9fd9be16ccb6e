"""Concurrency and dead readers: reader processes on LMDB directly while socket clients write
through the daemon; readers SIGKILLed inside read transactions and what reader_check does."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import battery
from helpers import Proc, wait_for

from kvstore.ops import put as put_ops
from kvstore.store.store import Store
from kvstore.wire.daemon_client import DaemonClient

BATTERY = Path(battery.__file__)


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(BATTERY), *args], stderr=subprocess.PIPE)


def test_readers_and_socket_clients_against_overwrites(tmp_path):
    writes = battery.scale(600, 2000)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    # A 1 MiB initial map: the daemon grows it several times while readers and `ls` run.
    (home / "settings.toml").write_text("map_size = 1048576\n")
    d = Proc(home, log=tmp_path / "daemon.log")
    d.wait_ready()
    stop = tmp_path / "stop"
    readers = [
        _spawn("reader", str(home), str(stop), str(tmp_path / f"r{i}.json")) for i in range(4)
    ]
    for i, r in enumerate(readers):
        wait_for((tmp_path / f"r{i}.json.ready").exists, what=f"reader {i}", proc=r)
    latest: dict[bytes, int] = {}  # key -> last acknowledged version
    errors: list[str] = []
    ls_calls = [0]
    lock = threading.Lock()

    def client(n: int) -> None:
        rng = random.Random(n)
        try:
            with DaemonClient(home, timeout=60) as c:
                for i in range(writes // 2):
                    seed = 2 * rng.randrange(24) + n  # each client owns its keys
                    key, blob, fields = battery.entry(
                        seed, rng.randint(4096, 256 * 1024), version=i + 1
                    )
                    put_ops.send(c, key, blob, fields)
                    with lock:
                        latest[key] = i + 1
                    if i % 10 == n:
                        listed = c.raw("ls")
                        ls_calls[0] += 1
                        bad = [e for e in listed if e["tokens"] != 2 or e["nbytes"] <= 0]
                        assert not bad, bad
        except Exception as e:  # every exception here is unexpected
            errors.append(f"client {n}: {type(e).__name__}: {e}")

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    stop.write_text("")
    counts = []
    for i, r in enumerate(readers):
        _, err = r.communicate(timeout=60)
        assert r.returncode == 0, err.decode()[-2000:]
        counts.append(json.loads((tmp_path / f"r{i}.json").read_text()))
    map_size = d.request("stats")["map_size"]
    assert d.stop()[0] == 0, d.text()
    with Store(home, readonly=True) as store:
        final = [why for k in latest if (why := battery.verify_key(store, k))]
        stale = [
            k.hex() for k, v in latest.items() if store.get_meta(k).extra.to_map()["version"] != v
        ]
        problems = store.check()
    battery.record(
        "2_concurrency",
        writes=writes,
        socket_clients=2,
        ls_calls=ls_calls[0],
        reader_processes=4,
        reader_loads=sum(c["reads"] for c in counts),
        reader_scans=sum(c["scans"] for c in counts),
        torn_or_mismatched=sum(c["mismatches"] for c in counts) + len(final) + len(stale),
        unexpected_exceptions=sum(c["errors"] for c in counts) + len(errors),
        map_grown_to=map_size,
        writes_per_second=round(writes / seconds, 1),
        seconds=round(seconds, 1),
    )
    assert not errors, errors
    assert all(c["mismatches"] == 0 and c["errors"] == 0 for c in counts), counts
    assert all(c["reads"] > 0 for c in counts), counts
    assert not final and not stale and not problems
    assert map_size > 1048576, "the map should have grown while readers ran"


def _stale_slots(store: Store) -> tuple[int, int]:
    """(slots held by dead processes, all slots) from env.readers()."""
    dead = used = 0
    for line in store.env.readers().splitlines()[1:]:
        fields = line.split()
        if not fields or not fields[0].isdigit():
            continue
        used += 1
        try:
            os.kill(int(fields[0]), 0)
        except ProcessLookupError:
            dead += 1
    return dead, used


def _overwrite_rounds(store: Store, rounds: int, n_keys: int, size: int, *, check: bool) -> int:
    """Overwrite every key `rounds` times (new versions); the file size afterwards."""
    version = 1000
    for _ in range(rounds):
        version += 1
        for seed in range(n_keys):
            key, blob, fields = battery.entry(seed, size, version=version)
            store.put(key, blob, **fields)
        if check:
            store.reader_check()  # what the daemon does every reader_check_interval
    return (store.path / "data.mdb").stat().st_size


def _kill_holders(home: Path, tmp: Path, n: int) -> None:
    procs = []
    for i in range(n):
        ready = tmp / f"hold-{home.name}-{i}"
        procs.append((_spawn("hold", str(home), str(ready)), ready))
    for p, ready in procs:
        wait_for(ready.exists, what=lambda p=p: p.stderr.read().decode()[-2000:], proc=p)
    for p, _ in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stderr.close()


def test_dead_readers_are_cleared_and_the_file_stays_bounded(tmp_path):
    rounds = battery.scale(8, 40)
    n_keys, size, holders = 32, 256 * 1024, 6
    results = {}
    for mode in ("reader_check", "never_checked"):
        home = tmp_path / mode
        with Store(home) as store:
            _overwrite_rounds(store, 1, n_keys, size, check=False)
            live = sum(m.nbytes for m in store.metas())
            _kill_holders(home, tmp_path, holders)
            before = _stale_slots(store)
            cleared = store.reader_check() if mode == "reader_check" else 0
            after = _stale_slots(store)
            start = (store.path / "data.mdb").stat().st_size
            end = _overwrite_rounds(store, rounds, n_keys, size, check=mode == "reader_check")
            assert not store.check()
        results[mode] = dict(
            stale_slots_before=before[0],
            cleared=cleared,
            stale_slots_after=after[0],
            live_bytes=live,
            file_bytes_start=start,
            file_bytes_end=end,
            ratio=round(end / live, 2),
        )
    ok, bad = results["reader_check"], results["never_checked"]
    battery.record(
        "3_dead_readers",
        killed_readers=holders,
        overwrite_rounds=rounds,
        overwritten_bytes=rounds * n_keys * size,
        stale_slots_before=ok["stale_slots_before"],
        reader_check_cleared=ok["cleared"],
        stale_slots_after=ok["stale_slots_after"],
        file_to_live_ratio=ok["ratio"],
        file_to_live_ratio_without_reader_check=bad["ratio"],
        detail=results,
    )
    assert ok["stale_slots_before"] == holders and ok["cleared"] == holders
    assert ok["stale_slots_after"] == 0
    assert ok["file_bytes_end"] <= 2 * ok["live_bytes"], ok
    # The contrast: a dead reader pins its snapshot, so every overwrite takes fresh pages.
    assert bad["stale_slots_after"] == holders and bad["file_bytes_end"] > ok["file_bytes_end"]
