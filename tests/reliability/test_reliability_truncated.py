"""A truncated data.mdb (a copy or restore cut short, a sync tool, a disk full during a backup):
mapped, the first read past its end is a SIGBUS. The store checks the file's length against its
meta pages before the map, so every entry point says one line and goes on (the app, serve) or
stops (the CLI, the daemon) instead of dying by a signal. Each entry point runs in a child
process: a death by a signal fails the test instead of ending pytest."""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import battery
import pytest
from helpers import TWO_PINS, Proc, manifest_for, wait_for

from kvstore.daemon import exits
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.lmdbenv import read_meta_page
from kvstore.store.store import Store

DAMAGED = "the store file is damaged"
HINT = "restore it from a backup, or move it aside"

# Opens each home read-only and for writing, reads every entry; one JSON line per home.
OPENER = r"""
import json, sys
from kvstore.errors import StoreError
from kvstore.store.store import Store
for home in json.loads(sys.argv[1]):
    out = {"home": home}
    for mode, readonly in (("read", True), ("write", False)):
        try:
            with Store(home, readonly=readonly) as store:
                out[mode] = {"ok": True, "problems": len(store.check()), "keys": len(store.keys())}
        except StoreError as e:
            out[mode] = {"ok": False, "error": str(e)}
    print(json.dumps(out), flush=True)
"""

APPS = {
    "load": "from kvstore.client import load\n"
    "_, _, cache = load(MODEL, home=HOME)\n"
    "print('entries', cache.report.entries)",
    "hydrate": "from mlx_lm.models.cache import LRUPromptCache\n"
    "from kvstore.client import hydrate\n"
    "print('entries', hydrate(LRUPromptCache(), 'm', MODEL, home=HOME).entries)",
    "PersistentPromptCache": "from mlx_lm import load\n"
    "from kvstore.client import PersistentPromptCache\n"
    "model, tok = load(MODEL)\n"
    "cache = PersistentPromptCache.open(model, tok, MODEL, home=HOME)\n"
    "print('entries', cache.report.entries)",
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory, llama_path):
    """A real store of more than a handful of pages: two warmed pins of the tiny llama and six
    other entries of 12 KiB. Returns its home, the page size and the length its header needs."""
    tmp = tmp_path_factory.mktemp("truncated")
    home = tmp / "home"
    with Store(home) as store:
        assert warm(load_manifest(manifest_for(tmp, llama_path, TWO_PINS)), store, home=home).warmed
        for seed in range(6):
            key, blob, fields = battery.entry(seed, 12 * 1024)
            store.put(key, blob, **fields)
    data = home / "store" / "data.mdb"
    with data.open("rb") as f:
        first = read_meta_page(f, 0)
        second = read_meta_page(f, first.page_size)
    meta = max(first, second, key=lambda m: m.txnid)
    need = (meta.last_pg + 1) * meta.page_size
    assert data.stat().st_size >= need and meta.last_pg > 20, meta
    return home, meta.page_size, need


def _cut(stored, where: Path, length: int) -> Path:
    """A copy of the stored home with its data.mdb cut to `length` bytes."""
    home, _, _ = stored
    shutil.copytree(home / "store", where / "store")
    with (where / "store" / "data.mdb").open("r+b") as f:
        f.truncate(length)
    return where


def _no_signal(name: str, rc: int, out: str) -> None:
    assert rc >= 0, f"{name}: killed by signal {-rc}:\n{out[-3000:]}"
    assert "Traceback" not in out, f"{name}:\n{out[-3000:]}"


def test_every_truncation_is_refused_before_the_map(tmp_path, stored):
    """Every page boundary, and random lengths: a read-only and a writing open either refuse the
    file in one line (it is shorter than its header says) or, at the full length, read every
    entry back intact."""
    home, page, need = stored
    rng = random.Random(21)
    lengths = sorted(
        {*range(page, need + 1, page), *(rng.randrange(1, need) for _ in range(12)), 200}
    )
    homes = {n: _cut(stored, tmp_path / f"at{n}", n) for n in lengths}
    t = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", OPENER, json.dumps([str(h) for h in homes.values()])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - t
    _no_signal("opener", p.returncode, p.stdout + p.stderr)
    assert p.returncode == 0, p.stderr
    results = {json.loads(line)["home"]: json.loads(line) for line in p.stdout.splitlines()}
    with Store(home, readonly=True) as store:
        keys = len(store.keys())
    for n, h in homes.items():
        r = results[str(h)]
        for mode in ("read", "write"):
            got = r[mode]
            if n >= need:
                assert got == {"ok": True, "problems": 0, "keys": keys}, (n, mode, got)
            else:
                assert not got["ok"], (n, mode, got)
                assert HINT in got["error"] and "\n" not in got["error"], (n, got)
                if n >= 2 * 152:  # the first meta page is whole: the length is what is wrong
                    assert f"{DAMAGED} (truncated): {n} bytes" in got["error"], (n, got)
    battery.record(
        "truncated_store",
        lengths=len(lengths),
        page_size=page,
        pages=need // page,
        refused=sum(n < need for n in lengths),
        opener_s=round(elapsed, 2),
    )


