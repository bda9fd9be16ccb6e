"""What several test areas share (not fixtures): the one manifest writer, the pins most tests warm,
KV comparisons, the one CLI runner, the one wait helper, a daemon and `kvstore serve` as real
processes, and the date-first system prompt the reasons tests send."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from click.testing import CliRunner, Result
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

from bench.learned import Server as BenchServer
from bench.learned import free_port
from kvstore.cli.main import main
from kvstore.ops.put import LocalWriter
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.entry import EntryMeta
from kvstore.store.store import Store
from kvstore.tiny import make_tiny_model
from kvstore.warm.transfer import import_file
from kvstore.wire.daemon_client import DaemonClient, connect


def import_here(store: Store, file: Path, **kw) -> EntryMeta:
    """`kvstore import` with no daemon: the entry stored by the put operation on `store`."""
    return import_file(LocalWriter(store, kw["home"]), file, reader=store, **kw)


def manifest_for(
    tmp: Path, model: Path, prefixes: str, *, extra: str = "", name: str = "manifest.toml"
) -> Path:
    """`tmp/name`: a manifest of one [[model]] at `model` (its keys in `extra`) and `prefixes`."""
    path = tmp / name
    path.write_text(f'[[model]]\npath = "{model}"\n{extra}\n{prefixes}')
    return path


def tiny_model(models_dir: Path, arch: str) -> Path:
    """`models_dir/arch`: a tiny generated model of `arch`, made on first use."""
    path = models_dir / arch
    if not (path / "config.json").is_file():
        make_tiny_model(path, arch)
    return path


CLASSIFY = (
    "You are the router. Classify the request into one of billing, outage, account or other, "
    "and answer with JSON only. Quote the words that decided it, keep the reason under twenty "
    "words, and when the request mentions several topics pick the one the user asks you to act "
    "on first."
)
SYNTHESIZE = (
    "You are the writer. Turn the approved plan into a short, friendly reply with the next step "
    "first. Use plain words and short sentences, one idea each, no jargon, and sign as the support "
    "team; never promise refunds or credits without a human."
)
TWO_PINS = f"""
[[model.prefix]]
name = "classify"
messages = [{{ role = "system", content = "{CLASSIFY}" }}]

[[model.prefix]]
name = "synthesize"
messages = [{{ role = "system", content = "{SYNTHESIZE}" }}]
"""


def states(cache: list) -> list:
    """Every array in a prompt cache's state, flattened (None and scalars skipped)."""
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]


def live_states(cache: list) -> list:
    """The live part of each layer's state: keys/values sliced to the offset, other arrays as is."""
    out = []
    for c in cache:
        name = type(c).__name__
        if name in ("KVCache",) and c.keys is not None:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        elif name == "QuantizedKVCache" and c.keys is not None:
            out += [x[..., : c.offset, :] for x in (*c.keys, *c.values)]
        else:
            out += states([c])
    return out


