"""Prefill stats: every call's numbers add up (cold, hydrated, chained, stopped early), the line
is logged and shown by default, and a flush puts the records in the daemon's ledger."""

from __future__ import annotations

import logging
import re

import mlx_lm
import pytest
from helpers import CLASSIFY, SYNTHESIZE, TWO_PINS, Proc, chat, manifest_for
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.sample_utils import make_sampler

from kvstore.client import PersistentPromptCache, StatsRecorder, generate, stream_generate
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store


def assert_adds_up(call) -> None:
    assert call.prompt_tokens == call.cached_tokens + call.prefilled_tokens
    assert call.prefilled_tokens >= 1 and call.prefill_s > 0 and call.decode_s > 0


def assert_entries_match_their_keys(cache) -> None:
    """Every LRU entry holds exactly the tokens it is filed under (mlx-lm runs one token ahead)."""
    for lru in cache._lru._lrus.values():
        for model, tokens in lru:
            entry = cache._trie.get(model, tokens)
            assert entry.prompt_cache[0].offset == len(tokens)


def test_cold_and_hydrated_calls_add_up(llama, llama_path, kv_home, tmp_path):
    model, tokenizer = llama
    prompt = chat(tokenizer, CLASSIFY, "My invoice 2291 was charged twice.")

    cold = StatsRecorder(str(llama_path), send=False, verbose=False)
    generate(LRUPromptCache(), model, tokenizer, prompt, model_key="m", stats=cold, max_tokens=5)
    (call,) = cold.calls
    assert_adds_up(call)
    assert (call.prompt_tokens, call.cached_tokens, call.generated_tokens) == (len(prompt), 0, 5)

    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, llama_path, TWO_PINS)), store, home=kv_home)
        pins = {m.label: m.ntokens for m in store.metas()}
    with PersistentPromptCache.open(model, tokenizer, llama_path, verbose=False) as cache:
        generate(cache, model, tokenizer, prompt, label="classify", max_tokens=5)
        generate(cache, model, tokenizer, prompt + [9, 9], label="classify", max_tokens=5)
        generate(cache, model, tokenizer, chat(tokenizer, SYNTHESIZE, "ok"), label="synthesize")
        hydrated, chained, other = cache.stats.calls
        for c in cache.stats.calls:
            assert_adds_up(c)
        assert hydrated.cached_tokens == pins["classify"] > 0  # the pin hydrated from the store
        assert chained.cached_tokens == len(prompt)  # served by the first call's transcript
        assert other.cached_tokens > 0
        summary = cache.stats.summary()
        s = summary["classify"]
        assert (s.calls, s.prompt_tokens) == (2, 2 * len(prompt) + 2)
        assert s.cached_tokens == hydrated.cached_tokens + chained.cached_tokens
        assert s.saved_s == pytest.approx(s.cached_tokens * s.prefill_s / s.prefilled_tokens)
        assert summary["synthesize"].calls == 1
        assert_entries_match_their_keys(cache)


def test_line_is_logged_and_shown_by_default(llama, llama_path, caplog, capsys):
    model, tokenizer = llama
    prompt = chat(tokenizer, CLASSIFY, "hello")
    shown = StatsRecorder("m", send=False)  # default: printed, since INFO is not shown
    generate(LRUPromptCache(), model, tokenizer, prompt, model_key="m", stats=shown, max_tokens=2)
    err = capsys.readouterr().err
    assert f"kvstore: default: {len(prompt)} prompt tokens, 0 from cache" in err

    caplog.set_level(logging.INFO, logger="kvstore.client")
    quiet = StatsRecorder("m", send=False)  # logging shows it now: no second copy on stderr
    generate(LRUPromptCache(), model, tokenizer, prompt, model_key="m", stats=quiet, label="x")
    assert "kvstore: x:" not in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstore.client"]
    assert [ln for ln in lines if ln.startswith("kvstore: x:")] == [quiet.calls[0].line()]

    off = StatsRecorder("m", send=False, verbose=False)
    caplog.set_level(logging.WARNING, logger="kvstore.client")
    generate(LRUPromptCache(), model, tokenizer, prompt, model_key="m", stats=off, max_tokens=2)
    assert capsys.readouterr().err == "" and len(off.calls) == 1


def test_early_stop_is_recorded_and_not_misfiled(llama, llama_path):
    model, tokenizer = llama
    prompt = chat(tokenizer, CLASSIFY, "stop early")
    stats = StatsRecorder("m", send=False, verbose=False)
    lru = LRUPromptCache()
    for i, _ in enumerate(
        stream_generate(lru, model, tokenizer, prompt, model_key="m", stats=stats, max_tokens=50)
    ):
        if i == 1:
            break
    (call,) = stats.calls
    assert call.generated_tokens == 2 and call.prompt_tokens == len(prompt)
    assert len(lru) == 1
    assert_entries_match_their_keys(lru)
    with pytest.raises(ValueError, match="model_key"):
        generate(lru, model, tokenizer, prompt, stats=stats)