WRITER = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
import battery
from kvstore.store.store import Store
with Store(sys.argv[1]) as store:
    deadline, seed = time.monotonic() + float(sys.argv[3]), 100
    while time.monotonic() < deadline:  # every put grows the file: new pages, then the meta
        key, blob, fields = battery.entry(seed, 4096 * (1 + seed % 5))
        store.put(key, blob, **fields)
        seed += 1
print(seed - 100)
"""


def test_a_store_growing_under_a_writer_is_never_taken_for_a_short_one(tmp_path):
    """Thousands of opens beside a writer that grows the file: none is refused. (The length is
    read after the meta pages, so a commit between the two reads, pages first and then the meta
    that counts them, cannot look short; that window is too narrow for this test to hit.)"""
    home = tmp_path / "home"
    with Store(home) as store:
        store.put(*battery.entry(0, 4096)[:2], **battery.entry(0, 4096)[2])
    here = str(Path(__file__).parent)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(home), here, "3"], stdout=subprocess.PIPE, text=True
    )
    opens = 0
    try:
        while writer.poll() is None:
            with Store(home, readonly=True):  # a fresh environment: the check runs each time
                opens += 1
    finally:
        out, _ = writer.communicate(timeout=30)
    assert writer.returncode == 0
    assert int(out) > 20 and opens > 100, (out, opens)
    battery.record("truncated_store", opens_beside_writer=opens, writer_puts=int(out))


def _one_line(name: str, out: str) -> str:
    lines = [ln for ln in out.splitlines() if DAMAGED in ln]
    assert len(lines) == 1 and HINT in lines[0], f"{name}: {out[-3000:]}"
    return lines[0]


@pytest.mark.slow
def test_every_entry_point_says_one_line_on_a_truncated_store(tmp_path, stored, llama_path):
    """The app's three ways in warn once and prefill; ls, stats, verify and evict exit 1 with one
    line; the daemon refuses with the config status and keeps the file; serve comes up and
    answers /health. All in child processes, side by side."""
    _, page, need = stored
    points = [page + 100, (need // page // 2) * page, need - 1]
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}

    def start(name: str, argv: list[str]) -> None:
        log = tmp_path / f"{name}.log"
        with log.open("wb") as f:
            procs[name] = (
                subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path),
                log,
            )

    homes = {n: _cut(stored, tmp_path / f"at{n}", n) for n in points}
    for app, code in APPS.items():
        home = homes[points[1]]
        head = f"MODEL, HOME = {str(llama_path)!r}, {str(home)!r}\n"
        start(app, [sys.executable, "-c", head + code])
    for n, home in homes.items():
        for cmd in (["ls"], ["ls", "--learned"], ["stats"], ["verify"], ["evict", "--all"]):
            start(f"{'-'.join(cmd)}@{n}", [sys.executable, "-m", "kvstore", *cmd, "--home", home])
    daemon_home = _cut(stored, tmp_path / "daemon", points[1])
    daemon = Proc(daemon_home, log=tmp_path / "daemon.log")
    serve_home = _cut(stored, tmp_path / "serve", points[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve_log = tmp_path / "serve.log"
    with serve_log.open("wb") as f:
        serve = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--home", serve_home, "--model",
             llama_path, "--port", str(port)],
            stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        for name, (p, log) in procs.items():
            rc = p.wait(timeout=120)
            out = log.read_text()
            _no_signal(name, rc, out)
            line = _one_line(name, out)
            if name in APPS:
                assert rc == 0 and "entries 0" in out, (name, out)
                assert line.startswith("kvstore: not hydrating") and "prefilling as usual" in line
            else:
                assert rc == 1 and out.strip() == line and line.startswith("Error: "), (name, out)
        rc = daemon.p.wait(timeout=60)
        _no_signal("daemon", rc, daemon.text())
        assert rc == exits.CONFIG == exits.EXITS["store_damaged"].code, daemon.text()
        assert "cannot start" in _one_line("daemon", daemon.text())
        assert (daemon_home / "store" / "data.mdb").stat().st_size == points[1]  # kept as it was

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return r.status == 200
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False

        wait_for(healthy, 90, serve_log.read_text, proc=serve)
        wait_for(lambda: DAMAGED in serve_log.read_text(), 30, serve_log.read_text)
        out = serve_log.read_text()
        _no_signal("serve", 0, out)
        assert "prefilling as usual" in _one_line("serve", out)
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        if serve.poll() is None:
            serve.terminate()
            serve.wait(timeout=20)
        if daemon.p.poll() is None:
            daemon.p.kill()
            daemon.p.wait()
