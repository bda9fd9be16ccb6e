"""Small test helpers shared by several test files (not fixtures)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.warm.warm import warm
from kvstore.wire.daemon_client import DaemonClient, connect


def manifest_for(
    tmp: Path, model: Path, prefixes: str, *, extra: str = "", name: str = "manifest.toml"
) -> Path:
    path = tmp / name
    path.write_text(f'[[model]]\npath = "{model}"\n{extra}\n{prefixes}')
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
        deadline = time.monotonic() + START_TIMEOUT
        while (c := connect(self.home)) is None:
            assert self.p.poll() is None, f"daemon exited {self.p.returncode}:\n{self.text()}"
            assert time.monotonic() < deadline, f"daemon did not answer:\n{self.text()}"
            time.sleep(0.05)
        c.close()

    def request(self, cmd: str, **args):
        with DaemonClient(self.home) as c:
            return c.request(cmd, **args)

    def wait_warm(self) -> dict:
        deadline = time.monotonic() + START_TIMEOUT
        while (w := self.request("stats")["daemon"]["last_warm"]) is None:
            assert time.monotonic() < deadline, self.text()
            time.sleep(0.05)
        return w

    def wait_log(self, text: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.text():
            assert time.monotonic() < deadline, f"{text!r} not logged:\n{self.text()}"
            time.sleep(0.05)

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
