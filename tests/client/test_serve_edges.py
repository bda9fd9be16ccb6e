"""`kvstore serve` at its edges, through real `kvstore serve` processes: a default model that
cannot load ends the server with one line and a non-zero exit; a model one request asks for that
cannot load answers that request with an error and the server keeps its own; the port is
range-checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import CLASSIFY, Proc, Serve, manifest_for, serving, wait_for, warm_two_pins

from bench.learned import Server as BenchServer
from bench.learned import free_port

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


# -- what serve serves reaches the store: hits, last used, the prefill ledger -----------------


def _ls(home: Path) -> dict[str, dict]:
    out = subprocess.run([sys.executable, "-m", "kvstore", "ls", "--json", "--home", str(home)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {e["label"]: e for e in json.loads(out)}


def _ledger(home: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--json", "--home", str(home)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return json.loads(out)["ledger"]["by_model_label"]


def test_requests_served_from_a_pin_count_as_its_hits_and_in_the_ledger(
    llama_path, kv_home, tmp_path
):
    warm_two_pins(tmp_path, kv_home, llama_path)
    before = _ls(kv_home)["classify"]
    n = 3
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        server = Serve(kv_home, llama_path, tmp_path / "serve.log")
        try:
            server.wait_ready()
            for i in range(n):
                reply = server.chat(f"My invoice {i} was charged twice.", system=CLASSIFY)
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= before["tokens"]
            # batched as the library's hits are: they reach the store within seconds, no stop
            wait_for(lambda: _ls(kv_home)["classify"]["hits"] == before["hits"] + n, 30.0,
                     server.tail, proc=server.proc)  # fmt: skip
            after = _ls(kv_home)
            assert after["classify"]["last_used"] > before["last_used"]
            assert after["synthesize"]["hits"] == before["hits"]  # not used: not touched
            rows = wait_for(lambda: [r for r in _ledger(kv_home) if r["label"] == "serve:classify"],
                            30.0, server.tail, proc=server.proc)  # fmt: skip
            assert rows[0]["calls"] == n and rows[0]["model"] == str(llama_path)
            assert rows[0]["cached_tokens"] >= n * before["tokens"]
        finally:
            assert server.stop() == 0, server.tail()


RAW = (
    "Ticket triage. Read the ticket below and answer with one word: billing, shipping, returns, "
    "account or other. Billing covers invoices and refunds; shipping covers parcels and tracking."
)


def _complete(server, prompt: str) -> dict:
    body = json.dumps(dict(prompt=prompt, max_tokens=1, temperature=0.0)).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_a_request_equal_to_or_a_prefix_of_a_text_pin_is_labelled_with_it(
    llama_path, kv_home, tmp_path
):
    # issue 43 item 8: only requests longer than the pin were `serve:rawtext`; mlx-lm prefills
    # a whole prompt's last token, so one equal to the pin (or a prefix of it) read as unserved
    from mlx_lm.utils import load_tokenizer

    from kvstore.ops.warm import warm
    from kvstore.pins.manifest import load_manifest
    from kvstore.store.store import Store

    manifest = manifest_for(
        tmp_path, llama_path, f'[[model.prefix]]\nname = "rawtext"\ntext = "{RAW}"'
    )
    with Store(kv_home) as store:
        assert warm(load_manifest(manifest), store, home=kv_home).warmed == 1
    tok = load_tokenizer(llama_path)
    whole = tok.encode(RAW)
    head = next(RAW[:i] for i in range(len(RAW) // 2, len(RAW)) if RAW[i] == " "
                and whole[: len(tok.encode(RAW[:i]))] == tok.encode(RAW[:i]))  # fmt: skip
    prompts = {"equal": RAW, "prefix": head, "longer": RAW + " Ticket: my parcel is late."}
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        server = Serve(kv_home, llama_path, tmp_path / "serve.log")
        try:
            server.wait_ready()
            for what, prompt in prompts.items():
                reply = _complete(server, prompt)
                n = reply["usage"]["prompt_tokens"]
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= min(
                    n - 1, len(whole)
                ), (what, reply["usage"])
            wait_for(lambda: sum(r["calls"] for r in _ledger(kv_home)) == 3, 30.0, server.tail,
                     proc=server.proc)  # fmt: skip
            rows = _ledger(kv_home)
        finally:
            assert server.stop() == 0, server.tail()
    assert [(r["label"], r["calls"]) for r in rows] == [("serve:rawtext", 3)], rows


# -- /metrics' learned gauges ------------------------------------------------------------------

FP = bytes(range(16))


def _put_records(home: Path, n_tokens: int) -> int:
    """Learned records of `n_tokens` tokens, written as the daemon writes them; their bytes."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore.learned.blockstore import BlockStore
    from kvstore.learned.chain import cuts
    from kvstore.learned.records import slice_record
    from kvstore.store.store import Store

    c = KVCache()
    x = mx.arange(n_tokens * 8, dtype=mx.float32).reshape(1, 1, n_tokens, 8)
    c.update_and_fetch(x, -x)
    recs = [(s, e, slice_record([c], s, e)) for s, e in cuts(0, n_tokens)]
    with Store(home) as store:
        return BlockStore(store).put_records(FP, list(range(1, n_tokens + 1)), recs, label="x")


