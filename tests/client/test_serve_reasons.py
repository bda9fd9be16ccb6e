"""Why tokens were prefilled, through a real `kvstore serve` process: the per-request log line
names the reasons (a diverged pin by label and position) and GET /metrics counts them, with
`suffix`, so that they sum to the prefilled tokens."""

from __future__ import annotations

import re
import urllib.request

import mlx_lm
import pytest
from click.testing import CliRunner
from helpers import NEW, OLD, ROUTER, Server, manifest_for, system, wait_for

from kvstore.cli.main import main
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store

pytestmark = pytest.mark.slow


def _prefilled(server) -> dict[str, float]:
    if hasattr(server, "url"):
        with urllib.request.urlopen(server.url("/metrics"), timeout=10) as r:
            text = r.read().decode()
    else:  # test_serve_learn's server
        text = server.get("/metrics")[1].decode()
    pattern = r'kvstore_prefilled_tokens_total\{reason="(\w+)"\} (\S+)'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text)}


def test_serve_names_cold_then_diverged_date(llama_path, kv_home, tmp_path):
    log = tmp_path / "server.log"
    messages = [{"role": "system", "content": system(NEW)},
                {"role": "user", "content": "My invoice 2291 was charged twice."}]  # fmt: skip
    server = Server(tmp_path / "empty-home", llama_path, log)
    try:
        server.wait_ready()
        reply = server.chat(messages)
        wait_for(lambda: _prefilled(server).get("cold", 0) > 0, 30, log.read_text)
        by = _prefilled(server)
        # the last token, which every request prefills, is `suffix`
        assert by["cold"] + 1 == by["suffix"] + by["cold"] == reply["usage"]["prompt_tokens"]
        assert sum(by.values()) == reply["usage"]["prompt_tokens"]
    finally:
        server.stop()

    prefixes = f"""
[[model.prefix]]
name = "router"
messages = [{{ role = "system", content = "{system(OLD)}" }}]
"""
    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, llama_path, prefixes)), store, home=kv_home)
    server = Server(kv_home, llama_path, log)
    try:
        server.wait_ready()
        reply = server.chat(messages)
        wait_for(lambda: _prefilled(server).get("diverged", 0) > 0, 30, log.read_text)
        by = _prefilled(server)
        prompt, cached = reply["usage"]["prompt_tokens"], reply["usage"]["prompt_tokens_details"][
            "cached_tokens"]  # fmt: skip
        assert sum(by.values()) == prompt - cached
        wait_for(lambda: re.search(r"diverged \d+ \(router at \d+\)", log.read_text()), 30,
                 log.read_text)  # fmt: skip
        # a user-only request shares only the template's header with the pin: cold, not diverged
        before = _prefilled(server)
        server.chat([{"role": "user", "content": "What is the weather in Paris tomorrow?"}])
        wait_for(lambda: _prefilled(server)["cold"] > before["cold"], 30, log.read_text)
        assert _prefilled(server)["diverged"] == before["diverged"], log.read_text()
    finally:
        server.stop()


def _serve_ask(home, model, log, messages, *extra):
    server = Server(home, model, log, *extra)
    try:
        server.wait_ready()
        reply = server.chat(messages)
        prefilled = reply["usage"]["prompt_tokens"] - reply["usage"]["prompt_tokens_details"][
            "cached_tokens"]  # fmt: skip
        wait_for(lambda: sum(_prefilled(server).values()) >= prefilled, 30, log.read_text)
        by = _prefilled(server)
        assert sum(by.values()) == prefilled
        return by
    finally:
        server.stop()


def test_serve_names_evicted_by_kvstore_evict(llama_path, kv_home, tmp_path):
    messages = [{"role": "system", "content": system(OLD)},
                {"role": "user", "content": "My invoice 2291 was charged twice."}]  # fmt: skip
    manifest = manifest_for(tmp_path, llama_path, ROUTER)
    with Store(kv_home) as store:
        warm(load_manifest(manifest), store, home=kv_home)
    out = CliRunner().invoke(main, ["evict", "--label", "router", "--home", str(kv_home)])
    assert out.exit_code == 0, out.output
    log = tmp_path / "evicted.log"
    by = _serve_ask(kv_home, llama_path, log, messages)
    assert by["evicted"] > 0, log.read_text()
    assert re.search(r"evicted \d+ \(by kvstore evict\)", log.read_text())


