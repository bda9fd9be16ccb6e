"""Watch the files a manifest depends on; report content changes, debounced.

Filesystem events are only hints: editors save by rename, macOS FSEvents coalesces, and a touch
changes nothing. So a burst of events opens a debounce window, and when it closes every watched
file is re-hashed; `on_change` is called only with the files whose content really changed
(appearing and disappearing files included). Where no observer can start (inotify limits,
permissions) the watcher re-hashes on a timer instead and says so.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch

from kvstore.identity import hash_file

log = logging.getLogger("kvstore.daemon")

# Weight files this large are compared by stat identity, not read: kvstore.identity already
# content-hashes them (cached by the same identity) when the fingerprint is recomputed.
STAT_ONLY_BYTES = 64 * 2**20  # 64 MiB
# A file saved over and over must still be reported eventually.
MAX_DEBOUNCE_WINDOWS = 10
# Events our own re-hash reads cause; reacting to them would re-hash forever.
_SELF_INFLICTED = frozenset({"opened", "closed_no_write"})

Digest = bytes | None  # None: the file is missing or unreadable


def file_digest(path: Path) -> Digest:
    """Content hash of a watched file (stat identity for big safetensors); None when missing."""
    try:
        if path.suffix == ".safetensors":
            st = path.stat()
            if st.st_size >= STAT_ONLY_BYTES:
                return struct.pack("<4q", st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        return hash_file(path)
    except OSError:  # gone, a directory, or unreadable: all mean "not this content any more"
        return None


def _nearest_dir(path: Path) -> Path | None:
    """The closest existing directory above `path`: a file in a not-yet-created directory is
    found when that directory's creation shows up in its parent."""
    for d in path.parents:
        if d.is_dir():
            return d
    return None


class _Hints(FileSystemEventHandler):
    """Runs on the observer thread: only decides whether an event concerns us, then wakes."""

    def __init__(self, watcher: Watcher):
        self._watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in _SELF_INFLICTED:
            return
        # Directory "modified" fires for every file created next to ours; only a watched
        # directory itself appearing, moving or vanishing matters.
        if event.is_directory and event.event_type == "modified":
            return
        names = self._watcher._relevant  # swapped whole, never mutated: safe to read here
        for raw in (event.src_path, event.dest_path):
            if raw and os.fsdecode(raw) in names:
                self._watcher._hint()
                return


