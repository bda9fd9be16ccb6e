"""Fixtures of the framework tests: a `kvstore daemon` process of the test's own (what an
attached model writes behind to, and what a new process is served from; the frameworks render
the same turns to the same tokens, so one test's learned prefixes must not serve another's)."""

from __future__ import annotations

import pytest
from helpers import Proc, serving


@pytest.fixture
def daemon(tmp_path):
    with serving(Proc(tmp_path / "dhome", log=tmp_path / "daemon.log"), warm=False) as d:
        yield d