@pytest.mark.skipif(
    tuple(int(x) for x in mlx_lm.__version__.split(".")[:2]) < (0, 32),
    reason="mlx_lm.server before 0.32 has no --kv-bits",
)
def test_serve_names_kv_bits_model_changed(llama_path, kv_home, tmp_path):
    messages = [{"role": "system", "content": system(OLD)},
                {"role": "user", "content": "My invoice 2291 was charged twice."}]  # fmt: skip
    manifest = manifest_for(tmp_path, llama_path, ROUTER)
    with Store(kv_home) as store:
        warm(load_manifest(manifest), store, home=kv_home)
    log = tmp_path / "kv-bits.log"
    by = _serve_ask(kv_home, llama_path, log, messages, "--kv-bits", "8")
    assert by["model_changed"] > 0, log.read_text()
    assert re.search(r"model_changed \d+ \(KV quantization\)", log.read_text())


def test_serve_a_prefix_seen_once_is_not_learned_yet_and_the_next_request_is_served_it(
    llama_path, kv_home, tmp_path
):
    from helpers import Proc, Serve, cached_tokens, serving, shared_tokens, wait_learned

    other = "You are the writer. Reply in one short friendly sentence."
    shared = shared_tokens(llama_path, "My invoice was charged twice.", "Where is my parcel?")
    log = tmp_path / "serve.log"
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False) as d:
        s = Serve(kv_home, llama_path, log, "--prompt-cache-size", "1")
        try:
            s.wait_ready()
            s.chat("My invoice was charged twice.")  # seen once
            s.chat("hello", system=other)  # pushes it out of the one-entry memory
            wait_for(lambda: sum(_prefilled(s).values()) > 0, 30, log.read_text)
            before = _prefilled(s).get("not_learned_yet", 0)
            s.chat("Where is my parcel?")  # the same system prompt: seen, not stored yet
            wait_for(lambda: _prefilled(s).get("not_learned_yet", 0) > before, 30, log.read_text)
            assert _prefilled(s)["not_learned_yet"] - before >= 0.9 * shared
            wait_learned(d)  # seen twice: learned
            s.chat("hello again", system=other)
            served = s.chat("Is the blue shirt in stock?")
            assert cached_tokens(served) >= 0.9 * shared, log.read_text()
        finally:
            s.stop()


@pytest.mark.parametrize("before_its_store", [True, False], ids=["before-its-store", "empty"])
def test_serve_a_daemon_killed_before_any_store_exists_is_unavailable(
    llama_path, tmp_path, before_its_store
):
    from helpers import killed_daemon

    home = tmp_path / "home"
    killed_daemon(home, tmp_path / "daemon.log", before_its_store=before_its_store)
    messages = [{"role": "system", "content": system(NEW)}, {"role": "user", "content": "hi"}]
    by = _serve_ask(home, llama_path, tmp_path / "serve.log", messages)
    assert {k: v for k, v in by.items() if v} == {"unavailable": sum(by.values()) - 1, "suffix": 1}


