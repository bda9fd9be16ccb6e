"""Why tokens were prefilled, through the library: the report line and the stats carry the
reasons (kvstore.reasons) on a real chat template."""

from __future__ import annotations

import mlx_lm
import pytest
from click.testing import CliRunner
from helpers import (
    NEW,
    OLD,
    ROUTER,
    Proc,
    chat,
    corrupt_a_blob,
    killed_daemon,
    manifest_for,
    serving,
    system,
    wait_for,
)

from kvstore.cli.main import main
from kvstore.client import PersistentPromptCache, generate
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.tiny import make_tiny_model


def test_cold_then_date_in_system_prompt_is_diverged(llama, llama_path, kv_home, tmp_path):
    model, tokenizer = llama
    with PersistentPromptCache.open(model, tokenizer, llama_path, verbose=False) as cache:
        generate(cache, model, tokenizer, chat(tokenizer, system(NEW), "hi"), max_tokens=2)
        (first,) = cache.stats.calls
        assert first.prefilled_by_reason() == {"cold": first.prompt_tokens - 1, "suffix": 1}

    prefixes = f"""
[[model.prefix]]
name = "router"
messages = [{{ role = "system", content = "{system(OLD)}" }}]
"""
    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, llama_path, prefixes)), store, home=kv_home)
    prompt = chat(tokenizer, system(NEW), "My invoice 2291 was charged twice.")
    with PersistentPromptCache.open(model, tokenizer, llama_path, verbose=False) as cache:
        generate(cache, model, tokenizer, prompt, label="classify", max_tokens=2)
        (call,) = cache.stats.calls
    by = call.prefilled_by_reason()
    assert sum(by.values()) == call.prefilled_tokens
    (d,) = [s for s in call.reasons if s["reason"] == "diverged"]
    assert d["entry"] == "router"
    # the position is the date's first differing token
    date_at = len(tokenizer.decode(prompt[: d["position"]]))
    text = tokenizer.decode(prompt)
    assert text.index(NEW) <= date_at <= text.index(NEW) + len(NEW)
    assert OLD in d["stored_text"] and NEW in d["request_text"]
    assert "diverged" in call.line() and "router at" in call.line()
    assert cache.stats.summary()["classify"].prefilled == by


def _warm(kv_home, tmp_path, model_path, extra: str = "") -> None:
    with Store(kv_home) as store:
        manifest = manifest_for(tmp_path, model_path, ROUTER, extra=extra)
        assert warm(load_manifest(manifest), store, home=kv_home).warmed == 1


def _ask(model_path, prompt_of, **kw):
    model, tokenizer = mlx_lm.load(str(model_path))
    with PersistentPromptCache.open(model, tokenizer, model_path, verbose=False, **kw) as cache:
        generate(cache, model, tokenizer, prompt_of(tokenizer), max_tokens=2)
        (call,) = cache.stats.calls
    assert sum(call.prefilled_by_reason().values()) == call.prefilled_tokens
    return call


def _router_request(tokenizer):
    return chat(tokenizer, system(OLD), "My invoice 2291 was charged twice.")


