"""The client end of the daemon's socket: where it lives, and requests over it.

Both ends compute the socket path with `socket_path(home)`, so they agree even when the home is too
deep for the OS limit on unix socket paths and a short fallback under /tmp is used instead.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any, TypeVar, cast

import xxhash

from kvstore.errors import DaemonError, KVStoreError, ProtocolError
from kvstore.home.settings import LOCK_NAME, SOCKET_NAME, resolve_home
from kvstore.wire import protocol
from kvstore.wire.codes import ErrorCode, code_of
from kvstore.wire.messages import (
    PROTOCOL_VERSION,
    PingReply,
    PingRequest,
    PutRequest,
    Reply,
    Request,
    WireMap,
)

R = TypeVar("R", bound=Reply)

# sun_path holds 104 bytes on macOS and the BSDs, 108 on Linux, NUL terminator included.
SUN_PATH_MAX = 108 if sys.platform.startswith("linux") else 104
# A fixed root, not $TMPDIR: launchd and a login shell can see different TMPDIRs, and both ends
# must compute the same path.
FALLBACK_ROOT = Path("/tmp")


def _fits(path: Path) -> bool:
    return len(os.fsencode(str(path))) < SUN_PATH_MAX


def fallback_dir(uid: int | None = None) -> Path:
    uid = os.getuid() if uid is None else uid
    return FALLBACK_ROOT / f"kvstore-{uid}"


def socket_path(home: str | Path | None, *, create: bool = False) -> Path:
    """home/kvstore.sock, or /tmp/kvstore-UID/HASH.sock when that is over the OS limit.

    The fallback directory must be ours and 0700; `create` makes it (the daemon's side). A home
    whose fallback still does not fit is a KVStoreError naming the home.
    """
    home = resolve_home(home).absolute()
    path = home / SOCKET_NAME
    if _fits(path):
        return path
    # Hash the canonical path so `--home` given through a symlink finds the same daemon.
    digest = xxhash.xxh3_64_hexdigest(os.fsencode(str(home.resolve())))
    d = fallback_dir()
    path = d / f"{digest}.sock"
    if not _fits(path):  # pragma: no cover - only with an absurd FALLBACK_ROOT
        raise KVStoreError(f"{home}: socket path too long for this OS and no short fallback fits")
    if create:
        try:
            d.mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            raise KVStoreError(f"{d}: cannot create the socket directory: {e}") from None
    _check_private_dir(d)
    return path


def _check_private_dir(d: Path) -> None:
    """The fallback directory lives in world-writable /tmp: refuse one another user planted."""
    try:
        st = d.lstat()
    except FileNotFoundError:
        return  # the client side: no daemon made it, so none listens there
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise KVStoreError(
            f"{d}: socket directory is not a private directory owned by uid {os.getuid()}; "
            "remove it or use a shorter --home"
        )


class DaemonClient:
    """One connection to the daemon. Use as a context manager; `send` one typed request and get
    its typed reply.

    >>> with connect(home) as c:
    ...     c.send(PingRequest()).pid
    """

    info: PingReply | None = None  # what the daemon answered to connect()'s ping

    def __init__(self, home: str | Path | None = None, *, timeout: float = 30.0):
        self.home = resolve_home(home)
        self.timeout = timeout
        self.path = socket_path(self.home)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(self.path))
        except OSError:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, request: Request[R], *, timeout: float | None = -1.0) -> R:
        """Send one request and return its reply, of the type the request names. A request that
        `waits` (put, warm, repair) waits as long as its work takes; others `timeout` (default
        the connection's; None waits as long as it takes). A put's blob over one chunk streams
        in protocol.CHUNK_BYTES frames."""
        if timeout == -1.0:
            timeout = None if request.waits else self.timeout
        if isinstance(request, PutRequest):
            self._send_put(request)
        else:
            self._frame({"cmd": request.op, "args": request.to_wire()})
        return cast(R, type(request).reply.from_wire(self._reply(timeout=timeout)))

    def raw(self, cmd: str, args: WireMap | None = None, *, timeout: float | None = -1.0) -> Any:
        """One request as a bare map and its result as the daemon sent it: for tests and tools
        that look at the wire itself. Code sends typed requests with `send`."""
        self._frame({"cmd": cmd, "args": args or {}})
        return self._reply(timeout=self.timeout if timeout == -1.0 else timeout)

    def _send_put(self, request: PutRequest) -> None:
        blob = request.blob if request.blob is not None else b""
        args = {**request.to_wire(), "blob": None}
        if len(blob) <= protocol.CHUNK_BYTES:
            args["blob"] = bytes(blob)
            self._frame({"cmd": request.op, "args": args})
            return
        self._frame({"cmd": request.op, "args": args})
        view = memoryview(blob)
        try:
            for i in range(0, len(blob), protocol.CHUNK_BYTES):
                self._frame({"data": bytes(view[i : i + protocol.CHUNK_BYTES])})
        except DaemonError:
            self._reply(timeout=self.timeout)  # it refused early: raise its reason instead
            raise

    def _frame(self, obj: WireMap) -> None:
        self.sock.settimeout(self.timeout)
        try:
            protocol.send(self.sock, obj)
        except OSError as e:
            raise DaemonError(f"{self.path}: the daemon went away ({e})") from None

    def _reply(self, *, timeout: float | None) -> Any:
        try:
            msg = protocol.recv(self.sock, timeout=timeout, frame_timeout=self.timeout)
        except ProtocolError as e:
            raise DaemonError(f"{self.path}: bad reply from the daemon: {e}") from None
        if msg is None:
            raise DaemonError(f"{self.path}: the daemon closed the connection")
        if not msg.get("ok"):
            text = str(msg.get("error", "the daemon refused the request"))
            raise DaemonError(text, code=code_of(msg.get("code")))
        return msg.get("result")


BUSY = "too many connections"  # what the daemon says when it refuses one over max_connections


def connect(home: str | Path | None = None, *, timeout: float = 30.0) -> DaemonClient | None:
    """A client when a daemon answers on this home's socket; None (quickly) when none does.

    Raises DaemonError when a daemon answers but refuses the connection (at its connection cap)
    or speaks another protocol version: the caller must not take that for "no daemon" and write
    the store as a second writer.
    """
    try:
        path = socket_path(home)
    except KVStoreError:
        return None
    if not path.exists():
        return None
    try:
        client = DaemonClient(home, timeout=2.0)
    except OSError:
        return None  # a stale socket from a killed daemon, or none listening yet
    try:
        try:
            client._frame({"cmd": PingRequest.op, "args": {}})
        except DaemonError:
            pass  # a refusal is sent and the socket closed at once: its reason may be waiting
        info = client.info = PingReply.from_wire(client._reply(timeout=2.0))
    except DaemonError as e:
        client.close()
        if e.code is ErrorCode.BUSY:
            raise DaemonError(f"daemon at {path} is busy ({BUSY}); try again") from None
        return None  # it went away (stopping) or is not a daemon of ours
    except OSError:
        client.close()
        return None
    if info.protocol != PROTOCOL_VERSION:  # checked here, once: no request adapts after
        client.close()
        raise DaemonError(
            f"the daemon at {path} speaks protocol version {info.protocol or 1}, this "
            f"kvstore {PROTOCOL_VERSION}: restart the daemon with this version",
            code=ErrorCode.PROTOCOL,
        )
    client.timeout = timeout
    return client


class DaemonNotAnswering(DaemonError):
    """A daemon holds the home's lock (so it owns the store) but does not answer on its socket:
    stopped (SIGSTOP), hung, or still starting. Nothing may write the store beside it."""

    def __init__(self, pid: int, home: Path):
        self.pid = pid
        who = f"pid {pid}" if pid else "pid unknown"
        super().__init__(
            f"the daemon ({who}) holds this store but does not answer: it is stopped, hung or "
            f"still starting ({home}); nothing was written (--wait SECONDS waits for it)"
        )


def lock_holder(home: str | Path | None) -> int | None:
    """The pid of the daemon that holds the home's lock (0 when it has not written it yet), or
    None when no process holds it. Tested with a shared flock held for an instant, never
    blocking (a daemon starting in that instant tries again: daemon/lifecycle.py)."""
    path = resolve_home(home) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file: no daemon ever ran here
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def connect_writer(
    home: str | Path | None = None, *, timeout: float = 30.0, wait: float = 0.0
) -> DaemonClient | None:
    """The daemon to send writes to, or None when no daemon holds this home (the caller may then
    write the store itself). A daemon that holds the lock but does not answer is
    DaemonNotAnswering, after waiting up to `wait` seconds for it to answer or let go: the
    caller must never write the store beside it."""
    deadline = time.monotonic() + max(0.0, wait)
    while True:
        client = connect(home, timeout=timeout)
        if client is not None:
            return client
        pid = lock_holder(home)
        if pid is None:
            return None
        if time.monotonic() >= deadline:
            raise DaemonNotAnswering(pid, resolve_home(home))
        time.sleep(0.2)
