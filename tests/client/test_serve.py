"""`kvstore serve` through real HTTP: a real mlx_lm.server subprocess reports the warmed pin's
tokens as cached on the first request after each start, on the batched and sequential paths."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CLASSIFY, SYNTHESIZE, TWO_PINS, Server, manifest_for, wait_for

from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store

START_TIMEOUT = 90.0  # seconds for a server to import mlx-lm, load the tiny model and answer
REQUEST_TIMEOUT = 60.0

pytestmark = pytest.mark.slow


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _serve_once(home: Path, model: Path, log: Path, messages: list[dict], **extra) -> dict:
    server = Server(home, model, log)
    try:
        server.wait_ready()
        return server.chat(messages, **extra)
    finally:
        server.stop()


def _stored(home: Path, label: str) -> list:
    """The metadata of the entries labelled `label`; none while the store is not there yet."""
    with contextlib.suppress(Exception), Store(home, readonly=True) as store:
        return [m for m in store.metas() if m.label == label]
    return []


def test_first_request_after_start_is_served_from_the_store(llama_path, kv_home, tmp_path):
    manifest = load_manifest(manifest_for(tmp_path, llama_path, TWO_PINS))
    with Store(kv_home) as store:
        assert warm(manifest, store, home=kv_home).warmed == 2
        pin = {m.label: m.ntokens for m in store.metas()}["classify"]
    system = manifest.models[0].prefixes[0].messages[0]["content"]
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "My invoice 2291 was charged twice."},
    ]
    log = tmp_path / "server.log"

    # batched path (no seed), then a restart on the sequential path (a seed forces it)
    batched = _serve_once(kv_home, llama_path, log, messages)
    assert _cached(batched) >= pin, log.read_text()
    assert batched["usage"]["prompt_tokens"] > _cached(batched)
    sequential = _serve_once(kv_home, llama_path, log, messages, seed=0)
    assert _cached(sequential) >= pin, log.read_text()
    assert "kvstore: hydrated 2 entries" in log.read_text()

    # control: the same request against an empty home prefills everything
    cold = _serve_once(tmp_path / "empty-home", llama_path, log, messages)
    assert _cached(cold) == 0
    assert cold["usage"]["prompt_tokens"] == batched["usage"]["prompt_tokens"]
    # hydrated and cold runs answer the same (greedy)
    assert cold["choices"][0]["message"]["content"] == batched["choices"][0]["message"]["content"]


STAGES = {
    "classify": CLASSIFY,
    "reason": "You are the planner. Read the classified request, call the tools you need, and "
    "write a numbered plan of at most five steps; say which step needs a human and why.",
    "examine": "You are the reviewer. Check the plan against the refund policy and the account "
    "history, list every risk you find, and approve or reject it with one sentence.",
    "synthesize": SYNTHESIZE,
}


def test_pins_are_served_after_churn_past_the_prompt_cache_size(llama_path, kv_home, tmp_path):
    # Each stage's first conversation extends its pin (mlx-lm then drops the pin from the LRU as
    # a prefix of a longer trimmable entry); more calls of other stages than the LRU holds then
    # evict those conversations. A new conversation of the first stage still gets all its pin.
    prefixes = "".join(
        f'\n[[model.prefix]]\nname = "{name}"\n'
        f'messages = [{{ role = "system", content = "{text}" }}]\n'
        for name, text in STAGES.items()
    )
    manifest = load_manifest(manifest_for(tmp_path, llama_path, prefixes))
    with Store(kv_home) as store:
        assert warm(manifest, store, home=kv_home).warmed == len(STAGES)
        pins = {m.label: m.ntokens for m in store.metas()}

    def ask(stage: str, n: int) -> dict:
        messages = [
            {"role": "system", "content": STAGES[stage]},
            {"role": "user", "content": f"Ticket {n}: my invoice {1000 + n} was charged twice."},
        ]
        return server.chat(messages)

    log = tmp_path / "server.log"
    server = Server(kv_home, llama_path, log)  # mlx_lm.server's default --prompt-cache-size 10
    try:
        server.wait_ready()
        for n, stage in enumerate(STAGES):  # every pin extended by a conversation
            assert _cached(ask(stage, n)) >= pins[stage], log.read_text()
        others = [s for s in STAGES if s != "classify"]
        for n in range(12):  # churn: more calls of the other stages than the LRU holds
            stage = others[n % len(others)]
            assert _cached(ask(stage, 100 + n)) >= pins[stage], log.read_text()
        reply = ask("classify", 999)
    finally:
        server.stop()
    assert _cached(reply) >= pins["classify"], log.read_text()
    assert reply["usage"]["prompt_tokens"] > _cached(reply)


def _system_messages(n: int) -> list[dict]:
    system = f"You are reviewer {n}. Check the plan against the policy, list every risk you find."
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "Plan: refund the second charge."},
    ]


def test_persist_without_a_daemon_warns_once_and_keeps_serving(llama_path, tmp_path):
    home, log = tmp_path / "home", tmp_path / "server.log"
    server = Server(home, llama_path, log, "--persist-system-prompts")
    try:
        server.wait_ready()
        for n in range(3):  # three new system prompts, each snapshotted by the batched path
            reply = server.chat(_system_messages(n))
            assert reply["usage"]["completion_tokens"] > 0
    finally:
        server.stop()
    text = log.read_text()
    assert text.count("no daemon answers") == 1, text


def test_persisted_system_prompt_is_cached_after_a_restart(llama_path, tmp_path):
    from kvstore.wire.daemon_client import connect

    home, log = tmp_path / "home", tmp_path / "server.log"
    with (tmp_path / "daemon.log").open("wb") as dlog:
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from kvstore.cli.main import main; main()",
                "daemon",
                "--home",
                str(home),
            ],
            stdout=dlog,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: connect(home), START_TIMEOUT, "the daemon to answer", proc=daemon).close()
        messages = _system_messages(7)
        server = Server(home, llama_path, log, "--persist-system-prompts")
        try:
            server.wait_ready()
            assert _cached(server.chat(messages)) == 0
            stored = wait_for(lambda: _stored(home, "system"), REQUEST_TIMEOUT, log.read_text)
        finally:
            server.stop()
        again = _serve_once(home, llama_path, log, messages)
        assert _cached(again) >= stored[0].ntokens > 0
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)


def test_server_shape_check_names_what_changed(tmp_path):
    import types

    from mlx_lm import server

    from kvstore.client.serve.hooks import ServeError, check_server_shape, patched_server

    check_server_shape(server)  # the installed mlx-lm is the one we hook
    with pytest.raises(ServeError, match="mlx_lm.server.run is missing"):
        check_server_shape(types.SimpleNamespace(main=server.main))
    original = server.ModelProvider, server.LRUPromptCache
    with patched_server(tmp_path / "home") as patched:
        assert issubclass(patched.ModelProvider, original[0])
        assert issubclass(patched.LRUPromptCache, original[1])
    assert (server.ModelProvider, server.LRUPromptCache) == original


def test_server_cache_keeps_pins_of_the_loaded_model_only(tmp_path):
    import types

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore.client.serve.hooks import patched_server

    def kv(n: int) -> list:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
        return [c]

    def meta(tokens: list[int]):
        return types.SimpleNamespace(token_ids=lambda: tokens, label="stage")

    with patched_server(tmp_path / "home") as server:
        cache = server.LRUPromptCache(2)
        cache.keep_pins("a", [meta([1, 2, 3])])
        cache.insert_cache("a", [1, 2, 3], kv(3), cache_type="system")
        for n in range(4):  # conversations extending the pin, more than max_size
            cache.insert_cache("a", [1, 2, 3, 10 + n, 20], kv(5))
        assert len(cache) == 3 and cache.stats_by_type()["pinned"]["n_sequences"] == 1
        _, rest = cache.fetch_nearest_cache("a", [1, 2, 3, 99])
        assert rest == [99]
        cache.keep_pins("b", [])  # another model loaded: model a's pin is let go
        assert cache.pinned_nbytes == 0 and len(cache) == 2  # the LRU's own entries stay