class Watcher(threading.Thread):
    """A stoppable thread calling `on_change(changed_paths)` when watched files' contents change.

    `paths()` is asked for the files to watch at start, again after every `on_change` (the
    manifest may now reference other files), and on `refresh()` (the caller's list grew).
    `on_change` runs on this thread; its exceptions are logged and the watcher carries on.

        w = Watcher(lambda: [manifest, prompt], on_change=rewarm)
        w.start()
        try: ...
        finally: w.stop()
    """

    def __init__(
        self,
        paths: Callable[[], Iterable[Path]],
        on_change: Callable[[set[Path]], None],
        *,
        debounce: float = 0.5,
        poll_interval: float = 5.0,
    ):
        # Not a daemon thread (unlike watchdog's BaseThread): on_change writes the store, and
        # interpreter exit must not kill it mid-write; stop() is the way out.
        super().__init__(name="kvstore-watcher", daemon=False)
        self._paths = paths
        self._on_change = on_change
        self.debounce = debounce
        self.poll_interval = poll_interval
        self.mode = "unstarted"
        self._stop_event = threading.Event()
        self._wake = threading.Event()  # anything to do: a file event, a refresh, a stop
        self._events = threading.Event()  # a file event arrived since the last check
        self._refresh = threading.Event()  # refresh() asked to re-list the paths
        self._hashes: dict[Path, Digest] = {}
        self._relevant: frozenset[str] = frozenset()
        self._observer: BaseObserver | None = None
        self._scheduled: dict[Path, ObservedWatch] = {}

    # -- public ------------------------------------------------------------------------------

    @property
    def watched(self) -> frozenset[Path]:
        """The files being watched now."""
        return frozenset(self._hashes)

    @property
    def directories(self) -> frozenset[Path]:
        """The directories the observer has scheduled (empty when polling)."""
        return frozenset(self._scheduled)

    def start(self) -> None:
        """Take the baseline hashes, start the observer (or fall back to polling), then run."""
        if self._stop_event.is_set():
            raise RuntimeError("a stopped Watcher cannot be started again")
        self._set_paths(self._query_paths() or [])
        try:
            self._observer = Observer()
            self._reschedule()
            self._observer.start()
            self.mode = "watchdog"
        except OSError as e:
            self._fall_back(e)
        super().start()

    def refresh(self) -> None:
        """Re-ask `paths()` soon, on this thread, and watch what it adds: new files get their
        baseline hash then, files already watched keep theirs (so a change not yet checked is
        still reported), new directories are scheduled. No full re-hash unless a directory was
        added (a late schedule may have missed a change). Safe from any thread; a no-op once
        stopped; before `start()`, start takes the current list anyway."""
        self._refresh.set()
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stop watching and join this thread and the observer's. Idempotent; safe in `finally`,
        before `start()`, and from inside `on_change`."""
        self._stop_event.set()
        self._wake.set()
        if self.ident is None:  # never ran: nothing else will stop the observer
            self._stop_observer()
        elif threading.current_thread() is not self:
            self.join(timeout)

    # -- the thread --------------------------------------------------------------------------

    def run(self) -> None:
        next_poll = time.monotonic() + self.poll_interval
        try:
            while not self._stop_event.is_set():
                if self.mode == "polling":
                    self._wake.wait(max(0.0, next_poll - time.monotonic()))
                    self._wake.clear()
                    if self._stop_event.is_set():
                        return
                    self._apply_refresh()
                    if time.monotonic() < next_poll:
                        continue  # woken to refresh: the next re-hash is still the timer's
                    next_poll = time.monotonic() + self.poll_interval
                else:
                    self._wake.wait()
                    if self._stop_event.is_set():
                        return
                    self._wake.clear()  # before looking: a hint from now on wakes us again
                    if not self._events.is_set():  # woken only to refresh the list
                        self._apply_refresh()
                        continue
                    if not self._settle():
                        return
                    self._apply_refresh()
                self._check()
        finally:
            # Only this thread touches the observer once running, so it is the one to stop it.
            self._stop_observer()

    def _hint(self) -> None:
        self._events.set()
        self._wake.set()

    def _apply_refresh(self) -> None:
        if not self._refresh.is_set():
            return
        self._refresh.clear()
        paths = self._query_paths()
        if paths is not None:
            self._set_paths(paths)  # keeps the baseline of files already watched
        if self.mode == "watchdog":
            try:
                self._reschedule()
            except OSError as e:
                self._fall_back(e)

    def _settle(self) -> bool:
        """Wait until events stop for one debounce window; False when stopped meanwhile."""
        deadline = time.monotonic() + self.debounce * MAX_DEBOUNCE_WINDOWS
        while True:
            self._wake.clear()
            if self._stop_event.wait(self.debounce):
                return False
            if not self._wake.is_set() or time.monotonic() >= deadline:
                return True

    def _check(self) -> None:
        self._events.clear()  # events from here on call for another check
        new = {p: file_digest(p) for p in self._hashes}
        changed = {p for p, d in new.items() if d != self._hashes[p]}
        # Baseline first: a failing on_change must not be re-fired on every later event.
        self._hashes = new
        if changed:
            try:
                self._on_change(changed)
            except Exception:
                log.exception("watcher: handling a change of %s failed", sorted(map(str, changed)))
            paths = self._query_paths()
            if paths is not None:
                self._set_paths(paths)
        if self.mode == "watchdog":
            # Also after a quiet check: a watched directory may have appeared or vanished.
            try:
                self._reschedule()
            except OSError as e:
                self._fall_back(e)

    # -- paths and schedules -----------------------------------------------------------------

    def _query_paths(self) -> list[Path] | None:
        try:
            return [Path(os.path.abspath(p)) for p in self._paths()]
        except Exception:  # e.g. a manifest mid-edit that does not parse: keep the old set
            log.exception("watcher: listing the files to watch failed; keeping the previous list")
            return None

    def _set_paths(self, paths: Iterable[Path]) -> None:
        """Newly listed files get a baseline hash; dropped ones are forgotten."""
        old = self._hashes
        self._hashes = {p: old[p] if p in old else file_digest(p) for p in dict.fromkeys(paths)}
        names: set[str] = set()
        for p in self._hashes:
            # The symlink and its target both count: hub snapshots link into blobs/, and
            # macOS reports /private/var for /var.
            for q in {p, Path(os.path.realpath(p))}:
                names.add(str(q))
                names.update(str(d) for d in q.parents)
        self._relevant = frozenset(names)

    def _wanted_dirs(self) -> set[Path]:
        dirs: set[Path] = set()
        for p in self._hashes:
            for q in {p, Path(os.path.realpath(p))}:
                if (d := _nearest_dir(q)) is not None:
                    dirs.add(d)
        return dirs

    def _reschedule(self) -> None:
        """One non-recursive schedule per directory holding a watched file. Raises OSError when
        the observer refuses (watch limits, permissions)."""
        assert self._observer is not None
        wanted = self._wanted_dirs()
        for d in set(self._scheduled) - wanted:
            self._observer.unschedule(self._scheduled.pop(d))
        handler = _Hints(self)
        added = False
        for d in sorted(wanted - set(self._scheduled)):
            try:
                self._scheduled[d] = self._observer.schedule(handler, str(d), recursive=False)
                added = True
            except FileNotFoundError:  # removed since we looked; the parent's event brings it back
                continue
        if added and self.mode == "watchdog":
            self._hint()  # a directory scheduled late may have missed a change: re-check once

    def _fall_back(self, error: OSError) -> None:
        log.warning(
            "watcher: file events unavailable (%s); re-hashing watched files every %gs instead",
            error,
            self.poll_interval,
        )
        self._stop_observer()
        self.mode = "polling"

    def _stop_observer(self) -> None:
        observer, self._observer = self._observer, None
        self._scheduled.clear()
        if observer is None:
            return
        try:
            observer.stop()  # also stops and joins the emitters it started
        except Exception:  # a half-started observer: its emitters are what matter
            log.debug("watcher: stopping the observer", exc_info=True)
        if observer.is_alive():
            observer.join()