def test_daemon_ledger_after_flush(tmp_path, llama, llama_path):
    model, tokenizer = llama
    d = Proc(tmp_path / "dhome", log=tmp_path / "daemon.log")
    try:
        d.wait_ready()
        with PersistentPromptCache.open(
            model, tokenizer, llama_path, home=d.home, verbose=False
        ) as c:
            c.pin("classify", messages=[{"role": "system", "content": CLASSIFY}])
            for user in ("one", "two"):
                generate(c, model, tokenizer, chat(tokenizer, CLASSIFY, user), label="classify")
            generate(c, model, tokenizer, chat(tokenizer, SYNTHESIZE, "x"), label="synthesize")
            assert c.flush()
            local, calls = c.stats.summary(), c.stats.calls
            ledger = d.request("stats")["ledger"]
    finally:
        assert d.stop()[0] == 0, d.text()
    rows = {r["label"]: r for r in ledger["by_model_label"] if r["model"] == str(llama_path)}
    assert set(rows) == {"classify", "synthesize"}
    for label, s in local.items():
        row = rows[label]
        assert (row["calls"], row["prompt_tokens"]) == (s.calls, s.prompt_tokens)
        assert (row["cached_tokens"], row["prefilled_tokens"]) == (
            s.cached_tokens,
            s.prefilled_tokens,
        )
        assert row["prefill_s"] == pytest.approx(s.prefill_s)
        generated = sum(c.generated_tokens for c in calls if c.label == label)
        assert row.get("generated_tokens", generated) == generated  # optional in the ledger
    assert rows["classify"]["cached_tokens"] > 0


def numbers_out(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", text)


def test_generate_takes_verbose_as_mlx_lm_generate_does(llama, llama_path, capsys):
    """`verbose=False` (as docs/apps.md shows) silences the call's line and still records it;
    `verbose=True` prints what mlx_lm.generate(verbose=True) prints, then the line."""
    model, tokenizer = llama
    prompt = chat(tokenizer, CLASSIFY, "hello")
    stats = StatsRecorder("m", send=False)  # default: the line is printed
    lru = LRUPromptCache()
    args = (model, tokenizer, prompt)
    plain = mlx_lm.generate(*args, max_tokens=2, verbose=False)
    assert generate(lru, *args, model_key="m", stats=stats, max_tokens=2, verbose=False) == plain
    assert capsys.readouterr() == ("", "")
    for _ in stream_generate(lru, *args, model_key="m", stats=stats, max_tokens=2, verbose=False):
        pass
    assert capsys.readouterr() == ("", "") and len(stats.calls) == 2

    mlx_lm.generate(*args, max_tokens=2, verbose=True)
    theirs = capsys.readouterr().out
    ours = generate(LRUPromptCache(), *args, model_key="m", stats=stats, max_tokens=2, verbose=True)
    out, err = capsys.readouterr()
    assert ours == plain and numbers_out(out) == numbers_out(theirs), (out, theirs)
    assert err == stats.calls[-1].line() + "\n"


def test_generate_takes_mlx_lm_generation_arguments(llama, llama_path):
    """What mlx_lm.stream_generate takes works through the wrapper: a sampler, logits
    processors, prefill step and progress callback, and speculative decoding with a draft
    model, on a cold call and on one the cache serves; greedy, the same tokens as mlx-lm's."""
    model, tokenizer = llama
    prompt = chat(tokenizer, CLASSIFY, "hello")
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=4)]
    seen: list[tuple[int, int]] = []
    options = {
        "sampler": make_sampler(0.0),
        "logits_processors": [],
        "prefill_step_size": 8,
        "prompt_progress_callback": lambda done, total: seen.append((done, total)),
    }
    stats = StatsRecorder("m", send=False, verbose=False)
    lru = LRUPromptCache()
    for kw in (options, {"draft_model": model, "num_draft_tokens": 2}):
        for _ in range(2):  # cold, then served by the cache
            got = stream_generate(lru, model, tokenizer, prompt, model_key="m", stats=stats,
                                  max_tokens=4, **kw)  # fmt: skip
            assert [r.token for r in got] == want, kw
    assert seen and stats.calls[-1].cached_tokens == len(prompt) - 1
    assert_entries_match_their_keys(lru)


@pytest.mark.parametrize("call", ["generate", "stream_generate"])
def test_a_call_mlx_lm_refuses_is_not_recorded(call, llama, llama_path):
    """A keyword mlx-lm does not take raises its TypeError naming it, and the call that never
    generated is neither recorded nor inserted."""
    model, tokenizer = llama
    stats = StatsRecorder("m", send=False, verbose=False)
    lru = LRUPromptCache()
    run = {"generate": generate, "stream_generate": lambda *a, **k: list(stream_generate(*a, **k))}
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        run[call](lru, model, tokenizer, "hello", model_key="m", stats=stats, no_such_option=1)
    assert stats.calls == [] and stats.summary() == {} and len(lru) == 0