def _gauges(server) -> dict[str, float]:
    _, body = server.get("/metrics")
    out = {}
    for line in body.decode().splitlines():
        if line.startswith("kvstore_learn") and not line.startswith("#"):
            name, value = line.split()
            out[name] = float(value)
    return out


def test_metrics_learned_gauges_are_the_stores(llama_path, kv_home, tmp_path):
    kv_home.mkdir(parents=True, exist_ok=True)
    (kv_home / "settings.toml").write_text("learned_max_bytes = 123456789\n")
    nbytes = _put_records(kv_home, 800)
    server = Serve(kv_home, llama_path, tmp_path / "serve.log", "--no-learn")
    try:
        server.wait_ready()
        g = _gauges(server)  # before: 0, 0, 0 (only the daemon set them)
        assert (
            g["kvstore_learned_records"] == 4
        )  # cut at 256: [0,256) [256,512) [512,768) [768,800)
        assert g["kvstore_learned_bytes"] == nbytes > 0
        assert g["kvstore_learned_budget_bytes"] == 123456789
        more = _put_records_more(kv_home)
        # re-read within a few seconds of a scrape, not on every scrape
        wait_for(lambda: _gauges(server)["kvstore_learned_bytes"] == nbytes + more, 30.0,
                 server.tail, proc=server.proc)  # fmt: skip
    finally:
        server.stop()


def _put_records_more(home: Path) -> int:
    """The chain of _put_records grown by 300 tokens: [800, 1024) and [1024, 1100) more."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore.learned.blockstore import BlockStore
    from kvstore.learned.chain import cuts
    from kvstore.learned.records import slice_record
    from kvstore.store.store import Store

    c = KVCache()
    x = mx.arange(1100 * 8, dtype=mx.float32).reshape(1, 1, 1100, 8)
    c.update_and_fetch(x, -x)
    recs = [(s, e, slice_record([c], s, e)) for s, e in cuts(800, 1100)]
    with Store(home) as store:
        return BlockStore(store).put_records(FP, list(range(1, 1101)), recs, label="x")


def test_learned_gauges_read_the_store_at_most_once_per_refresh(kv_home, monkeypatch):
    from kvstore import metrics
    from kvstore.client.serve.gauges import LearnedGauges
    from kvstore.store.store import Store

    nbytes = _put_records(kv_home, 800)
    scans = []
    plain = Store.metas
    monkeypatch.setattr(
        Store, "metas", lambda self, *a, **kw: scans.append(1) or plain(self, *a, **kw)
    )
    gauges = LearnedGauges(kv_home, refresh_s=3600)
    for _ in range(50):  # scrapes
        gauges.refresh()
    assert gauges.reads == 1 and len(scans) == 1
    assert metrics.LEARNED_BYTES._value.get() == nbytes
    gauges.refresh(force=True)  # entries unchanged: the snapshot sum is not taken again
    assert gauges.reads == 2 and len(scans) == 1
    gauges.close()


# -- the first request after a start: warm-up requests through the server before /health ------


def test_warm_up_requests_go_through_the_server_before_health_and_leave_nothing(
    llama_path, kv_home, tmp_path
):
    pins = warm_two_pins(tmp_path, kv_home, llama_path)
    before = _ls(kv_home)
    log = tmp_path / "serve.log"
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False) as d:
        server = Serve(kv_home, llama_path, log)
        try:
            server.wait_ready()
            text = log.read_text()
            ready_at = text.index("kvstore: ready")
            # one request per pin through the server's own HTTP handler, before /health said 200
            assert text[:ready_at].count('"POST /v1/chat/completions HTTP/1.1" 200') == len(pins)
            assert '"GET /health HTTP/1.1" 200' not in text[:ready_at]
            assert "2 warm-up requests through the server" in text
            # not counted: no prompt tokens in /metrics yet
            _, body = server.get("/metrics")
            counts = [line for line in body.decode().splitlines()
                      if line.startswith("kvstore_prompt_tokens_total")]  # fmt: skip
            assert counts and all(float(c.split()[-1]) == 0 for c in counts), counts
            # nothing left in the prompt cache: the first request sees the two pins only
            reply = server.chat("My invoice 7 was charged twice.", system=CLASSIFY)
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == pins["classify"].ntokens
            after_ready = log.read_text()[ready_at:]
            assert "Prompt Cache: 2 sequences" in after_ready.split("POST /v1/chat")[0]
        finally:
            assert server.stop() == 0, server.tail()
        ledger = _ledger(kv_home)
        assert [r["calls"] for r in ledger if r["label"].startswith("serve")] == [1]  # the one
        learned = d.request("stats").get("learned") or {}
        assert not learned.get("records") and not learned.get("snapshots")
    after = _ls(kv_home)
    assert after["synthesize"]["hits"] == before["synthesize"]["hits"]  # warmed up, not a hit
    assert after["classify"]["hits"] == before["classify"]["hits"] + 1  # the real request


def test_the_imports_are_frozen_before_mlx_lm_loads_the_model(kv_home, monkeypatch):
    """mlx-lm's model load begins with a full gc.collect() (to free the last model), which walked
    every object the imports made (36-60 ms of each start). `kvstore serve` freezes them first,
    so that collection, and each later full one, skips them; nothing is frozen after main()
    starts, so the model and the requests' objects are collected as before."""
    import gc

    from mlx_lm import server as mlx_server

    from kvstore.client.cli import serve

    seen: dict = {}

    def main() -> None:  # stands in for mlx_lm.server.main, which loads the model first
        seen["frozen"] = gc.get_freeze_count()
        seen["argv"] = list(sys.argv)

    monkeypatch.setattr(mlx_server, "main", main)
    gc.unfreeze()
    try:
        serve("some/model", home=kv_home, port=0)
        frozen_after = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert seen["argv"] == ["mlx_lm.server", "--model", "some/model", "--port", "0"]
    assert seen["frozen"] > 10_000, seen  # before: 0, and the load's collection walked them all
    assert frozen_after <= seen["frozen"]  # nothing frozen once the server runs (some freed)


