"""PersistentPromptCache: hydrated at construction, runtime pins persisted through a real daemon
and hydrated by a new cache (and a new process), pins that survive LRU pressure, chaining that
is persisted only when asked, and no daemon costing one warning and nothing else."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time

import mlx_lm
import pytest
from helpers import (
    CLASSIFY,
    SYNTHESIZE,
    TWO_PINS,
    assert_same_kv,
    chat,
    manifest_for,
    wait_for,
)
from mlx_lm import load

from kvstore.client import PersistentPromptCache, generate
from kvstore.client.writebehind import Job, WriteBehind
from kvstore.errors import KVStoreError
from kvstore.kvcheck.prefill import prefill
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.wire.daemon_client import DaemonClient

ROUTER = [{"role": "system", "content": CLASSIFY}]
WRITER = [{"role": "system", "content": SYNTHESIZE}]


def ls(home) -> list[dict]:
    with DaemonClient(home) as c:
        return c.raw("ls")


def count_prefills(monkeypatch) -> list:
    import kvstore.kvcheck.prefill

    calls = []
    real = kvstore.kvcheck.prefill.prefill

    def spy(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(kvstore.kvcheck.prefill, "prefill", spy)
    return calls


def test_construct_hydrates_from_a_warmed_store(llama, llama_path, kv_home, tmp_path, monkeypatch):
    with Store(kv_home) as store:
        assert warm(
            load_manifest(manifest_for(tmp_path, llama_path, TWO_PINS)), store, home=kv_home
        )
    model, tokenizer = llama
    prefills = count_prefills(monkeypatch)
    with PersistentPromptCache.open(model, tokenizer, llama_path, verbose=False) as cache:
        assert cache.report.entries == 2 and cache.report.warning is None
        assert sorted(cache.report.labels) == ["classify", "synthesize"]
        pin = cache.pin("classify", messages=ROUTER)
        assert (pin.source, pin.queued) == ("memory", False)  # hydrated: nothing to prefill or send
        prompt = chat(tokenizer, CLASSIFY, "My invoice 2291 was charged twice.")
        generate(cache, model, tokenizer, prompt, label="classify", max_tokens=4)
        (call,) = cache.stats.calls
        assert call.cached_tokens == len(pin.tokens)
        assert call.prefilled_tokens == len(prompt) - len(pin.tokens)
    assert prefills == []


def test_pin_persists_and_a_new_cache_and_process_hydrate_it(
    daemon, llama, llama_path, monkeypatch, capsys
):
    model, tokenizer = llama
    prefills = count_prefills(monkeypatch)
    with PersistentPromptCache.open(model, tokenizer, llama_path, home=daemon.home) as first:
        pin = first.pin("classify", messages=ROUTER)
        assert (pin.source, pin.queued) == ("prefill", True)
        assert first.pin("classify", messages=ROUTER) is pin
        assert first.flush()
    assert prefills == [pin.tokens]  # once
    with capsys.disabled():
        print(
            f"\n  pin(): {pin.seconds * 1e3:.2f} ms on the caller's thread, of which handing the "
            f"cache to the write-behind queue {pin.persist_s * 1e6:.0f} us"
        )
    (entry,) = ls(daemon.home)
    assert (entry["label"], entry["pinned"], entry["tokens"]) == ("classify", True, len(pin.tokens))
    assert entry["source"] == "pin"

    # a new cache object: hydrated, so pin() and the stage call prefill nothing of the prefix
    with PersistentPromptCache.open(model, tokenizer, llama_path, home=daemon.home) as second:
        assert second.report.entries == 1
        assert second.pin("classify", messages=ROUTER).source == "memory"
        cached, rest = second.fetch_nearest_cache(second.model_key, [*pin.tokens, 7])
        assert rest == [7]
        assert_same_kv(cached, prefill(model, pin.tokens))
        prompt = chat(tokenizer, CLASSIFY, "The site is down again.")
        generate(second, model, tokenizer, prompt, label="classify", max_tokens=4)
        (call,) = second.stats.calls
        assert (call.cached_tokens, call.prefilled_tokens) == (
            len(pin.tokens),
            len(prompt) - len(pin.tokens),
        )
    assert len(prefills) == 1

    # a new process
    code = f"""