def test_serve_weights_changed_after_the_warm_is_model_changed_naming_the_weights(
    model_copy, kv_home, tmp_path
):
    from kvstore.tiny import make_tiny_model

    messages = [{"role": "system", "content": system(OLD)},
                {"role": "user", "content": "My invoice 2291 was charged twice."}]  # fmt: skip
    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, model_copy, ROUTER)), store, home=kv_home)
    other = make_tiny_model(tmp_path / "other" / "llama", "llama", seed=1)
    (model_copy / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    log = tmp_path / "serve.log"
    by = _serve_ask(kv_home, model_copy, log, messages)
    assert by["model_changed"] > 0, log.read_text()
    assert re.search(r"model_changed \d+ \(weights\)", log.read_text())


def test_serve_tool_schemas_in_another_order_are_diverged_at_the_first_schema(kv_home, tmp_path):
    import json

    from pins.template_families import SYSTEM_PROMPT, TOOLS, make_family_model

    path = make_family_model(tmp_path / "qwen2_5", "qwen2_5")  # tools in the system turn
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    prefixes = (
        '[[model.prefix]]\nname = "shop"\ntools = "tools.json"\n'
        f'messages = [{{ role = "system", content = {json.dumps(SYSTEM_PROMPT)} }}]\n'
    )
    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, path, prefixes)), store, home=kv_home)
    log = tmp_path / "serve.log"
    server = Server(kv_home, path, log)
    try:
        server.wait_ready()
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": "Find me a red kettle."}]  # fmt: skip
        server.chat(messages, tools=list(reversed(TOOLS)))
        wait_for(lambda: _prefilled(server).get("diverged", 0) > 0, 30, log.read_text)
        wait_for(lambda: re.search(r"diverged \d+ \(shop at \d+\)", log.read_text()), 30,
                 log.read_text)  # fmt: skip
    finally:
        server.stop()
    # the position is the first schema's: what the request has there is its first tool's name
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(path)
    at = int(re.search(r"diverged \d+ \(shop at (\d+)\)", log.read_text())[1])
    ids = tok.apply_chat_template(messages, tools=list(reversed(TOOLS)), add_generation_prompt=True)
    text, before = tok.decode(ids), len(tok.decode(ids[:at]))
    first = text.index('"search_products"')
    assert text.rfind("{", 0, first) <= before <= first + len("search_products")


def test_serve_a_date_inside_a_learned_prefix_is_diverged_naming_the_learned_chain(
    llama_path, kv_home, tmp_path
):
    from helpers import SYSTEM, Proc, Serve, serving, wait_learned

    log = tmp_path / "serve.log"
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False) as d:
        s = Serve(kv_home, llama_path, log)
        try:
            s.wait_ready()
            for user in ("My invoice was charged twice.", "Where is my parcel?"):
                s.chat(user, system=f"Today is {OLD}. {SYSTEM}")  # seen twice: learned
            wait_learned(d)
        finally:
            s.stop()
        s = Serve(kv_home, llama_path, log)  # the next day, after a restart
        try:
            s.wait_ready()
            s.chat("Is the blue shirt in stock?", system=f"Today is {NEW}. {SYSTEM}")
            wait_for(lambda: _prefilled(s).get("diverged", 0) > 100, 30, log.read_text)
            assert not _prefilled(s).get("cold"), log.read_text()
        finally:
            s.stop()
    assert re.search(r"diverged \d+ \(learned chain of \d+ tokens at \d+\)", log.read_text())


def test_serve_a_stored_entry_that_fails_its_checks_is_corrupt(llama_path, kv_home, tmp_path):
    from helpers import corrupt_a_blob

    messages = [{"role": "system", "content": system(OLD)},
                {"role": "user", "content": "My invoice 2291 was charged twice."}]  # fmt: skip
    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, llama_path, ROUTER)), store, home=kv_home)
    corrupt_a_blob(kv_home, "router")
    log = tmp_path / "serve.log"
    by = _serve_ask(kv_home, llama_path, log, messages)
    assert by["corrupt"] > 0 and not by.get("cold"), log.read_text()
    assert re.search(r"corrupt \d+ \(entry 'router'\)", log.read_text())