# -- a prompt the store holds whole; a generation thread that dies ------------------------------

WHOLE = "You are a helpful assistant. Answer every question in one short sentence."


def _complete(server: Serve, prompt: str) -> dict:
    body = json.dumps(dict(prompt=prompt, max_tokens=3, temperature=0.0)).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_a_prompt_stored_whole_is_served_and_the_server_stays_up(llama_path, kv_home, tmp_path):
    """A text pin sent as it is to /v1/completions: every prompt token is stored. mlx-lm's
    generation thread died on the empty remainder ("Sequence N has an empty prompt") and every
    later request failed; now the last token is prefilled and the server goes on."""
    manifest = manifest_for(
        tmp_path, llama_path, f'[[model.prefix]]\nname = "whole"\ntext = "{WHOLE}"'
    )
    r = subprocess.run([sys.executable, "-m", "kvstore", "warm", "--home", str(kv_home),
                        "--manifest", str(manifest)], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    pin = _ls(kv_home)["whole"]
    server = Serve(kv_home, llama_path, tmp_path / "serve.log", "--no-learn")
    try:
        server.wait_ready()
        for _ in range(2):  # a user resends the prompt it already sent
            reply = _complete(server, WHOLE)
            assert reply["usage"]["prompt_tokens"] == pin["tokens"], reply  # stored whole
            assert reply["choices"][0]["text"], reply
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == pin["tokens"] - 1
        assert server.get("/health")[0] == 200
        assert "empty prompt" not in server.tail(20000)
    finally:
        assert server.stop() == 0, server.tail()


_DIES = """
import os
from mlx_lm.models.cache import LRUPromptCache
fetch = LRUPromptCache.fetch_nearest_cache
def boom(self, model, tokens):  # on the generation thread, outside its try
    if os.path.exists(os.environ["BREAK"]):  # once the test says so: serve's warm-up passes
        raise RuntimeError("the test broke it")
    return fetch(self, model, tokens)
LRUPromptCache.fetch_nearest_cache = boom
from kvstore.cli.main import main
main()
"""


def _break_generation(code: str, llama_path, kv_home, tmp_path) -> tuple[int, str]:
    """Serve through `code`, break its generation thread once it is ready, send a chat; the
    exit code and the log. Before the fixes each names: alive, /health 503 forever."""
    port = free_port()
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-c", code, "serve", "--home", str(kv_home), "--model",
            str(llama_path), "--port", str(port), "--no-learn"]  # fmt: skip
    server = BenchServer(argv, port, log, env={**os.environ, "BREAK": str(tmp_path / "break")})
    try:
        server.wait_ready()
        (tmp_path / "break").touch()
        with pytest.raises((urllib.error.URLError, ConnectionError, TimeoutError)):
            server.chat([{"role": "user", "content": "hello"}])
        code_ = server.proc.wait(timeout=EXIT_TIMEOUT)
    finally:
        server.stop()
    return code_, log.read_text()


