"""A full disk stops a warm at the first ENOSPC: no more prefills, the rest named, exit 1."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from full_disk import DAEMON_CODE, full_open_env
from helpers import TWO_PINS, Proc, manifest_for, serving

import kvstore.store
import kvstore.warm
from kvstore.cli import main


def _assert_stopped(r) -> None:
    assert r.exit_code == 1, r.output
    err = r.output.strip().splitlines()[-1]
    assert "the disk is full, so warming stopped at pin 'classify'" in err, r.output
    assert "No space left on device" in err
    assert "left unwarmed: 'classify', 'synthesize'" in err
    assert "0 warmed, 0 present, 2 failed" in r.output


def test_warm_stops_at_the_first_enospc_without_a_daemon(
    llama_path, kv_home, tmp_path, monkeypatch
):
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    monkeypatch.setattr(kvstore.store, "open_env", full_open_env(kvstore.store.open_env))
    prefills = []
    real = kvstore.warm.prefill_pin
    monkeypatch.setattr(
        kvstore.warm, "prefill_pin", lambda *a, **kw: prefills.append(1) or real(*a, **kw)
    )
    r = CliRunner().invoke(main, ["warm", "--manifest", str(manifest), "--home", str(kv_home)])
    _assert_stopped(r)
    assert len(prefills) == 1


@pytest.mark.slow
def test_warm_through_the_daemon_stops_at_the_first_enospc(llama_path, tmp_path):
    home = tmp_path / "h"
    manifest = manifest_for(tmp_path, llama_path, TWO_PINS)
    with serving(Proc(home, log=tmp_path / "d.log", code=DAEMON_CODE), warm=False) as d:
        r = CliRunner().invoke(main, ["warm", "--manifest", str(manifest), "--home", str(home)])
        _assert_stopped(r)
        assert d.text().count("INJECTED: prefill") == 1, d.text()
        assert "warming stopped at pin 'classify'" in d.text()