def assert_same_kv(a: list, b: list) -> None:
    assert [type(c).__name__ for c in a] == [type(c).__name__ for c in b]
    la, lb = live_states(a), live_states(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert mx.array_equal(x, y).item(), "hydrated KV differs from a fresh prefill"


# -- the CLI and waiting --------------------------------------------------------------------------

WAIT_TIMEOUT = 60.0  # generous: a busy machine is slow, and a broken feature still fails


def cli(*args, code: int | None = None, **invoke) -> Result:
    """`kvstore ARGS` run in this process (click's CliRunner), each argument str()-ed. An exception
    other than the exit propagates with its traceback; with `code`, the exit status is asserted."""
    invoke = {"catch_exceptions": False, **invoke}
    result = CliRunner().invoke(main, [str(a) for a in args], **invoke)
    if code is not None:
        assert result.exit_code == code, result.output
    return result


def wait_for(
    cond: Callable[[], object],
    timeout: float = WAIT_TIMEOUT,
    what: str | Callable[[], str] = "",
    *,
    proc: subprocess.Popen | None = None,
):
    """Poll `cond` until it returns something true and return that; fail after `timeout` seconds,
    or as soon as `proc` (a child the condition depends on) has exited. `what` (or what it returns,
    read only on failure: a daemon's log, say) is the failure's message."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} while waiting: {_said(what)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting: {_said(what)}")
        time.sleep(0.05)
    return value


def _said(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what


# -- a daemon as a real process (test_daemon and the reliability battery) ----------------------

START_TIMEOUT = 60.0


class Proc:
    """A `kvstore daemon` child process and its log."""

    def __init__(self, home: Path, *args: str, log: Path, preexec_fn=None, code: str = ""):
        """`code`, if given, is run with `python -c` instead of `kvstore daemon` (a daemon with
        a patched call, say); `preexec_fn` runs in the child before exec (rlimits)."""
        self.home, self.log = home, log
        argv = ["-c", code] if code else ["-m", "kvstore", "daemon"]
        with log.open("ab") as f:
            self.p = subprocess.Popen(
                [sys.executable, *argv, "--home", str(home), *args],
                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                preexec_fn=preexec_fn,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.p.pid

    def text(self) -> str:
        return self.log.read_text()

    def wait_ready(self) -> None:
        wait_for(lambda: connect(self.home), START_TIMEOUT, self.text, proc=self.p).close()

    def request(self, cmd: str, **args):
        with DaemonClient(self.home) as c:
            return c.raw(cmd, args)

    def wait_warm(self) -> dict:
        return wait_for(lambda: self.request("stats")["daemon"]["last_warm"], START_TIMEOUT,
                        self.text, proc=self.p)  # fmt: skip

    def next_warm(self, after: float) -> dict:
        """The first reconcile that ends after the one at `after` (its `last_warm`)."""

        def newer():
            w = self.request("stats")["daemon"]["last_warm"]
            return w if w is not None and w["at"] != after else None

        return wait_for(newer, START_TIMEOUT, self.text, proc=self.p)

    def wait_log(self, text: str, timeout: float = WAIT_TIMEOUT) -> None:
        wait_for(lambda: text in self.text(), timeout, lambda: f"{text!r} in:\n{self.text()}")

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, float]:
        t = time.monotonic()
        self.p.send_signal(sig)
        try:
            rc = self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
        return rc, time.monotonic() - t

    def rss(self) -> int:
        """The daemon's resident memory now, in bytes (Linux /proc)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


@contextmanager
def serving(d: Proc, *, warm: bool = True) -> Iterator[Proc]:
    """A started daemon for the block (its boot warm done when `warm`), then SIGTERM: it must
    exit 0."""
    try:
        d.wait_ready()
        if warm:
            d.wait_warm()
        yield d
    finally:
        rc, _ = d.stop()
    assert rc == 0, d.text()


def warm_two_pins(tmp_path, home, model_path, extra=""):
    manifest = load_manifest(manifest_for(tmp_path, model_path, TWO_PINS, extra=extra))
    with Store(home) as store:
        report = warm(manifest, store, home=home)
        metas = {m.label: m for m in store.metas()}
    assert report.warmed == 2 and not report.failed
    return metas


def chat(tokenizer, system: str, user: str) -> list[int]:
    """A system prompt and a user turn as a request's token ids, rendered as mlx_lm.server does."""
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return tokenizer.encode(text, add_special_tokens=False)


def mlx_lm_prefill(model, tokens, quant: dict | None = None) -> list:
    """The reference, from mlx-lm's own pieces: one forward pass into make_prompt_cache, then
    generate's maybe_quantize_kv_cache (kvstore's prefill is not used to check itself)."""
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    if quant:
        maybe_quantize_kv_cache(cache, quant["quantized_kv_start"], quant["kv_group_size"],
                                quant["kv_bits"])  # fmt: skip
    mx.eval([c.state for c in cache])
    return cache


# a daemon that stops before it makes its store (it prints this, holding its lock)
_STUCK_BEFORE_ITS_STORE = """
import sys, time
from kvstore.store.entry import EntryMeta
from kvstore.store.store import Store
def stuck(self, *args, **kwargs):
    print("opening the store", flush=True)
    time.sleep(600)
Store.__init__ = stuck
from kvstore.cli.main import main
main(["daemon", *sys.argv[1:]])
"""


def killed_daemon(home: Path, log: Path, *, before_its_store: bool) -> None:
    """A real daemon on `home`, killed with SIGKILL: once it answers (its store made, nothing in
    it, its socket left behind), or `before_its_store` is made (only its lock file left)."""
    code = _STUCK_BEFORE_ITS_STORE if before_its_store else ""
    d = Proc(home, log=log, code=code)
    if before_its_store:
        d.wait_log("opening the store")
    else:
        d.wait_ready()
    d.p.send_signal(signal.SIGKILL)
    d.p.wait(timeout=10)
    assert (home / "store").exists() != before_its_store, d.text()


def corrupt_a_blob(home: Path, label: str | None = None) -> None:
    """Flip one byte in the middle of a stored blob: of the entry labelled `label`, or (None) of
    every learned block record. Lengths stay: only the checksum can tell."""
    from kvstore.learned.blockstore import BlockStore

    with Store(home) as store:
        if label is not None:
            (meta,) = [m for m in store.metas() if m.label == label]
            blob = bytearray(store.read_blob(meta.key))
            blob[len(blob) // 2] ^= 0xFF
            with store.env.begin(write=True) as txn:
                txn.put(meta.key, bytes(blob), db=store._blob)
            return
        blocks = BlockStore(store)
        db = blocks._db(b"bblob")
        with store.env.begin(write=True) as txn:
            for k, v in list(txn.cursor(db)):
                b = bytearray(v)
                b[len(b) // 2] ^= 0xFF
                txn.put(k, bytes(b), db=db)


# -- `kvstore serve` as a real process ----------------------------------------------------------

SERVE_START_TIMEOUT = 90.0  # seconds for a server to import mlx-lm, load the tiny model, answer
REQUEST_TIMEOUT = 60.0
ACK_TIMEOUT = 10.0  # seconds from the request that made a prefix learnable to its ack


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `kvstore serve` subprocess; always stopped by `stop()`."""

    def __init__(self, home: Path, model: Path, log: Path, *extra: str):
        self.port = _free_port()
        self.log = log
        cmd = [
            sys.executable,
            "-c",
            "from kvstore.cli.main import main; main()",
            "serve",
            "--home",
            str(home),
            "--model",
            str(model),
            "--port",
            str(self.port),
            *extra,
        ]
        self.out = log.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self) -> None:
        wait_for(self._healthy, SERVE_START_TIMEOUT, self.log.read_text, proc=self.proc)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def chat(self, messages: list[dict], **extra) -> dict:
        body = dict(messages=messages, max_tokens=4, temperature=0.0, **extra)
        req = urllib.request.Request(
            self.url("/v1/chat/completions"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.out.close()


SYSTEM = (
    "You are the support router of a small online shop. Read the customer's message and answer "
    "with exactly one label from this list: billing, shipping, returns, account, product, other. "
    "Billing covers invoices, double charges, refunds already approved and payment methods. "
    "Shipping covers delivery dates, tracking numbers, lost parcels and customs. Returns covers "
    "return labels, exchanges and the thirty day window. Account covers passwords, email changes "
    "and deleting an account. Product covers sizes, materials, care and stock. Anything else is "
    "other. Never explain the label, never greet, never apologise; one word, lower case. "
) * 2


class Serve(BenchServer):
    """One `kvstore serve` subprocess and its log (the benchmark's server wrapper, test-shaped)."""

    def __init__(self, home: Path, model: Path, log: Path, *extra: str):
        port = free_port()
        argv = [sys.executable, "-m", "kvstore", "serve", "--home", str(home), "--model",
                str(model), "--port", str(port), *extra]  # fmt: skip
        super().__init__(argv, port, log)

    def get(self, path: str) -> tuple[int, bytes]:
        return self._get(path)

    def wait_ready(self) -> None:
        try:
            super().wait_ready()
        except RuntimeError as e:
            raise AssertionError(str(e)) from None

    def chat(self, user: str, system: str = SYSTEM) -> dict:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return super().chat(messages, max_tokens=6)

    def metric(self, source: str) -> float:
        _, body = self.get("/metrics")
        for line in body.decode().splitlines():
            if line.startswith(f'kvstore_prompt_tokens_total{{source="{source}"}}'):
                return float(line.split()[-1])
        raise AssertionError(f"no prompt tokens metric for {source}:\n{body.decode()}")


def cached_tokens(reply: dict) -> int:
    """The prompt tokens an OpenAI-style reply says the cache served."""
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def shared_tokens(model: Path, a: str, b: str, system_b: str = SYSTEM) -> int:
    """Tokens the chat prompts of users `a` (SYSTEM) and `b` (`system_b`) share."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model)

    def ids(user: str, system: str) -> list[int]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True)

    x, y = ids(a, SYSTEM), ids(b, system_b)
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def wait_learned(d: Proc) -> dict:
    deadline = time.monotonic() + ACK_TIMEOUT
    while True:
        learned = d.request("stats").get("learned") or {}
        if learned.get("records") or learned.get("snapshots"):
            return learned
        assert time.monotonic() < deadline, f"nothing learned in {ACK_TIMEOUT}s:\n{d.text()}"
        time.sleep(0.1)


# -- a system prompt that embeds the date early (kvstore.reasons' `diverged`) --------------------

OLD, NEW = "2026-11-30", "2026-12-01"


def system(date: str) -> str:
    return f"Today is {date}. You are the router. Classify the request and answer with JSON only."


ROUTER = f"""
[[model.prefix]]
name = "router"
messages = [{{ role = "system", content = "{system(OLD)}" }}]
"""
