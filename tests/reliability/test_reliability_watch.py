"""Watching, at the daemon level: one reconcile pass per atomic save, at most two per burst, a
deleted model directory, and an observer that cannot start. Then the client's promise: with the
daemon down, the store corrupt or the home unusable, an app's output does not change and it gets
exactly one warning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import battery
from helpers import Proc, manifest_for, wait_for

DEBOUNCE = 0.3
QUIET = 2.0  # seconds without a new pass before counting

PIN = '[[model.prefix]]\nname = "classify"\nfile = "prompt.md"\n'


def _passes(d: Proc) -> int:
    """Reconcile passes the watcher caused (one `warm ... (files changed` line each)."""
    return d.text().count("(files changed:")


def _settle(d: Proc, at_least: int, timeout: float = 60) -> int:
    wait_for(lambda: _passes(d) >= at_least, timeout, lambda: d.text()[-3000:])
    while True:  # then wait until no new pass for QUIET seconds
        n = _passes(d)
        time.sleep(QUIET)
        if _passes(d) == n and "done in" in d.text().rsplit("(files changed:", 1)[-1]:
            return n


def _setup(tmp: Path, llama_path: Path, settings: str) -> tuple[Path, Path, Path]:
    model = tmp / "model"
    shutil.copytree(llama_path, model)
    prompt = tmp / "prompt.md"
    prompt.write_text("You are the router. Classify the request.")
    manifest = manifest_for(tmp, model, PIN)
    home = tmp / "home"
    home.mkdir(mode=0o700)
    (home / "settings.toml").write_text(settings)
    return home, manifest, prompt


def _save_by_rename(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_watcher_passes_and_a_deleted_model(tmp_path, llama_path):
    from mlx_lm.models.cache import LRUPromptCache

    from kvstore.client import hydrate

    home, manifest, prompt = _setup(tmp_path, llama_path, f"debounce = {DEBOUNCE}\n")
    d = Proc(home, "--manifest", str(manifest), log=tmp_path / "daemon.log")
    try:
        d.wait_ready()
        d.wait_warm()
        assert d.request("stats")["daemon"]["watcher"] == "watchdog"
        _save_by_rename(prompt, "You are the router. Classify the request, briefly.")
        after_rename = _settle(d, 1)
        for i in range(50):
            prompt.write_text(f"You are the router, edit {i}.")
        after_burst = _settle(d, after_rename + 1) - after_rename
        labels = [e["label"] for e in d.request("ls")]
        assert labels == ["classify"]  # the old pins were purged, the new one warmed

        shutil.rmtree(tmp_path / "model")
        _settle(d, after_rename + after_burst + 1)
        last = d.request("stats")["daemon"]["last_warm"]
        lru = LRUPromptCache()
        report = hydrate(lru, "m", tmp_path / "model", home=home)
        evicted = d.request("evict", stale=True)["evicted"]
        left = d.request("ls")
    finally:
        assert d.stop()[0] == 0, d.text()[-3000:]
    battery.record(
        "9_watch",
        passes_for_one_atomic_save=after_rename,
        passes_for_50_rapid_edits=after_burst,
        deleted_model_pass_failed_pins=last["failed"],
        deleted_model_hydrated=report.entries,
        deleted_model_warning=bool(report.warning),
        evicted_as_stale=evicted,
        entries_left=len(left),
    )
    assert after_rename == 1 and 1 <= after_burst <= 2
    assert last["failed"] == 1 and report.entries == 0 and report.warning
    assert evicted == 1 and left == []


OBSERVER_FAILS = r"""
import errno, sys
from pathlib import Path
from unittest import mock

import kvstore.daemon.watcher
from kvstore.daemon.boot import run
from kvstore.daemon.logs import setup_logging

setup_logging("info")
# The real call that fails when inotify runs out of watches (or FSEvents is refused).
fail = OSError(errno.ENOSPC, "inotify watch limit reached")
with mock.patch.object(kvstore.daemon.watcher.Observer, "start", side_effect=fail):
    sys.exit(run(Path(sys.argv[2]), manifest=Path(sys.argv[4])))
"""


def test_an_observer_that_cannot_start_falls_back_to_polling(tmp_path, llama_path):
    home, manifest, prompt = _setup(
        tmp_path, llama_path, f"debounce = {DEBOUNCE}\npoll_interval = 0.5\n"
    )
    d = Proc(home, "--manifest", str(manifest), log=tmp_path / "daemon.log", code=OBSERVER_FAILS)
    try:
        d.wait_ready()
        d.wait_warm()
        assert d.request("stats")["daemon"]["watcher"] == "polling"
        d.wait_log("file events unavailable")
        t = time.monotonic()
        _save_by_rename(prompt, "You are the router. Polling noticed this.")
        passes = _settle(d, 1)
        noticed = time.monotonic() - t - QUIET
        assert d.request("ping")["pid"] == d.pid
    finally:
        assert d.stop()[0] == 0, d.text()[-3000:]
    battery.record(
        "9_watch_fallback",
        observer_start_failed=True,
        mode="polling",
        passes_for_one_save=passes,
        noticed_within_s=round(noticed, 2),
    )
    assert passes == 1


# -- never a hard dependency ---------------------------------------------------------------------

APP = r"""
import json, logging, sys
from mlx_lm import load, generate
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

