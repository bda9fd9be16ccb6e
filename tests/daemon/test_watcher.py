"""The file watcher: real files, a real observer, short debounce windows."""

from __future__ import annotations

import logging
import os
import threading
import time
import unicodedata
from pathlib import Path
from unittest import mock

import pytest
from helpers import wait_for
from watchdog.events import FileModifiedEvent
from watchdog.observers import Observer

from kvstore.daemon.watcher import Watcher, _Hints, covers, file_digest, path_key

DEBOUNCE = 0.2
QUIET = DEBOUNCE * 4  # long enough that a second call would have arrived


class Calls:
    """What on_change received, with a way to wait for the next call."""

    def __init__(self) -> None:
        self.calls: list[set[Path]] = []
        self._cond = threading.Condition()

    def __call__(self, changed: set[Path]) -> None:
        with self._cond:
            self.calls.append(changed)
            self._cond.notify_all()

    def wait(self, n: int = 1, timeout: float = 30.0) -> list[set[Path]]:
        """The calls once there are `n` (or after `timeout`: a short one checks that none come),
        and QUIET seconds more, so a call too many would be seen."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.calls) >= n, timeout)
        time.sleep(QUIET)
        return self.calls


def _start(paths, calls, **kw) -> Watcher:
    w = Watcher(paths, calls, debounce=DEBOUNCE, **kw)
    w.start()
    return w


def _save_by_rename(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.swp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
def prompt(tmp_path) -> Path:
    p = tmp_path / "prompts" / "system.md"
    p.parent.mkdir()
    p.write_text("You are the router.")
    return p


def test_atomic_save_by_rename_gives_one_call(prompt):
    calls = Calls()
    w = _start(lambda: [prompt], calls)
    try:
        assert w.mode == "watchdog"
        assert w.directories == {prompt.parent}
        _save_by_rename(prompt, "You are the new router.")
        assert calls.wait() == [{prompt}]
    finally:
        w.stop()


def test_burst_of_edits_is_debounced(prompt):
    calls = Calls()
    w = _start(lambda: [prompt], calls)
    try:
        for i in range(50):
            prompt.write_text(f"edit {i}")
        got = calls.wait()
        assert 1 <= len(got) <= 2
        assert all(c == {prompt} for c in got)
    finally:
        w.stop()


def test_touch_without_content_change_gives_no_call(prompt):
    calls = Calls()
    w = _start(lambda: [prompt], calls)
    try:
        os.utime(prompt, ns=(1, 1))
        prompt.write_text(prompt.read_text())  # rewritten with the same bytes
        assert calls.wait(timeout=DEBOUNCE * 3) == []
    finally:
        w.stop()


def test_deleting_a_watched_file_is_a_change(prompt, tmp_path):
    other = tmp_path / "tools.json"
    other.write_text("[]")
    calls = Calls()
    w = _start(lambda: [prompt, other], calls)
    try:
        prompt.unlink()
        assert calls.wait() == [{prompt}]
    finally:
        w.stop()


def test_newly_referenced_file_gets_watched(prompt, tmp_path):
    # The manifest names the extra file only after its first edit, as a real manifest would.
    manifest = tmp_path / "manifest.toml"
    manifest.write_text("v1")
    extra = tmp_path / "late" / "tools.json"  # its directory does not exist yet either

    def paths() -> list[Path]:
        return [manifest, extra] if manifest.read_text() == "v2" else [manifest]

    calls = Calls()
    w = _start(paths, calls)
    try:
        assert w.watched == {manifest}
        _save_by_rename(manifest, "v2")
        assert calls.wait() == [{manifest}]
        assert w.watched == {manifest, extra}
        extra.parent.mkdir()
        extra.write_text('[{"name": "search"}]')
        assert calls.wait(2) == [{manifest}, {extra}]
        assert extra.parent in w.directories
    finally:
        w.stop()


def test_observer_start_failure_falls_back_to_polling(prompt, caplog):
    calls = Calls()
    limit = OSError(28, "inotify watch limit reached")
    with (
        mock.patch.object(Observer, "start", side_effect=limit),
        caplog.at_level(logging.WARNING, logger="kvstore.daemon"),
    ):
        w = _start(lambda: [prompt], calls, poll_interval=0.1)
    try:
        assert w.mode == "polling"
        assert w.directories == frozenset()
        assert "inotify watch limit reached" in caplog.text
        assert "re-hashing" in caplog.text
        prompt.write_text("changed while polling")
        assert calls.wait() == [{prompt}]
    finally:
        w.stop()


def test_on_change_errors_are_logged_and_watching_goes_on(prompt, caplog):
    seen = Calls()

    def flaky(changed: set[Path]) -> None:
        seen(changed)
        if len(seen.calls) == 1:
            raise RuntimeError("warm failed")

    w = _start(lambda: [prompt], flaky)
    try:
        prompt.write_text("one")
        seen.wait()
        prompt.write_text("two")
        assert seen.wait(2) == [{prompt}, {prompt}]
        assert w.is_alive()
        assert "warm failed" in caplog.text
    finally:
        w.stop()


def test_stop_joins_every_thread_and_is_idempotent(prompt):
    before = set(threading.enumerate())
    w = _start(lambda: [prompt], Calls())
    assert w.is_alive() and not w.daemon
    w.stop()
    w.stop()
    assert not w.is_alive()
    # The observer's threads are daemon threads the leak fixture would not see: check them here.
    assert set(threading.enumerate()) <= before
    Watcher(lambda: [prompt], Calls()).stop()  # stopping one never started is harmless


def test_big_safetensors_compared_by_stat_identity(tmp_path):
    big = tmp_path / "model.safetensors"
    with open(big, "wb") as f:
        f.truncate(64 * 2**20)
    with mock.patch("kvstore.daemon.watcher.hash_file") as hash_file:
        first = file_digest(big)
        hash_file.assert_not_called()
    os.utime(big, ns=(1, 1))
    assert file_digest(big) != first
    assert file_digest(tmp_path / "missing.safetensors") is None


# -- emitters that die quietly, as watchdog's FSEvents emitter does ---------------------------


def _emitter_class():
    return Observer()._emitter_class  # this platform's emitter (inotify here, FSEvents on macOS)


def _dies_in_its_thread(self) -> None:
    # FSEventsEmitter.run: the C extension raises inside the thread, run() logs it and returns.
    try:
        raise SystemError("Cannot start fsevents stream. Use a kqueue or polling observer instead.")
    except Exception:
        logging.getLogger("watchdog.observers.fsevents").exception(
            "Unhandled exception in FSEventsEmitter"
        )


def test_an_emitter_that_dies_in_its_thread_hands_over_to_polling(prompt, caplog):
    calls = Calls()
    poll = 0.5
    with mock.patch.object(_emitter_class(), "run", _dies_in_its_thread):
        w = _start(lambda: [prompt], calls, poll_interval=poll)
    try:
        assert w.mode == "watchdog"  # schedule and start raised nothing: only the thread died
        wait_for(lambda: w.mode == "polling", what="polling to take over")
        assert "file-event emitter" in caplog.text and "re-hashing" in caplog.text
        # saved as editors save (temp file, then rename): a poll between write_text's truncate
        # and its write would see two changes, the empty file and then the text
        tmp = prompt.with_name(".system.md.tmp")
        tmp.write_text("changed after the emitter died")
        os.replace(tmp, prompt)
        assert calls.wait() == [{prompt}]
    finally:
        w.stop()


def test_an_emitter_stopped_by_a_renamed_root_is_watched_afresh(prompt, caplog):
    calls = Calls()
    poll = 0.5
    w = _start(lambda: [prompt], calls, poll_interval=poll)
    try:
        folder = prompt.parent
        os.rename(folder, folder.with_name("prompts.old"))
        # FSEventsEmitter.queue_events on is_root_changed: queue DirDeletedEvent, then stop().
        (emitter,) = [e for e in w._observer.emitters if e.watch.path == str(folder)]
        emitter.stop()
        folder.mkdir()
        prompt.write_text("You are the router, in a new folder.")
        got = calls.wait()
        assert {prompt} in got, caplog.text
        assert w.mode == "watchdog" and folder in w.directories
        prompt.write_text("and edited again")  # the fresh emitter delivers events
        assert calls.wait(len(got) + 1)[-1] == {prompt}
    finally:
        w.stop()


# -- scope and path matching ------------------------------------------------------------------


def test_the_store_is_outside_every_watched_tree(tmp_path, monkeypatch):
    home = tmp_path / "kvhome"
    store = home / "store"
    store.mkdir(parents=True)
    manifest = home / "manifest.toml"  # the default manifest sits in the home, next to store/
    manifest.write_text("v1")
    prompt = tmp_path / "prompts" / "system.md"
    prompt.parent.mkdir()
    prompt.write_text("p1")
    user_pins = tmp_path / "user" / "pins.toml"  # a manifest in the user's home: all of ~/Library
    user_pins.parent.mkdir()
    user_pins.write_text("u1")
    monkeypatch.setenv("HOME", str(user_pins.parent))
    calls = Calls()
    poll = 0.4
    w = _start(
        lambda: [manifest, prompt, user_pins],
        calls,
        poll_interval=poll,
        keep_out=[store],
        tree_watches=True,  # FSEvents semantics: a schedule sees its whole tree
    )
    try:
        assert w.mode == "watchdog"
        assert w.directories == {prompt.parent}
        assert not any(covers(d, store / "data.mdb", tree=True) for d in w.directories)
        assert w.polled == {manifest, user_pins}
        for i in range(20):  # LMDB writes wake nothing
            (store / "data.mdb").write_bytes(b"x" * i)
        assert calls.wait(timeout=poll * 2) == []
        _save_by_rename(manifest, "v2")  # polled: seen within the poll interval
        assert calls.wait() == [{manifest}]
        prompt.write_text("p2")  # events
        assert calls.wait(2)[-1] == {prompt}
    finally:
        w.stop()


def test_inotify_may_watch_the_home_but_never_the_store_itself(tmp_path):
    store = tmp_path / "kvhome" / "store"
    store.mkdir(parents=True)
    manifest = store.parent / "manifest.toml"
    manifest.write_text("v1")
    inside = store / "lock.mdb"
    inside.write_text("")
    w = _start(lambda: [manifest, inside], Calls(), keep_out=[store], tree_watches=False)
    try:
        assert w.directories == {store.parent}  # non-recursive: store/'s writes are not seen
        assert w.polled == {inside}
    finally:
        w.stop()


def test_path_key_matches_case_normalization_and_symlinked_dirs(tmp_path):
    real = tmp_path / "private" / "var"
    real.mkdir(parents=True)
    link = tmp_path / "var"
    link.symlink_to(real)
    nfc = unicodedata.normalize("NFC", "Café.md")
    nfd = unicodedata.normalize("NFD", "Café.md")
    assert nfc != nfd
    assert path_key(link / nfd) == path_key(real / nfc)
    assert path_key(str(real / "PROMPT.md")) == path_key(real / "prompt.md")


def test_an_event_spelled_otherwise_still_wakes_the_watcher(tmp_path):
    # FSEvents reports the real path, in the volume's normalization and the name's stored case.
    real = tmp_path / "private" / "var"
    real.mkdir(parents=True)
    (tmp_path / "var").symlink_to(real)
    watched = tmp_path / "var" / unicodedata.normalize("NFC", "Résumé.md")
    watched.write_text("x")
    w = Watcher(lambda: [watched], Calls())
    w._set_paths([watched])
    reported = str(real / unicodedata.normalize("NFD", "RÉSUMÉ.md"))
    _Hints(w).on_any_event(FileModifiedEvent(reported))
    assert w._events.is_set()
    w.stop()
