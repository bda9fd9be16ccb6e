"""The daemon's process plumbing: the one-per-home lock, the socket, peer credentials, memory.

Order matters and is why these live together: the lock is taken before anything else, and only the
lock holder may remove a stale socket, so a second daemon never disturbs the first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvstore.daemon.exits import PARK_UNDER, SUPERVISOR_ENV
from kvstore.errors import KVStoreError
from kvstore.home.settings import LOCK_NAME
from kvstore.warm.memory import available_memory_bytes  # noqa: F401 (the daemon's name for it)
from kvstore.wire.daemon_client import socket_path

# struct ucred (Linux SO_PEERCRED): pid_t pid, uid_t uid, gid_t gid.
UCRED = struct.Struct("=iII")
# struct xucred (macOS LOCAL_PEERCRED): u_int cr_version, uid_t cr_uid, short cr_ngroups,
# (2 bytes padding), gid_t cr_groups[16].
XUCRED = struct.Struct("=IIh2x16I")
XUCRED_VERSION = 0
SOL_LOCAL = 0  # macOS <sys/un.h>; Python's socket module does not export these two
LOCAL_PEERCRED = 1


log = logging.getLogger("kvstore.daemon")


class DaemonRunning(KVStoreError):
    """Another daemon holds this home's lock."""


def supervisor() -> str:
    """The supervisor that runs this daemon ("launchd", "systemd"), as its service file says
    (daemon/exits.py), or "" when started by hand."""
    return os.environ.get(SUPERVISOR_ENV, "")


def park_if_supervised(code: int, reason: str) -> int:
    """Return `code` at once, except under a supervisor that restarts every non-zero exit
    (launchd: daemon/exits.py): there, say so once and wait for SIGTERM, then return it."""
    if supervisor() not in PARK_UNDER:
        return code
    log.error(
        "%s would restart a daemon that exits %d every ThrottleInterval, so it waits here until "
        "stopped; fix the cause (%s), then run `kvstore service install` again",
        supervisor(),
        code,
        reason,
    )
    stopped(None)
    return code


def stopped(seconds: float | None) -> bool:
    """Wait `seconds` (None: for ever) for SIGTERM or SIGINT; whether one came. The daemon's
    own handlers are not installed yet: these are, for the wait, then the previous ones."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        # a timeout on each wait, so the handler gets the main thread to run on
        while not stop.wait(0.5 if deadline is None else min(0.5, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                break
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return stop.is_set()


# A CLI tests the lock with a shared flock held for microseconds (kvstore.wire.daemon_client.
# lock_holder): a daemon starting in that instant tries again for this long before it concludes
# that another daemon holds the home.
LOCK_RETRY_SECONDS = 1.0


def acquire_lock(home: Path) -> int:
    """flock home/daemon.lock (non-blocking) and write our pid in it; the fd must stay open.

    The lock dies with the process however it dies, so a killed daemon never blocks the next one.
    An OS error names the lock file (a full disk at start is told apart from a refusal by errno).
    """
    path = home / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    deadline = time.monotonic() + LOCK_RETRY_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DaemonRunning(
                f"a kvstore daemon (pid {pid}) already runs for home {home}; "
                f"stop it first (kill {pid}) or pass another --home"
            ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        os.close(fd)
        raise OSError(e.errno, e.strerror, str(path)) from None
    return fd


def remove_stale_socket(home: Path) -> None:
    """Remove the socket a daemon that died left behind (killed by a signal, say), so clients
    see no daemon rather than one that refuses them. Only call with the lock held."""
    try:
        socket_path(home).unlink()
    except (FileNotFoundError, KVStoreError):
        pass
    except OSError as e:
        log.warning("%s: cannot remove the stale daemon socket: %s", home, e)


def bind_socket(home: Path, *, backlog: int) -> tuple[socket.socket, Path]:
    """Listen on the home's socket (0600), taking over one a killed daemon left behind.

    Only call with the lock held: the lock, not the socket file, says whether a daemon runs.
    """
    path = socket_path(home, create=True)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # created 0600 from the start: no window where others can connect
    try:
        sock.bind(str(path))
    except OSError as e:
        sock.close()
        raise KVStoreError(f"{path}: cannot bind the daemon socket: {e}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    return sock, path


# -- peer credentials --------------------------------------------------------------------------


def peer_uid(raw: bytes, layout: str) -> int:
    """The peer's uid from getsockopt bytes: `layout` is "ucred" (Linux) or "xucred" (macOS)."""
    if layout == "ucred":
        if len(raw) < UCRED.size:
            raise ValueError(f"ucred is {len(raw)} bytes, expected {UCRED.size}")
        return UCRED.unpack_from(raw)[1]
    if layout == "xucred":
        if len(raw) < 8:
            raise ValueError(f"xucred is {len(raw)} bytes, expected at least 8")
        version, uid = struct.unpack_from("=II", raw)
        if version != XUCRED_VERSION:
            raise ValueError(f"xucred version {version}, expected {XUCRED_VERSION}")
        return uid
    raise ValueError(f"unknown credential layout {layout!r}")