model_path, home, use_store = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
model, tok = load(model_path)
prompt = tok.apply_chat_template(json.loads(sys.argv[4]), add_generation_prompt=True)
lru = LRUPromptCache()
entries = 0
if use_store:
    from kvstore.client import hydrate
    entries = hydrate(lru, model_path, model_path, home=home, model=model).entries
cache, rest = lru.fetch_nearest_cache(model_path, prompt)
if cache is None:
    cache, rest = make_prompt_cache(model), prompt
text = generate(model, tok, rest, max_tokens=12, prompt_cache=cache)
print(json.dumps({"text": text, "entries": entries, "prefilled": len(rest)}))
"""


def _scenarios(tmp: Path, llama_path: Path) -> dict[str, Path]:
    """Homes in each bad state (and a healthy one whose daemon is down)."""
    from helpers import TWO_PINS, manifest_for

    from kvstore.ops.warm import warm
    from kvstore.pins.manifest import load_manifest
    from kvstore.store.store import Store

    homes = {}
    healthy = tmp / "healthy"
    with Store(healthy) as store:
        warm(load_manifest(manifest_for(tmp, llama_path, TWO_PINS)), store, home=healthy)
    (healthy / "kvstore.sock").touch()  # what a killed daemon leaves: nobody listens
    homes["daemon_down_store_ok"] = healthy
    homes["daemon_down_no_store"] = tmp / "empty"
    homes["daemon_down_no_store"].mkdir()
    bad_entry = tmp / "bad-entry"
    shutil.copytree(healthy, bad_entry)
    with Store(bad_entry) as store:
        key = store.keys()[0]
        blob = bytearray(store.read_blob(key))
        blob[len(blob) // 2] ^= 0x40
        with store.env.begin(write=True) as txn:
            txn.put(key, bytes(blob), db=store._blob)
    homes["entry_corrupted"] = bad_entry
    garbage = tmp / "garbage"
    (garbage / "store").mkdir(parents=True)
    (garbage / "store" / "data.mdb").write_bytes(os.urandom(64 * 1024))
    homes["store_file_garbage"] = garbage
    not_lmdb = tmp / "not-lmdb"
    (not_lmdb / "store" / "data.mdb").mkdir(parents=True)  # a directory where the file goes
    homes["store_dir_not_lmdb"] = not_lmdb
    home_file = tmp / "home-is-a-file"
    home_file.write_text("not a directory")
    homes["home_is_a_file"] = home_file
    return homes


def test_the_app_never_depends_on_the_store(tmp_path, llama_path):
    from helpers import CLASSIFY

    messages = [
        {"role": "system", "content": CLASSIFY},
        {"role": "user", "content": "My invoice was charged twice."},
    ]
    runs = {"baseline": (tmp_path / "unused", "0")}
    runs.update({k: (v, "1") for k, v in _scenarios(tmp_path, llama_path).items()})
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", APP, str(llama_path), str(home), flag, json.dumps(messages)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "KVSTORE_HOME": str(home)},
        )
        for name, (home, flag) in runs.items()
    }
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{name}: {err[-3000:]}"
        res = json.loads(out.strip().splitlines()[-1])
        res["warnings"] = [ln for ln in err.splitlines() if ln.startswith("kvstore:")]
        results[name] = res
    base = results.pop("baseline")
    battery.record(
        "10_never_a_hard_dependency",
        scenarios=len(results),
        same_output=sum(r["text"] == base["text"] for r in results.values()),
        warnings={k: len(r["warnings"]) for k, r in results.items()},
        hydrated={k: r["entries"] for k, r in results.items()},
        first_warning={k: r["warnings"][0][:140] for k, r in results.items() if r["warnings"]},
    )
    for name, r in results.items():
        assert r["text"] == base["text"], name
        want = 0 if name == "daemon_down_store_ok" else 1
        assert len(r["warnings"]) == want, (name, r["warnings"])
    assert results["daemon_down_store_ok"]["entries"] == 2
    assert results["entry_corrupted"]["entries"] == 1
    assert results["daemon_down_store_ok"]["prefilled"] < base["prefilled"]