def test_a_generation_thread_that_dies_ends_the_server_in_one_line(llama_path, kv_home, tmp_path):
    code, out = _break_generation(_DIES, llama_path, kv_home, tmp_path)
    assert code == 1, out
    lines = _error_lines(out)
    assert len(lines) == 1, out
    assert "generation thread died: RuntimeError: the test broke it" in lines[0], out


_STUCK = (
    """
import os, threading
from mlx_lm import server
from kvstore.client.serve import hooks
hooks.STOP_GRACE_S = 3.0
server.ResponseGenerator.stop_and_join = lambda self: threading.Event().wait()  # never returns
"""
    + _DIES
)


def test_a_server_told_to_stop_that_cannot_exits_in_one_line(llama_path, kv_home, tmp_path):
    """The failsafe: when whatever mlx-lm waits for on its way out never ends (here its
    generation thread's join), the server still exits 1 with its one line, STOP_GRACE_S after
    it was told to stop, instead of listening on, dead, with /health at 503."""
    code, out = _break_generation(_STUCK, llama_path, kv_home, tmp_path)
    assert code == 1, out
    lines = _error_lines(out)
    assert len(lines) == 1, out
    assert "generation thread died" in lines[0] and "told to stop: exiting" in lines[0], out


_HELD = """
import os, time
from kvstore.client.serve import hooks
warm = hooks._Hooks.send_warm_ups
def held(self, provider):  # the warm-up waits for the test's word
    while not os.path.exists(os.environ["GO"]):
        time.sleep(0.02)
    return warm(self, provider)
hooks._Hooks.send_warm_ups = held
from kvstore.cli.main import main
main()
"""


def _status(port: int, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def test_no_route_answers_before_the_server_is_ready(llama_path, kv_home, tmp_path):
    """/v1/models (what OpenAI clients and load balancers poll) answered, and requests ran beside
    the warm-up at several times a steady request's cost, while only /health waited."""
    port = free_port()
    go = tmp_path / "go"
    argv = [sys.executable, "-c", _HELD, "serve", "--home", str(kv_home), "--model",
            str(llama_path), "--port", str(port), "--no-learn"]  # fmt: skip
    server = BenchServer(argv, port, tmp_path / "serve.log", env={**os.environ, "GO": str(go)})
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    try:
        wait_for(lambda: _said(port), EXIT_TIMEOUT, server.tail, proc=server.proc)
        for path, body in (("/health", None), ("/v1/models", None), ("/v1/chat/completions", chat)):
            code, headers = _status(port, path, body)
            assert (code, headers.get("Retry-After")) == (503, "1"), (path, server.tail())
        go.touch()
        server.wait_ready()
        assert _status(port, "/v1/models")[0] == 200
        assert _status(port, "/v1/chat/completions", chat)[0] == 200
    finally:
        go.touch()
        assert server.stop() == 0, server.tail()


def _said(port: int) -> bool:
    try:
        return _status(port, "/health")[0] == 503
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def _start_log(home: Path, model: Path, log: Path, *extra: str) -> str:
    """What `kvstore serve` logs by the time it is ready, then stopped."""
    server = Serve(home, model, log, *extra)
    try:
        server.wait_ready()
    finally:
        server.stop()
    return log.read_text()


def test_start_warnings_name_serves_option_and_the_identity_part_that_differs(
    llama_path, kv_home, tmp_path
):
    # issue 43 item 8: "raise max_size" named no option of serve; a --kv-bits 8 start said
    # "weights, config, adapter or KV quantization differ"
    from kvstore.store.store import Store

    warm_two_pins(tmp_path, kv_home, llama_path)
    with Store(kv_home) as store:  # unpinned: they go into the LRU, which holds one
        store.edit_meta({m.key: (lambda m: replace(m, pinned=False)) for m in store.metas()})
    out = _start_log(kv_home, llama_path, tmp_path / "a.log", "--prompt-cache-size", "1")
    assert "1 of 2 hydrated entries did not stay" in out, out
    assert "(--prompt-cache-size 1," in out and "raise --prompt-cache-size to keep" in out, out
    assert "max_size" not in out, out
    if (
        "--kv-bits"
        not in subprocess.run(
            [sys.executable, "-m", "mlx_lm.server", "--help"], capture_output=True, text=True
        ).stdout
    ):
        return  # mlx-lm 0.31's server takes no --kv-bits
    out = _start_log(kv_home, llama_path, tmp_path / "b.log", "--kv-bits", "8")
    assert "2 stored entries" in out and "(what differs: KV quantization)" in out, out
    assert "weights" not in out, out
