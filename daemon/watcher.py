"""Watch the files a manifest depends on; report content changes, debounced.

Filesystem events are only hints: editors save by rename, macOS FSEvents coalesces, and a touch
changes nothing. So a burst of events opens a debounce window, and when it closes every watched
file is re-hashed; `on_change` is called only with the files whose content really changed
(appearing and disappearing files included). Where no observer can start (inotify limits,
permissions) the watcher re-hashes on a timer instead and says so.

What watchdog does not say: its emitters die quietly. The FSEvents emitter catches its own errors
in its thread (the C extension raises RuntimeError/SystemError) and stops itself when a watched
root is renamed or deleted; the inotify one stops when its directory is deleted
(gorakhargosh/watchdog src/watchdog/observers/fsevents.py FSEventsEmitter.run/queue_events,
src/watchdog_fsevents.c, inotify.py). So every poll interval the watcher checks its emitters: one
whose directory was removed or replaced is started afresh, one that died in place means events
cannot be trusted, and the watcher re-hashes on the timer from then on.

FSEvents watches trees: a non-recursive schedule still streams every event below the directory
(watchdog filters them in Python). So no watched directory may hold the store (every LMDB write
would wake us) or be the user's home (all of ~/Library): files there are re-hashed on the timer.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch

from kvstore.degrade import daemon_handler
from kvstore.identity.fingerprint import hash_file

log = logging.getLogger("kvstore.daemon")

# Weight files this large are compared by stat identity, not read: kvstore.identity.fingerprint
# already content-hashes them (cached by the same identity) when the fingerprint is recomputed.
STAT_ONLY_BYTES = 64 * 2**20  # 64 MiB
# A file saved over and over must still be reported eventually.
MAX_DEBOUNCE_WINDOWS = 10
# Events our own re-hash reads cause; reacting to them would re-hash forever.
_SELF_INFLICTED = frozenset({"opened", "closed_no_write"})
# Emitters whose directory was replaced are restarted; past this many restarts in a row, each
# within RESTART_WINDOW of the last, something keeps killing them: poll instead.
MAX_OBSERVER_RESTARTS = 20
RESTART_WINDOW = 60.0  # seconds
# Observers whose schedules cover a directory's whole tree (FSEvents), not only its entries.
TREE_WATCHES = sys.platform == "darwin"

Digest = bytes | None  # None: the file is missing or unreadable


def path_key(path: str | bytes | os.PathLike[str]) -> str:
    """How an event path is matched against watched ones: real path (macOS reports /private/var
    for /var), NFC (HFS+ and FSEvents may hand back NFD), case-folded (APFS and HFS+ are
    case-insensitive by default). Folding on a case-sensitive volume only over-matches, and an
    over-match costs one re-hash that finds nothing: events are hints."""
    real = os.path.realpath(os.fsdecode(path))
    return unicodedata.normalize("NFC", real).casefold()


def identity(d: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(d)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def covers(d: Path, other: Path, *, tree: bool) -> bool:
    """Whether a schedule on directory `d` sees events of `other`'s files: under a tree observer
    when `other` is `d` or below it; under inotify only when `other` is `d` itself."""
    d, other = Path(path_key(d)), Path(path_key(other))
    return other == d or (tree and d in other.parents)


def nearest_dir(path: Path) -> Path | None:
    """The closest existing directory above `path`: a file in a not-yet-created directory is
    found when that directory's creation shows up in its parent."""
    for d in path.parents:
        if d.is_dir():
            return d
    return None


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
        names = self._watcher.relevant  # swapped whole, never mutated: safe to read here
        for raw in (event.src_path, event.dest_path):
            if raw and path_key(raw) in names:
                self._watcher.hint()
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
        keep_out: Iterable[Path] = (),
        tree_watches: bool = TREE_WATCHES,
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
        # path keys of the watched files and their folders: an event on one is a hint
        self.relevant: frozenset[str] = frozenset()
        self._observer: BaseObserver | None = None
        self._scheduled: dict[Path, ObservedWatch] = {}
        self._identities: dict[Path, tuple[int, int] | None] = {}
        self._restarts = 0
        self._last_restart = float("-inf")
        # Directories no schedule may cover (the store); the user's home under tree watches.
        self.keep_out = [Path(os.path.abspath(p)) for p in keep_out]
        self.tree_watches = tree_watches
        self._polled: frozenset[Path] = frozenset()  # watched files no schedule may cover

    # -- public ------------------------------------------------------------------------------

    @property
    def watched(self) -> frozenset[Path]:
        """The files being watched now."""
        return frozenset(self._hashes)

    @property
    def directories(self) -> frozenset[Path]:
        """The directories the observer has scheduled (empty when polling)."""
        return frozenset(self._scheduled)

    @property
    def polled(self) -> frozenset[Path]:
        """Watched files re-hashed on the timer because no schedule may cover them."""
        return self._polled

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
                self._wake.wait(max(0.0, next_poll - time.monotonic()))
                if self._stop_event.is_set():
                    return
                self._wake.clear()  # before looking: a hint from now on wakes us again
                due = time.monotonic() >= next_poll
                if due:
                    next_poll = time.monotonic() + self.poll_interval
                if self.mode == "polling":
                    self._apply_refresh()
                    if due:
                        self._check()
                    continue
                if self._events.is_set():
                    if not self._settle():
                        return
                    self._apply_refresh()
                    self._check()
                else:
                    self._apply_refresh()
                if due:
                    self._tend_observer()  # may fall back to polling, with a full check
                    if self.mode == "watchdog" and self._polled:
                        self._check(only=self._polled)
        finally:
            # Only this thread touches the observer once running, so it is the one to stop it.
            self._stop_observer()

    def _tend_observer(self) -> None:
        """Emitters die quietly (module docstring): restart the observer when a directory went
        away or was replaced under its emitter, fall back to polling when one died in place."""
        observer = self._observer
        if observer is None:
            return
        alive = (
            {e.watch for e in observer.emitters if e.is_alive()} if observer.is_alive() else set()
        )
        dead = [d for d, w in self._scheduled.items() if w not in alive]
        if not dead:
            return
        in_place = [
            d for d in dead if identity(d) is not None and identity(d) == self._identities.get(d)
        ]
        if in_place or not observer.is_alive():
            where = in_place[0] if in_place else "the observer"
            self._fall_back(f"the file-event emitter for {where} stopped")
            self._check()  # what changed while it was dead
            return
        now = time.monotonic()
        self._restarts = self._restarts + 1 if now - self._last_restart < RESTART_WINDOW else 1
        self._last_restart = now
        if self._restarts > MAX_OBSERVER_RESTARTS:
            self._fall_back(f"file-event emitters stopped {self._restarts} times")
            self._check()
            return
        log.info(
            "watcher: %s removed or replaced under its file events; watching afresh",
            ", ".join(map(str, dead)),
        )
        self._stop_observer()
        try:
            self._observer = Observer()
            self._reschedule()
            self._observer.start()
        except OSError as e:
            self._fall_back(e)
            self._check()
            return
        self.hint()  # changes since the emitter stopped: re-check once

    def hint(self) -> None:
        """Wake the watcher to re-check its files (a file event, or a change it may have missed)."""
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

    def _check(self, only: Iterable[Path] | None = None) -> None:
        """Re-hash every watched file (or those of `only`) and report the ones that changed."""
        if only is None:
            self._events.clear()  # events from here on call for another check
        paths = self._hashes if only is None else [p for p in only if p in self._hashes]
        new = {p: file_digest(p) for p in paths}
        changed = {p for p, d in new.items() if d != self._hashes[p]}
        # Baseline first: a failing on_change must not be re-fired on every later event.
        self._hashes = {**self._hashes, **new}
        if changed:
            what = f"watcher: handling a change of {sorted(map(str, changed))} failed"
            with daemon_handler(what, logger=log):
                self._on_change(changed)
            listed = self._query_paths()
            if listed is not None:
                self._set_paths(listed)
        if self.mode == "watchdog":
            # Also after a quiet check: a watched directory may have appeared or vanished.
            try:
                self._reschedule()
            except OSError as e:
                self._fall_back(e)

    # -- paths and schedules -----------------------------------------------------------------

    def _query_paths(self) -> list[Path] | None:
        # e.g. a manifest mid-edit that does not parse: keep the old set
        what = "watcher: listing the files to watch failed; keeping the previous list"
        with daemon_handler(what, logger=log):
            return [Path(os.path.abspath(p)) for p in self._paths()]
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
                names.add(path_key(q))
                names.update(path_key(d) for d in q.parents)
        self.relevant = frozenset(names)

    def _forbidden(self, d: Path) -> bool:
        """A schedule on `d` would see the store's writes (or, under tree watches, all of the
        user's home): its files are polled instead."""
        if any(covers(d, k, tree=self.tree_watches) for k in self.keep_out):
            return True
        return self.tree_watches and (path_key(d) == path_key(Path.home()) or d == Path(d.anchor))

    def _wanted_dirs(self) -> set[Path]:
        dirs: set[Path] = set()
        polled: set[Path] = set()
        for p in self._hashes:
            for q in {p, Path(os.path.realpath(p))}:
                if (d := nearest_dir(q)) is None:
                    continue
                if self._forbidden(d):
                    polled.add(p)
                else:
                    dirs.add(d)
        self._polled = frozenset(polled)
        return dirs

    def _reschedule(self) -> None:
        """One non-recursive schedule per directory holding a watched file. Raises OSError when
        the observer refuses (watch limits, permissions)."""
        assert self._observer is not None
        wanted = self._wanted_dirs()
        for d in set(self._scheduled) - wanted:
            self._observer.unschedule(self._scheduled.pop(d))
            self._identities.pop(d, None)
        handler = _Hints(self)
        added = False
        for d in sorted(wanted - set(self._scheduled)):
            try:
                self._scheduled[d] = self._observer.schedule(handler, str(d), recursive=False)
                self._identities[d] = identity(d)
                added = True
            except FileNotFoundError:  # removed since we looked; the parent's event brings it back
                continue
        if added and self.mode == "watchdog":
            self.hint()  # a directory scheduled late may have missed a change: re-check once

    def _fall_back(self, error: OSError | str) -> None:
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
        self._identities.clear()
        if observer is None:
            return
        try:
            observer.stop()  # also stops and joins the emitters it started
        except (RuntimeError, OSError):  # a half-started observer: its emitters are what matter
            log.debug("watcher: stopping the observer", exc_info=True)
        if observer.is_alive():
            observer.join()