@pytest.mark.parametrize("daemon", ["running", "stopped"])
def test_serve_a_system_prompt_it_stored_then_weights_changed_is_model_changed_naming_them(
    model_copy, kv_home, tmp_path, daemon
):
    """The daemon running, or stopped over its readable store (then not `unavailable`: that is
    only when nothing could be read)."""
    from helpers import Proc, serving

    from kvstore.tiny import make_tiny_model

    messages = [{"role": "system", "content": system(OLD)},
                {"role": "user", "content": "My invoice 2291 was charged twice."}]  # fmt: skip
    log = tmp_path / "serve.log"
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False) as d:
        server = Server(kv_home, model_copy, log, "--persist-system-prompts", "--no-learn")
        try:
            server.wait_ready()
            server.chat(messages)
            wait_for(lambda: any(e["label"] == "system" for e in d.request("ls")), 30, d.text)
        finally:
            server.stop()
        other = make_tiny_model(tmp_path / "other" / "llama", "llama", seed=1)
        (model_copy / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
        if daemon == "running":
            by = _serve_ask(kv_home, model_copy, log, messages)
    if daemon == "stopped":
        by = _serve_ask(kv_home, model_copy, log, messages)
        assert not by.get("unavailable") and by["suffix"] > 0, log.read_text()
    assert by["model_changed"] > 0, log.read_text()
    assert re.search(r"model_changed \d+ \(weights\)", log.read_text()), log.read_text()


def test_serve_a_prefix_it_learned_then_weights_changed_is_model_changed_naming_them(
    model_copy, kv_home, tmp_path
):
    from helpers import SYSTEM, Proc, Serve, serving, wait_learned

    from kvstore.tiny import make_tiny_model

    log = tmp_path / "serve.log"
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False) as d:
        s = Serve(kv_home, model_copy, log)
        try:
            s.wait_ready()
            for user in ("My invoice was charged twice.", "Where is my parcel?"):
                s.chat(user)  # seen twice: learned
            wait_learned(d)
        finally:
            s.stop()
        other = make_tiny_model(tmp_path / "other" / "llama", "llama", seed=1)
        (model_copy / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
        s = Serve(kv_home, model_copy, log)
        try:
            s.wait_ready()
            s.chat("Is the blue shirt in stock?", system=SYSTEM)
            wait_for(lambda: _prefilled(s).get("model_changed", 0) > 100, 30, log.read_text)
        finally:
            s.stop()
    assert re.search(r"model_changed \d+ \(weights\)", log.read_text()), log.read_text()


def _prompt_sources(server) -> dict[str, float]:
    text = server.get("/metrics")[1].decode()
    pattern = r'kvstore_prompt_tokens_total\{source="(\w+)"\} (\S+)'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text)}


def _plain_mlx_lm_cached(model, log, turns) -> list[int]:
    """cached_tokens of each turn as plain `mlx_lm.server` reports them."""
    import sys

    from bench.learned import Server as BenchServer
    from bench.learned import free_port

    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port)]
    s = BenchServer(argv, port, log)
    try:
        s.wait_ready()
        return [
            s.chat(m, max_tokens=4)["usage"]["prompt_tokens_details"]["cached_tokens"]
            for m in turns
        ]
    finally:
        s.stop()


def test_serve_a_hybrid_chats_own_prefill_is_prefilled_not_cached(hybrid_path, kv_home, tmp_path):
    """A state layout's learned chat (each turn extends the last one's whole prompt, so the
    learner prefills all but its last token inside the fetch): cached_tokens is what memory or
    the store reused, as plain mlx_lm.server's (kvstore's turn-end snapshot holds one token
    more: the whole previous prompt), and the reasons sum to the prefill counter."""
    from helpers import Proc, Serve, serving
    from test_reasons_truth import chat_turns

    from bench.learned import Server as BenchServer

    turns = chat_turns(5)
    plain = _plain_mlx_lm_cached(hybrid_path, tmp_path / "plain.log", turns)
    log = tmp_path / "serve.log"
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        s = Serve(kv_home, hybrid_path, log)
        try:
            s.wait_ready()
            replies = [BenchServer.chat(s, m, max_tokens=4) for m in turns]
            prefilled = sum(r["usage"]["prompt_tokens"] - cached_of(r) for r in replies)
            wait_for(lambda: sum(_prefilled(s).values()) >= prefilled, 30, log.read_text)
            by, sources = _prefilled(s), _prompt_sources(s)
        finally:
            s.stop()
    cached = [cached_of(r) for r in replies]
    assert all(p <= c <= p + 1 for p, c in zip(plain, cached, strict=True)), (plain, cached)
    assert sum(by.values()) == sources["prefill"] == prefilled, (by, sources)
    assert sum(cached) == sources["memory"] + sources["store"], (cached, sources)
    assert not by.get("diverged"), log.read_text()


def cached_of(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]
