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
from typing import Any

import xxhash

from kvstore.errors import DaemonError, KVStoreError, ProtocolError
from kvstore.settings import LOCK_NAME, SOCKET_NAME, resolve_home
from kvstore.store.entry import EntryMeta, blob_checksum
from kvstore.wire import protocol
from kvstore.wire.codes import ErrorCode, code_of, legacy_code
from kvstore.wire.messages import OPS, Message, PingReply

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
    """One connection to the daemon. Use as a context manager.

    >>> with DaemonClient(home) as c:
    ...     c.ping()
    """

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

    def call(
        self, cmd: str, args: dict[str, Any] | None = None, *, timeout: float | None = -1.0
    ) -> Any:
        """Send one request and return its result; `timeout` None waits as long as it takes."""
        self.send({"cmd": cmd, "args": args or {}})
        return self.reply(timeout=self.timeout if timeout == -1.0 else timeout)

    def request(self, cmd: str, /, **args: Any) -> Any:
        return self.call(cmd, args)

    def send(self, obj: dict[str, Any]) -> None:
        self.sock.settimeout(self.timeout)
        try:
            protocol.send(self.sock, obj)
        except OSError as e:
            raise DaemonError(f"{self.path}: the daemon went away ({e})") from None

    def reply(self, *, timeout: float | None) -> Any:
        try:
            msg = protocol.recv(self.sock, timeout=timeout, frame_timeout=self.timeout)
        except ProtocolError as e:
            raise DaemonError(f"{self.path}: bad reply from the daemon: {e}") from None
        if msg is None:
            raise DaemonError(f"{self.path}: the daemon closed the connection")
        if not msg.get("ok"):
            text = str(msg.get("error", "the daemon refused the request"))
            # A daemon of protocol version 1 sends no code: its text is read, here only.
            code = code_of(msg["code"]) if "code" in msg else legacy_code(text)
            raise DaemonError(text, code=code)
        return msg.get("result")

    def op(self, name: str, request: Message | None = None, *, timeout: float | None = -1.0):
        """One operation of kvstore.wire.messages.OPS: its request sent, its reply typed."""
        result = self.call(name, request.to_wire() if request is not None else {}, timeout=timeout)
        return OPS[name][1].from_wire(result)

    # -- commands -----------------------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        return self.request("ping")

    info: PingReply | None = None  # what the daemon answered to connect()'s ping

    def supports(self, name: str) -> bool | None:
        """Whether the daemon has this operation (None: its ping did not say, version 1)."""
        if self.info is None or self.info.protocol < 2:
            return None
        return name in self.info.ops

    def put(self, key: bytes, blob: bytes, fields: dict[str, Any]) -> EntryMeta:
        """Store an entry through the daemon; blobs over one chunk stream in CHUNK_BYTES frames.
        The model is located here, in the putting process's cwd and environment (the daemon's
        may resolve a relative path or hub id to something else, or not at all)."""
        # the store's write path, imported by a put only: `kvstore ls`/`stats` start without it
        from kvstore.store.store import with_model_location

        fields = with_model_location(fields)
        args = {"key": key, "fields": fields, "nbytes": len(blob), "checksum": blob_checksum(blob)}
        view = memoryview(blob)
        if len(blob) <= protocol.CHUNK_BYTES:
            args["blob"] = bytes(view)
            self.send({"cmd": "put", "args": args})
        else:
            self.send({"cmd": "put", "args": args})
            try:
                for i in range(0, len(blob), protocol.CHUNK_BYTES):
                    self.send({"data": bytes(view[i : i + protocol.CHUNK_BYTES])})
            except DaemonError:
                self.reply(timeout=self.timeout)  # it refused early: raise its reason instead
                raise
        res = self.reply(timeout=None)  # the put queues behind any warm in progress
        return EntryMeta.unpack(res["key"], res["meta"])

    def warm(self, manifest: str | Path) -> dict[str, Any]:
        """Reconcile a manifest in the daemon and return its report (as a map; see
        kvstore.ops.warm `report_from_wire`). Waits for the warm, however long it takes."""
        res = self.call("warm", {"manifest": str(Path(manifest).absolute())}, timeout=None)
        return res["reports"][0]


class DaemonWriter:
    """A Store-shaped `put` that goes through the daemon (for code written against Store)."""

    def __init__(self, client: DaemonClient):
        self.client = client

    def put(self, key: bytes, blob: bytes, **fields: Any) -> EntryMeta:
        return self.client.put(key, blob, fields)


BUSY = "too many connections"  # what the daemon says when it refuses one over max_connections


def connect(home: str | Path | None = None, *, timeout: float = 30.0) -> DaemonClient | None:
    """A client when a daemon answers on this home's socket; None (quickly) when none does.

    Raises DaemonError when a daemon answers but refuses the connection (at its connection cap):
    the caller must not take that for "no daemon" and write the store as a second writer.
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
            client.send({"cmd": "ping", "args": {}})
        except DaemonError:
            pass  # a refusal is sent and the socket closed at once: its reason may be waiting
        client.info = PingReply.from_wire(client.reply(timeout=2.0))
    except DaemonError as e:
        client.close()
        if e.code is ErrorCode.BUSY:
            raise DaemonError(f"daemon at {path} is busy ({BUSY}); try again") from None
        return None  # it went away (stopping) or is not a daemon of ours
    except OSError:
        client.close()
        return None
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
