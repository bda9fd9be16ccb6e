"""`kvstore serve` at its edges, through real `kvstore serve` processes: a default model that
cannot load ends the server with one line and a non-zero exit; a model one request asks for that
cannot load answers that request with an error and the server keeps its own; the port is
range-checked."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_serve_learn import Serve

pytestmark = pytest.mark.slow

EXIT_TIMEOUT = 60.0  # seconds for a server whose model cannot load to import mlx-lm and stop


def _serve(home: Path, model: str, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvstore", "serve", "--home", str(home), "--model", model,
            "--port", "0", *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=EXIT_TIMEOUT)


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("Error:")]


@pytest.mark.parametrize("broken", ["missing", "bad_config"])
def test_a_default_model_that_cannot_load_ends_the_server_in_one_line(kv_home, tmp_path, broken):
    model = tmp_path / "m"
    if broken == "bad_config":
        model.mkdir()
        (model / "config.json").write_text("{not json")
    r = _serve(kv_home, str(model))  # before: still listening (503 "starting") at the timeout
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out, out
    lines = _error_lines(out)
    assert len(lines) == 1, out
    assert str(model) in lines[0] and "cannot load model" in lines[0], out
    if broken == "missing":
        assert "no such directory" in lines[0], out
    else:
        assert "JSONDecodeError" in lines[0], out


def test_a_port_out_of_range_is_refused(kv_home, tmp_path):
    argv = [sys.executable, "-m", "kvstore", "serve", "--home", str(kv_home), "--model",
            str(tmp_path), "--port", "99999"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=EXIT_TIMEOUT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "'--port': 99999 is not in the range 0<=x<=65535" in r.stderr


def test_a_request_for_a_model_that_cannot_load_is_answered_and_the_default_stays(
    llama_path, kv_home, tmp_path
):
    server = Serve(kv_home, llama_path, tmp_path / "serve.log", "--no-learn")
    try:
        server.wait_ready()
        before = server.chat("Where is my parcel?")
        missing = tmp_path / "nope"
        body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2, model=str(missing))
        req = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert 400 <= err.value.code < 600
        message = json.loads(err.value.read())["error"]
        assert f"cannot load model {missing}" in message and "no such directory" in message
        assert str(llama_path) in message  # still serving it
        # the default model is still loaded, hydrated pins and all: no reload, same answer
        after = server.chat("Where is my parcel?")
        assert after["choices"][0]["message"] == before["choices"][0]["message"]
        assert server.get("/health")[0] == 200
        assert server.tail().count("kvstore: ready") == 1  # loaded once, not again
        assert server.proc.poll() is None
    finally:
        server.stop()