def test_weights_changed_after_the_warm_is_model_changed_naming_the_weights(
    model_copy, kv_home, tmp_path
):
    _warm(kv_home, tmp_path, model_copy)
    other = make_tiny_model(tmp_path / "other" / "llama", "llama", seed=1)
    (model_copy / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    call = _ask(model_copy, _router_request)
    (m,) = [s for s in call.reasons if s["reason"] == "model_changed"]
    assert m["differs"] == "weights" and m["tokens"] > 0


def test_kv_bits_changed_is_model_changed_naming_kv_quantization(llama_path, kv_home, tmp_path):
    _warm(kv_home, tmp_path, llama_path)
    call = _ask(llama_path, _router_request, kv_bits=8)
    (m,) = [s for s in call.reasons if s["reason"] == "model_changed"]
    assert m["differs"] == "KV quantization"


@pytest.mark.parametrize("before_its_store", [True, False], ids=["before-its-store", "empty"])
def test_a_daemon_killed_before_any_store_exists_is_unavailable(
    llama_path, kv_home, tmp_path, before_its_store
):
    killed_daemon(kv_home, tmp_path / "daemon.log", before_its_store=before_its_store)
    call = _ask(llama_path, _router_request)
    assert call.prefilled_by_reason() == {"unavailable": call.prompt_tokens - 1, "suffix": 1}


OTHER = "You are the writer. Reply in one short friendly sentence. " * 12
SHOP = system(OLD) + " You are a careful assistant for a hardware shop." * 12


def _learning(model, tokenizer, cache, user: str, sys: str = SHOP):
    generate(cache, model, tokenizer, chat(tokenizer, sys, user), max_tokens=2)
    return cache.stats.calls[-1]


def test_a_prefix_seen_once_is_not_learned_yet_and_the_next_request_is_served_it(
    llama, llama_path, daemon
):
    model, tokenizer = llama
    with PersistentPromptCache.open(model, tokenizer, llama_path, home=daemon.home, max_size=1,
                               learn=True, verbose=False) as cache:  # fmt: skip
        first = _learning(model, tokenizer, cache, "My invoice 2291 was charged twice.")
        assert first.prefilled_by_reason() == {"cold": first.prompt_tokens - 1, "suffix": 1}
        _learning(model, tokenizer, cache, "hello", OTHER)  # pushes it out of the memory
        second = _learning(model, tokenizer, cache, "Where is my parcel?")
        assert second.prefilled_by_reason().get("not_learned_yet", 0) > 0, second.reasons
        # seen twice: learned; the next request with it is served it from the store
        wait_for(lambda: daemon.request("stats")["learned"].get("records"), 10, daemon.text)
        _learning(model, tokenizer, cache, "hello again", OTHER)
        third = _learning(model, tokenizer, cache, "Is the blue shirt in stock?")
    assert third.cached_tokens >= second.prefilled_by_reason()["not_learned_yet"] - 32


def test_learning_paused_by_the_write_budget_is_write_budget(llama, llama_path, tmp_path):
    model, tokenizer = llama
    home = tmp_path / "budget-home"
    home.mkdir()
    (home / "settings.toml").write_text("learn_write_bytes_per_day = 1\n")
    with serving(Proc(home, log=tmp_path / "daemon.log"), warm=False) as d:
        with PersistentPromptCache.open(model, tokenizer, llama_path, home=home, max_size=1,
                                   learn=True, verbose=False) as cache:  # fmt: skip
            for user in ("My invoice 2291 was charged twice.", "Where is my parcel?"):
                _learning(model, tokenizer, cache, user, OTHER)  # learned: the budget is spent
            wait_for(lambda: d.request("stats")["learned"].get("records"), 10, d.text)
            _learning(model, tokenizer, cache, "one")
            wait_for(lambda: cache.learner.paused_by == "write_budget", 10, d.text)
            _learning(model, tokenizer, cache, "two", OTHER)
            call = _learning(model, tokenizer, cache, "three")
    by = call.prefilled_by_reason()
    assert by.get("write_budget", 0) > 0 and "not_learned_yet" not in by, call.reasons


def test_a_pin_removed_by_kvstore_evict_is_evicted_by_kvstore_evict(llama, llama_path, daemon):
    model, tokenizer = llama
    router = [{"role": "system", "content": system(OLD)}]
    with PersistentPromptCache.open(model, tokenizer, llama_path, home=daemon.home,
                               verbose=False) as cache:  # fmt: skip
        cache.pin("router", messages=router)
        assert cache.flush()
    out = CliRunner().invoke(main, ["evict", "--label", "router", "--home", str(daemon.home)])
    assert out.exit_code == 0, out.output
    with PersistentPromptCache.open(model, tokenizer, llama_path, home=daemon.home,
                               verbose=False) as cache:  # fmt: skip
        generate(cache, model, tokenizer, _router_request(tokenizer), max_tokens=2)
        (call,) = cache.stats.calls
    (e,) = [s for s in call.reasons if s["reason"] == "evicted"]
    assert (e["by"], e["entry"]) == ("kvstore evict", "router") and e["tokens"] > 0
    assert "evicted" in call.line() and "by kvstore evict" in call.line()


def test_a_date_inside_a_learned_prefix_is_diverged_naming_the_learned_chain(
    llama, llama_path, daemon
):
    model, tokenizer = llama
    with PersistentPromptCache.open(model, tokenizer, llama_path, home=daemon.home, learn=True,
                               verbose=False) as cache:  # fmt: skip
        for user in ("My invoice 2291 was charged twice.", "Where is my parcel?"):
            _learning(model, tokenizer, cache, user)  # seen twice: learned
        wait_for(lambda: daemon.request("stats")["learned"].get("records"), 10, daemon.text)
        assert cache.flush()
    today = SHOP.replace(OLD, NEW)  # the next day's system prompt, after a restart
    with PersistentPromptCache.open(model, tokenizer, llama_path, home=daemon.home, learn=True,
                               verbose=False) as cache:  # fmt: skip
        call = _learning(model, tokenizer, cache, "Is the blue shirt in stock?", today)
    (d,) = [s for s in call.reasons if s["reason"] == "diverged"]
    assert d["entry"].startswith("learned chain of ") and d["tokens"] > 100, call.reasons
    assert OLD in d["stored_text"] and NEW in d["request_text"]
    assert "cold" not in call.prefilled_by_reason()


def test_a_stored_entry_that_fails_its_checks_is_corrupt(llama_path, kv_home, tmp_path):
    _warm(kv_home, tmp_path, llama_path)
    corrupt_a_blob(kv_home, "router")
    call = _ask(llama_path, _router_request)
    (c,) = [s for s in call.reasons if s["reason"] == "corrupt"]
    assert c["entry"] == "entry 'router'" and c["tokens"] > 0, call.reasons
    assert "corrupt" in call.line() and "cold" not in call.prefilled_by_reason()


def test_a_learned_record_that_fails_its_checks_is_corrupt(llama, llama_path, tmp_path):
    model, tokenizer = llama
    home = tmp_path / "corrupt-home"  # of its own: every learned record in it is damaged
    with serving(Proc(home, log=tmp_path / "daemon.log"), warm=False) as d:
        with PersistentPromptCache.open(model, tokenizer, llama_path, home=home, learn=True,
                                   verbose=False) as cache:  # fmt: skip
            for user in ("My invoice 2291 was charged twice.", "Where is my parcel?"):
                _learning(model, tokenizer, cache, user)  # seen twice: learned
            wait_for(lambda: d.request("stats")["learned"].get("records"), 10, d.text)
            assert cache.flush()
    corrupt_a_blob(home)
    with PersistentPromptCache.open(model, tokenizer, llama_path, home=home, learn=True,
                               verbose=False) as cache:  # fmt: skip
        call = _learning(model, tokenizer, cache, "Is the blue shirt in stock?")
    (c,) = [s for s in call.reasons if s["reason"] == "corrupt"]
    assert c["entry"].startswith("learned record ") and c["tokens"] > 100, call.reasons


def test_a_learned_prefix_evicted_by_the_learned_budget_is_evicted_by_it(
    llama, llama_path, tmp_path
):
    model, tokenizer = llama
    home = tmp_path / "budget-home"

    def learn(system_prompt: str) -> int:
        with PersistentPromptCache.open(model, tokenizer, llama_path, home=home, learn=True,
                                   verbose=False) as cache:  # fmt: skip
            for user in ("My invoice 2291 was charged twice.", "Where is my parcel?"):
                _learning(model, tokenizer, cache, user, system_prompt)  # seen twice: learned
            assert cache.flush()
        return wait_for(lambda: d.request("stats")["learned"].get("bytes"), 10, d.text)

    with serving(Proc(home, log=tmp_path / "daemon.log"), warm=False) as d:
        one = learn(SHOP)
    (home / "settings.toml").write_text(f"learned_max_bytes = {one * 3 // 2}\n")
    with serving(Proc(home, log=tmp_path / "daemon.log"), warm=False) as d:
        learn(OTHER)  # over the learned budget: the least recently used leaf (SHOP's) goes
        wait_for(lambda: "evicted learned record" in d.text(), 10, d.text)
        with PersistentPromptCache.open(model, tokenizer, llama_path, home=home, learn=True,
                                   verbose=False) as cache:  # fmt: skip
            call = _learning(model, tokenizer, cache, "Is the blue shirt in stock?")
    (e,) = [s for s in call.reasons if s["reason"] == "evicted"]
    assert e["by"] == "learned budget" and e["entry"].startswith("learned chain of "), e
    assert e["tokens"] > 0 and "by learned budget" in call.line()


def test_a_pin_the_app_stored_then_weights_changed_is_model_changed_naming_the_weights(
    model_copy, tmp_path, daemon
):
    model, tokenizer = mlx_lm.load(str(model_copy))
    with PersistentPromptCache.open(model, tokenizer, model_copy, home=daemon.home,
                               verbose=False) as cache:  # fmt: skip
        cache.pin("router", messages=[{"role": "system", "content": system(OLD)}])
        assert cache.flush()
    other = make_tiny_model(tmp_path / "other" / "llama", "llama", seed=1)
    (model_copy / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    call = _ask(model_copy, _router_request, home=daemon.home)
    (m,) = [s for s in call.reasons if s["reason"] == "model_changed"]
    assert m["differs"] == "weights" and m["tokens"] > 0, m


def test_an_entry_older_than_the_fingerprint_parts_still_names_what_differs(
    llama_path, kv_home, tmp_path
):
    _warm(kv_home, tmp_path, llama_path, extra="kv_bits = 8")
    with Store(kv_home) as store:  # as an entry stored before metas recorded the parts
        (meta,) = store.metas()
        meta.extra = meta.extra.without("fingerprint_parts")
        with store.env.begin(write=True) as txn:
            txn.put(meta.key, meta.pack(), db=store._meta)
    call = _ask(llama_path, _router_request)
    (m,) = [s for s in call.reasons if s["reason"] == "model_changed"]
    assert m["differs"] == "KV quantization", m


def test_a_prefix_learned_before_the_weights_changed_is_model_changed_naming_them(
    model_copy, tmp_path
):
    # a home of its own: nothing else stored under the new weights' fingerprint
    home = tmp_path / "learned-home"
    with serving(Proc(home, log=tmp_path / "daemon.log"), warm=False) as d:
        model, tokenizer = mlx_lm.load(str(model_copy))
        with PersistentPromptCache.open(model, tokenizer, model_copy, home=home, learn=True,
                                   verbose=False) as cache:  # fmt: skip
            for user in ("My invoice 2291 was charged twice.", "Where is my parcel?"):
                _learning(model, tokenizer, cache, user)  # seen twice: learned
            wait_for(lambda: d.request("stats")["learned"].get("records"), 10, d.text)
            assert cache.flush()
        other = make_tiny_model(tmp_path / "other" / "llama", "llama", seed=1)
        (model_copy / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
        model, tokenizer = mlx_lm.load(str(model_copy))
        with PersistentPromptCache.open(model, tokenizer, model_copy, home=home, learn=True,
                                   verbose=False) as cache:  # fmt: skip
            call = _learning(model, tokenizer, cache, "Is the blue shirt in stock?")
    (m,) = [s for s in call.reasons if s["reason"] == "model_changed"]
    assert m["differs"] == "weights" and m["tokens"] > 100, call.reasons


ROUTER_DESK = (
    "You are the router of a support desk. Classify each request into billing, outage or "
    "account, and answer with JSON only."
)
HAIKU = "You write haiku about the weather in the mountains."


def test_a_pin_sharing_one_opening_word_is_cold_not_diverged(llama, llama_path, kv_home, tmp_path):
    """Issue 43 item 9: both system prompts start with "You ": that one word is no shared part of
    the pin's content, so nothing is `diverged` from it; a real change inside it still is."""
    model, tokenizer = llama
    prefixes = f"""
[[model.prefix]]
name = "router"
messages = [{{ role = "system", content = "{ROUTER_DESK}" }}]
"""
    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, llama_path, prefixes)), store, home=kv_home)
    with PersistentPromptCache.open(model, tokenizer, llama_path, verbose=False) as cache:
        generate(cache, model, tokenizer, chat(tokenizer, HAIKU, "Snow today?"), max_tokens=2)
        changed = ROUTER_DESK.replace("billing, outage", "refunds, outage")
        generate(cache, model, tokenizer, chat(tokenizer, changed, "Refund?"), max_tokens=2)
        haiku, router = cache.stats.calls
    # memory served the header and "You" (the pin's first tokens): still nothing of its content
    assert haiku.prefilled_by_reason() == {"cold": haiku.prefilled_tokens - 1, "suffix": 1}, (
        haiku.line()
    )
    (d,) = [s for s in router.reasons if s["reason"] == "diverged"]
    assert d["entry"] == "router" and "billing" in d["stored_text"]