def peer_allowed(raw: bytes, layout: str, uid: int) -> bool:
    """Only our own uid may talk to us; unreadable credentials are refused."""
    try:
        return peer_uid(raw, layout) == uid
    except ValueError:
        return False


def cred_layout() -> str | None:
    if sys.platform.startswith("linux"):
        return "ucred"
    if sys.platform == "darwin":
        return "xucred"
    return None


def read_peer_cred(conn: socket.socket, layout: str) -> bytes:
    if layout == "ucred":
        return conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    return conn.getsockopt(SOL_LOCAL, LOCAL_PEERCRED, XUCRED.size)


def check_peer(conn: socket.socket, layout: str | None) -> bool:
    """Whether the connected peer runs as our uid. Without a credential API (not Linux or
    macOS) the socket's 0600 mode in the 0700 home is the only guard."""
    if layout is None:
        return True
    try:
        raw = read_peer_cred(conn, layout)
    except OSError:
        return False
    return peer_allowed(raw, layout, os.getuid())


# -- memory ------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident memory now: /proc on Linux, `ps` elsewhere (0 when unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["ps", "-o", "rss=", "-p", str(os.getpid())],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
        return int(out.strip() or 0) * 1024
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def peak_rss_bytes() -> int:
    """Peak resident memory of the process so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def trim_heap() -> None:
    """Give freed heap back to the OS after a model is released. mlx frees its buffers, but
    glibc keeps the pages in the process; malloc_trim returns them. macOS's equivalent is
    malloc_zone_pressure_relief."""
    try:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        elif sys.platform == "darwin":
            ctypes.CDLL(None).malloc_zone_pressure_relief(None, 0)
    except (OSError, AttributeError):  # musl and friends: nothing to trim, or no such call
        pass


# Loading a model takes its weights plus working room (the prefill's activations, mlx's buffers):
# a warm is deferred unless this much more than the weights is available.
LOAD_MARGIN_FRACTION = 0.10
LOAD_MARGIN_BYTES = 512 * 2**20  # 512 MiB


def memory_to_load(model_dir: Path, adapter: str | None) -> int:
    """Bytes a model load needs: its weight (and adapter) files plus the margin."""
    from kvstore.identity.fingerprint import ADAPTER_GLOBS, WEIGHT_GLOBS

    files = [p for g in WEIGHT_GLOBS for p in model_dir.glob(g)]
    if adapter:
        files += [p for g in ADAPTER_GLOBS for p in Path(adapter).expanduser().glob(g)]
    size = 0
    for p in set(files):
        try:
            size += p.stat().st_size  # through symlinks: hub snapshots link into blobs/
        except OSError:
            pass
    return size + int(size * LOAD_MARGIN_FRACTION) + LOAD_MARGIN_BYTES