import json
from mlx_lm import load
from kvstore.client import PersistentPromptCache, generate
model, tok = load({str(llama_path)!r})
with PersistentPromptCache.open(model, tok, {str(llama_path)!r}, home={str(daemon.home)!r}) as c:
    generate(c, model, tok, {prompt!r}, label="classify", max_tokens=2)
    print(json.dumps([c.report.entries, c.stats.calls[0].cached_tokens]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [1, len(pin.tokens)]


@pytest.mark.parametrize("arch", ["llama", "hybrid"])
def test_pins_survive_lru_pressure(arch, llama_path, hybrid_path, llama):
    path = llama_path if arch == "llama" else hybrid_path
    model, tokenizer = llama if arch == "llama" else load(str(path))
    with PersistentPromptCache.open(model, tokenizer, path, max_size=2, verbose=False) as cache:
        pins = [cache.pin("classify", messages=ROUTER), cache.pin("synthesize", messages=WRITER)]
        for i in range(8):
            system = (CLASSIFY, SYNTHESIZE, "Unrelated system prompt.")[i % 3]
            prompt = chat(tokenizer, system, f"request number {i}")
            generate(cache, model, tokenizer, prompt, label="stage", max_tokens=3)
            # chain on it, as a stage that continues the same query
            transcript = prompt + [7, 8, 9]
            generate(cache, model, tokenizer, transcript, label="stage", max_tokens=2)
        assert len(cache._lru) <= 2
        assert set(cache.pins) == {"classify", "synthesize"}
        for pin in pins:  # a prompt that continues the pin by one token
            got, rest = cache.fetch_nearest_cache(cache.model_key, [*pin.tokens, 7])
            assert rest == [7], pin.name
            assert_same_kv(got, prefill(model, pin.tokens))
        # the LRU's byte count still covers exactly its own entries
        own = sum(cache._trie.get(m, t).nbytes for m, t in cache._lru._lrus["assistant"])
        own += sum(cache._trie.get(m, t).nbytes for m, t in cache._lru._lrus["system"])
        assert cache._n_bytes == own
        assert cache.nbytes == own + sum(
            sum(c.nbytes for c in e.prompt_cache) for e in _pin_entries(cache)
        )
        # a stage call after all that still finds its pin
        prompt = chat(tokenizer, SYNTHESIZE, "write it up")
        generate(cache, model, tokenizer, prompt, label="synthesize", max_tokens=2)
        assert cache.stats.calls[-1].cached_tokens >= len(pins[1].tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_a_prompt_stored_whole_still_prefills_its_last_token(arch, llama_path, hybrid_path, llama):
    """mlx-lm's generators refuse an empty remainder ("Sequence N has an empty prompt" killed
    `kvstore serve`'s generation thread): a prompt whose every token is stored gets its last
    token to prefill, from the KV one token shorter (trimmable) or from a shorter stored prefix
    (a state layout cannot step back)."""
    path = llama_path if arch == "llama" else hybrid_path
    model, tokenizer = llama if arch == "llama" else load(str(path))
    with PersistentPromptCache.open(model, tokenizer, path, verbose=False) as cache:
        pin = cache.pin("classify", messages=ROUTER)
        whole = [*pin.tokens, 11, 12, 13]
        cache.attach_pin(cache.model_key, whole, prefill(model, whole), "whole")
        got, rest = cache.fetch_nearest_cache(cache.model_key, whole)
        if arch == "llama":
            assert rest == [13]
            assert_same_kv(got, prefill(model, whole[:-1]))
        else:  # the pin, the nearest shorter prefix, serves it
            assert rest == [11, 12, 13]
            assert_same_kv(got, prefill(model, pin.tokens))
        # and the library generates from it what mlx-lm generates from nothing stored
        text = generate(cache, model, tokenizer, whole, label="whole", max_tokens=4)
        assert text == mlx_lm.generate(model, tokenizer, whole, max_tokens=4)
        assert cache.stats.calls[-1].cached_tokens == len(whole) - len(rest)


def _pin_entries(cache):
    return [entry for _, entry in cache._pins.values()]


def test_chaining_is_persisted_only_when_asked(daemon, llama, llama_path):
    model, tokenizer = llama
    prompt = chat(tokenizer, CLASSIFY, "Refund my order.")
    with PersistentPromptCache.open(
        model, tokenizer, llama_path, home=daemon.home, verbose=False
    ) as c:
        c.pin("classify", messages=ROUTER)
        generate(c, model, tokenizer, prompt, label="classify", max_tokens=4)
        first = c.stats.calls[-1]
        follow = prompt + [11, 12, 13, 14, 15]  # a second call continuing the same query
        generate(c, model, tokenizer, follow, label="reason", max_tokens=2)
        second = c.stats.calls[-1]
        # the first transcript (prompt + its 4 tokens) served the follow-up's shared part
        assert second.cached_tokens >= first.prompt_tokens
        assert c.flush()
    assert [(e["label"], e["pinned"]) for e in ls(daemon.home)] == [("classify", True)]

    with PersistentPromptCache.open(
        model, tokenizer, llama_path, home=daemon.home, verbose=False, persist_chains=True
    ) as c:
        generate(c, model, tokenizer, prompt, label="classify", max_tokens=4)
        assert c.flush()
    chains = [e for e in ls(daemon.home) if e["label"] == "chain"]
    assert len(chains) == 1 and not chains[0]["pinned"]
    assert chains[0]["tokens"] == len(prompt) + 4


def test_store_hits_reach_the_daemon(daemon, llama, llama_path):
    """Fetches that reuse a stored pin are reported to the daemon (hits, last_used), so its
    budget evicts by real use; a prompt that does not start with the pin is no hit."""
    model, tokenizer = llama
    with PersistentPromptCache.open(
        model, tokenizer, llama_path, home=daemon.home, verbose=False
    ) as c:
        c.pin("classify", messages=ROUTER)
        assert c.flush()
    (before,) = ls(daemon.home)
    assert before["hits"] == 0
    with PersistentPromptCache.open(
        model, tokenizer, llama_path, home=daemon.home, verbose=False
    ) as c:
        for user in ("Refund my order.", "Where is my parcel?"):
            generate(
                c, model, tokenizer, chat(tokenizer, CLASSIFY, user), label="classify", max_tokens=2
            )
        again = chat(tokenizer, CLASSIFY, "Where is my parcel?") + [11, 12]
        generate(c, model, tokenizer, again, label="classify", max_tokens=2)  # via a transcript
        other = chat(tokenizer, SYNTHESIZE, "Say hi.")
        generate(c, model, tokenizer, other, label="synthesize", max_tokens=2)  # not the pin
        assert c.flush()
    (after,) = ls(daemon.home)
    assert after["hits"] == 3 and after["last_used"] > before["last_used"]
    assert after["created"] == before["created"]


def test_no_daemon_one_warning_and_unchanged_output(llama, llama_path, kv_home, caplog):
    model, tokenizer = llama
    prompts = [
        chat(tokenizer, CLASSIFY, "My invoice was charged twice."),
        chat(tokenizer, SYNTHESIZE, "Plan: refund the second charge."),
        chat(tokenizer, CLASSIFY, "Where is my package?"),
    ]
    expected = [mlx_lm.generate(model, tokenizer, p, max_tokens=6) for p in prompts]
    caplog.set_level(logging.WARNING, logger="kvstore.client")
    with PersistentPromptCache.open(model, tokenizer, llama_path, verbose=False) as cache:
        assert cache.pin("classify", messages=ROUTER).queued
        assert cache.pin("synthesize", messages=WRITER).queued
        got = [
            generate(cache, model, tokenizer, p, label=f"s{i}", max_tokens=6)
            for i, p in enumerate(prompts)
        ]
    assert got == expected
    no_daemon = [r for r in caplog.records if "no daemon" in r.getMessage()]
    assert len(no_daemon) == 1
    assert cache._writer.dropped >= 3  # two pins and the stats batches
    assert not cache._writer.thread.is_alive()


def test_full_queue_drops_with_a_counted_warning(kv_home, caplog):
    release = threading.Event()
    writer = WriteBehind(kv_home, maxsize=1)
    # the worker never reaches the daemon while it is blocked on the first job
    writer._connection = lambda: object()
    try:
        assert writer.submit(Job("blocker", lambda c: release.wait(60)))
        # the worker took the blocker; the queue has one free slot
        wait_for(lambda: writer._queue.qsize() == 0, what="the worker to take the blocker")
        assert writer.submit(Job("second", lambda c: None))
        t = time.perf_counter()
        assert not writer.submit(Job("third", lambda c: None))
        assert time.perf_counter() - t < 0.5  # dropping never blocks (a put would: 60 s)
        assert not writer.submit(Job("fourth", lambda c: None))
        assert writer.dropped == 2
        full = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]
        assert len(full) == 2 and "2 dropped so far" in full[-1]
    finally:
        release.set()
        assert writer.close(timeout=5)
    assert writer.sent == 2 and not writer.thread.is_alive()


def test_a_pin_over_max_pin_tokens_is_refused_at_once_as_warm_refuses_it(
    llama, llama_path, kv_home, monkeypatch
):
    """One limit for every way a pin is made: `pin()` refuses what `kvstore warm` refuses, with
    its line, before any prefill, for messages and for exact tokens alike."""
    kv_home.mkdir(mode=0o700)
    (kv_home / "settings.toml").write_text("max_pin_tokens = 100\n")
    prefills = count_prefills(monkeypatch)
    model, tokenizer = llama
    limit = "over max_pin_tokens (settings.toml) of 100 tokens; not prefilled"
    with PersistentPromptCache.open(model, tokenizer, llama_path, verbose=False) as cache:
        with pytest.raises(ValueError) as e:
            cache.pin("classify", messages=ROUTER)
        assert str(e.value) == (
            f"model {str(llama_path)!r}: pin 'classify' is 148 tokens, {limit}: shorten the pin "
            "or raise max_pin_tokens in settings.toml"
        )
        with pytest.raises(ValueError, match=re.escape(f"pin 'ids' is 101 tokens, {limit}")):
            cache.pin("ids", tokens=list(range(1, 102)))
        with pytest.raises(KVStoreError, match="max_pin_tokens=100 tokens"):  # never tokenized
            cache.pin("huge", messages=[{"role": "system", "content": "word " * 2000}])
        assert prefills == [] and cache.pins == {}
        assert cache.pin("ids", tokens=list(range(1, 101))).source == "prefill"
    with Store(kv_home) as store:  # warm's own line for the same pin
        manifest = load_manifest(manifest_for(kv_home.parent, llama_path, TWO_PINS))
        report = warm(manifest, store, home=kv_home)
    assert str(e.value) in [p.error for p in report.pins]


def test_a_long_pin_says_its_progress(llama, llama_path, monkeypatch, capsys):
    """A pin whose prefill runs long says how far it is, as `kvstore warm` does: every 2 s,
    here 16 tokens a chunk on a clock that moves 3 s a reading."""
    import kvstore.kvcheck.prefill
    import kvstore.warm.warm

    t = [0.0]

    def clock():
        t[0] += 3.0
        return t[0]

    monkeypatch.setattr(kvstore.kvcheck.prefill, "PREFILL_STEP", 16)
    monkeypatch.setattr(kvstore.warm.warm, "progress_clock", clock)
    model, tokenizer = llama
    with PersistentPromptCache.open(model, tokenizer, llama_path, verbose=True) as cache:
        cache.pin("long", tokens=list(range(1, 49)))
    progress = [x for x in capsys.readouterr().err.splitlines() if x.startswith("kvstore: pin ")]
    assert progress == [
        "kvstore: pin long: 16 of 48 tokens (33%), 5 tokens/s",
        "kvstore: pin long: 32 of 48 tokens (67%), 5 tokens/s",
    ]
