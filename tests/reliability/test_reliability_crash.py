"""Crash battery: kill -9 a writer process at random moments while it writes 4 KB - 4 MB entries,
and kill -9 the daemon with puts in flight. Afterwards the store checks clean and every
acknowledged write is there with the content its key derives.

The writer is forked from this process (mlx never runs in it: the blobs are built with numpy), so
a trial costs milliseconds, not an interpreter start. It logs each key after `put` returns, with
an fsync, so the log is exactly the set of acknowledged writes.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import battery
from helpers import Proc

from kvstore.ops import put as put_ops
from kvstore.store import lmdbenv as store_mod
from kvstore.store.store import Store
from kvstore.wire.daemon_client import DaemonClient

MIN_BYTES, MAX_BYTES = 4 * 1024, 4 * 1024 * 1024


def _size(rng: random.Random) -> int:
    return int(MIN_BYTES * (MAX_BYTES / MIN_BYTES) ** rng.random())  # log-uniform 4 KB..4 MB


def _writer(home, log_path, seed0: int, rng_seed: int) -> None:
    """The forked child: write entries until killed. Never returns."""
    code = 0
    try:
        rng = random.Random(rng_seed)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        store = Store(home)
        for i in range(100_000):
            key, blob, fields = battery.entry(seed0 + i, _size(rng))
            os.write(fd, f"B {key.hex()}\n".encode())
            store.put(key, blob, **fields)
            os.write(fd, f"A {key.hex()}\n".encode())
            os.fsync(fd)  # acknowledged only once this is on disk
    except BaseException:
        code = 3
    os._exit(code)


def _read_log(path) -> tuple[list[bytes], bytes | None]:
    """Acknowledged keys, and the key whose put was in flight when the writer died."""
    acked, in_flight = [], None
    if not path.exists():
        return acked, in_flight
    for line in path.read_text().splitlines():
        kind, _, hexkey = line.partition(" ")
        if len(hexkey) != 64:
            continue  # a torn last line: the kill landed inside the log write
        if kind == "A":
            acked.append(bytes.fromhex(hexkey))
            in_flight = None
        else:
            in_flight = bytes.fromhex(hexkey)
    return acked, in_flight


def test_kill_9_writer_at_random_moments(tmp_path):
    trials = battery.scale(30, 200)
    home = tmp_path / "home"
    rng = random.Random(20260601)
    assert not store_mod.ENVS, "an environment open at fork would be shared with the child"
    kept: list[bytes] = []  # acknowledged keys still in the store, checked again at the end
    acked_count = 0
    killed_mid_put = committed_unacked = missing = problems_seen = 0
    examples: list[str] = []
    t0 = time.monotonic()
    for trial in range(trials):
        log_path = tmp_path / f"writer-{trial}.log"
        pid = os.fork()
        if pid == 0:
            _writer(home, log_path, seed0=trial * 100_000, rng_seed=trial)
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), f"trial {trial}: writer exited {status} before the kill"
        acked, in_flight = _read_log(log_path)
        acked_count += len(acked)
        if not (home / "store" / "data.mdb").exists():
            assert not acked
            continue
        with Store(home) as store:  # opening runs reader_check, as the next writer would
            for key in acked:
                if why := battery.verify_key(store, key):
                    missing += 1
                    examples.append(f"trial {trial}: {why}")
            if in_flight is not None:
                killed_mid_put += 1
                committed_unacked += store.get_meta(in_flight) is not None
            problems = store.check(decode=False)  # checksums and meta/blob pairs, every trial
            problems_seen += len(problems)
            examples += [f"trial {trial}: {p}" for p in problems[:3]]
            # Keep two entries a trial and free the rest: the store stays small, and the next
            # writer dies while reusing freed pages too, not only while growing the file.
            kept += acked[:2]
            store.delete(acked[2:])
        assert not store_mod.ENVS
    with Store(home) as store:
        final = store.check()  # the full decode of everything, once
        stats = store.stats()
        for key in kept:
            if why := battery.verify_key(store, key):
                missing += 1
                examples.append(f"final: {why}")
    battery.record(
        "1_crash_writer",
        trials=trials,
        acknowledged_writes=acked_count,
        killed_mid_put=killed_mid_put,
        in_flight_put_committed_anyway=committed_unacked,
        checksum_or_pairing_failures=problems_seen + len(final),
        acknowledged_missing_or_wrong=missing,
        entries=stats["entries"],
        stored_bytes=stats["bytes"],
        file_bytes=stats["file_bytes"],
        seconds=round(time.monotonic() - t0, 1),
    )
    assert not examples and not final, (examples[:10], final[:5])
    assert killed_mid_put >= trials // 4, "the kills should often land inside a put"


def test_kill_9_daemon_with_puts_in_flight(tmp_path):
    trials = battery.scale(4, 40)
    home = tmp_path / "home"
    rng = random.Random(7)
    acked: list[bytes] = []
    in_flight_at_kill = takeovers = 0
    lock = threading.Lock()
    t0 = time.monotonic()
    for trial in range(trials):
        d = Proc(home, log=tmp_path / "daemon.log")
        d.wait_ready()
        takeovers += trial > 0  # each restart binds over the socket the killed one left
        stop = threading.Event()
        sent = [0, 0]

        def client(n: int, trial: int = trial, sent: list = sent, stop=stop) -> None:
            crng = random.Random(trial * 10 + n)
            try:
                with DaemonClient(home, timeout=10) as c:
                    for i in range(100_000):
                        if stop.is_set():
                            return
                        key, blob, fields = battery.entry(
                            1_000_000 * (trial + 1) + 1000 * n + i, _size(crng)
                        )
                        sent[n] += 1
                        put_ops.send(c, key, blob, fields)
                        sent[n] -= 1
                        with lock:
                            acked.append(key)
            except (OSError, Exception):
                return  # the daemon died under us: expected

        threads = [threading.Thread(target=client, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.2, 0.8))
        d.p.send_signal(signal.SIGKILL)
        d.p.wait()
        stop.set()
        for t in threads:
            t.join(30)
        in_flight_at_kill += sum(sent)
    with Store(home) as store:
        problems = store.check()
        missing = [why for k in acked if (why := battery.verify_key(store, k))]
        entries = store.stats()["entries"]
    battery.record(
        "1_crash_daemon",
        trials=trials,
        acknowledged_puts=len(acked),
        puts_in_flight_at_kill=in_flight_at_kill,
        socket_takeovers=takeovers,
        checksum_or_pairing_failures=len(problems),
        acknowledged_missing_or_wrong=len(missing),
        entries=entries,
        seconds=round(time.monotonic() - t0, 1),
    )
    assert not problems and not missing, (problems[:5], missing[:5])
    assert acked and in_flight_at_kill >= 1
