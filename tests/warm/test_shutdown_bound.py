"""The shutdown promise: a warm stops between prefill chunks, not only between pins."""

from __future__ import annotations

import signal

import pytest
from helpers import Proc, manifest_for, wait_for

from kvstore.errors import PrefillStopped
from kvstore.kvcheck.prefill import prefill, stop_when

STEP = 512  # the daemon below prefills in chunks this size (mlx-lm's default is 2048)


def _long_prefix(words: int = 1500) -> str:
    # ~7600 tokens with the tiny byte-level tokenizer: 15 chunks of STEP.
    return " ".join(f"w{i % 97}x{i % 13}" for i in range(words))


class Counting:
    """A real model whose forward passes are counted."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kw):
        self.calls += 1
        return self.model(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def llama(llama_path):
    from mlx_lm import load

    model, _ = load(str(llama_path))
    return model


def test_prefill_stops_before_its_next_chunk(llama):
    counted = Counting(llama)
    asked = []

    def stop() -> bool:
        asked.append(counted.calls)
        return counted.calls >= 2

    with pytest.raises(PrefillStopped, match="after 128 of 320 tokens"):
        prefill(counted, list(range(320)), step=64, should_stop=stop)
    assert counted.calls == 2 and asked == [0, 1, 2]


def test_stop_when_reaches_prefills_run_inside_it(llama):
    counted = Counting(llama)
    with stop_when(lambda: counted.calls >= 1), pytest.raises(PrefillStopped):
        prefill(counted, list(range(200)), step=64)
    assert counted.calls == 1
    assert len(prefill(counted, list(range(70)), step=64)) > 0  # outside: no stop check


_SMALL_CHUNKS = f"""
import sys
import kvstore.kvcheck.prefill
kvstore.kvcheck.prefill.prefill.__kwdefaults__["step"] = {STEP}
_quantize = kvstore.kvcheck.prefill.maybe_quantize_kv_cache
def _chunk_done(*args):  # called once per chunk: says so in the log
    _quantize(*args)
    print("prefill: chunk done", flush=True)
kvstore.kvcheck.prefill.maybe_quantize_kv_cache = _chunk_done
from kvstore.cli.main import main
main(["daemon", *sys.argv[1:]])
"""


@pytest.mark.slow
def test_sigterm_during_a_long_multi_chunk_prefill_exits_within_a_chunk(tmp_path, llama_path):
    long = (
        '[[model.prefix]]\nname = "long"\n'
        f'messages = [{{ role = "system", content = "{_long_prefix()}" }}]\n'
    )
    manifest = manifest_for(tmp_path, llama_path, long, name="pins.toml")
    log = tmp_path / "d.log"
    d = Proc(tmp_path / "h", "--manifest", str(manifest), log=log, code=_SMALL_CHUNKS)
    wait_for(lambda: d.text().count("prefill: chunk done") >= 2, what=d.text)  # of ~15 chunks
    rc, seconds = d.stop(signal.SIGTERM)  # Proc.stop SIGKILLs after 10 s
    assert rc == 0, d.text()
    assert seconds < 5, f"{seconds:.1f}s:\n{d.text()}"
    assert "cancelled: the daemon is stopping" in d.text()
    # the pin was said before its prefill, and never finished
    said = [x for x in d.text().splitlines() if "[1/1]" in x]
    assert len(said) == 1 and said[0].endswith(":: long: prefilling 7,632 tokens"), d.text()
