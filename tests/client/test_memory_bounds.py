"""What serve keeps per request is bounded (issue 34 item 6): a StatsRecorder keeps its most recent
calls and exact running totals; serve's hooks, driven request after request in this process as
mlx_lm.server runs them, hold no more calls, warm-up marks or recent prompts after many requests
than after a few."""

from __future__ import annotations

import argparse
import types

import pytest

from kvstore.client import StatsRecorder
from kvstore.client.callstats import KEEP_CALLS


def _record(stats: StatsRecorder, i: int, label: str = "a") -> None:
    stats.record(label=label, prompt_tokens=10 + i, cached_tokens=i % 7, prefill_s=0.5,
                 decode_s=0.25, generated_tokens=2)  # fmt: skip


def test_calls_keep_the_most_recent_and_the_summary_counts_every_call():
    stats = StatsRecorder("m", send=False, verbose=False, keep_calls=3)
    for i in range(10):
        _record(stats, i, "a" if i % 2 else "b")
    assert [c.prompt_tokens for c in stats.calls] == [17, 18, 19]  # oldest first, a list still
    assert isinstance(stats.calls, list) and stats.calls[-2:] == stats.calls[1:]
    s = stats.summary()
    assert (s["a"].calls, s["b"].calls) == (5, 5)
    assert s["a"].prompt_tokens == sum(10 + i for i in range(1, 10, 2))
    assert s["b"].cached_tokens == sum(i % 7 for i in range(0, 10, 2))
    assert s["a"].prefill_s == pytest.approx(2.5) and s["b"].decode_s == pytest.approx(1.25)
    s["a"].calls = 0  # a copy: the caller's to change
    assert stats.summary()["a"].calls == 5


def test_the_default_bound():
    stats = StatsRecorder("m", send=False, verbose=False)
    for i in range(KEEP_CALLS + 5):
        _record(stats, i)
    assert len(stats.calls) == KEEP_CALLS and stats.calls[0].prompt_tokens == 15
    assert stats.summary()["a"].calls == KEEP_CALLS + 5


def test_the_summary_counts_reasons_of_every_call():
    stats = StatsRecorder("m", send=False, verbose=False, keep_calls=1)
    for _ in range(3):
        stats.record(label="a", prompt_tokens=4, cached_tokens=0, prefill_s=0.1, decode_s=0.1,
                     prompt=[1, 2, 3, 4])  # fmt: skip
    assert sum(stats.summary()["a"].prefilled.values()) == 12


def _state(hooks, cache) -> dict[str, int]:
    """How much of each thing serve keeps between requests."""
    a = hooks.calls.stats.attribute
    return {
        "calls": len(hooks.calls.stats.calls),
        "warm_up_requests": len(hooks.warm_up.requests),
        "warm_up_contexts": len(hooks.warm_up.contexts),
        "warm_prompts": len(hooks.warm_up.prompts),
        "recent": len(a.recent) + len(a.sorted),
        "decoded": len(a._texts),
        "hits": len(hooks.tier._hits),
        "lru": len(cache),
    }


def test_serve_keeps_no_more_after_many_requests_than_after_a_few(llama, llama_path, kv_home):
    from bench.soak import _drive, requests
    from kvstore.client.serve.hooks import SERVE_CALLS, patched_server

    model, tokenizer = llama
    key = (str(llama_path), None, None)
    args = argparse.Namespace(host="127.0.0.1", port=0, prefill_step_size=2048)
    provider = types.SimpleNamespace(model_key=key, model=model, tokenizer=tokenizer,
                                     cli_args=args)  # fmt: skip
    got: list = []
    with patched_server(kv_home, hooks_out=got, learn=False) as server:
        (hooks,) = got
        hooks.warm_up.started = hooks.ready = True  # no warm-up requests over HTTP here
        cache = server.LRUPromptCache(4)
        try:
            hooks.on_load(provider)
            reqs = requests(seed=1)
            for _ in range(SERVE_CALLS):
                _drive(hooks, cache, key, model, tokenizer, next(reqs))
            hooks.flush()
            few = _state(hooks, cache)
            for _ in range(SERVE_CALLS + 40):
                _drive(hooks, cache, key, model, tokenizer, next(reqs))
            hooks.flush()
            many = _state(hooks, cache)
        finally:
            hooks.close(2.0)
    assert many == few, (few, many)
    assert many["calls"] == SERVE_CALLS


def test_the_store_index_keeps_learned_chains_packed_and_answers_as_the_tuples_did():
    """Serve's index of the store's learned chains (client/learn.py StoreIndex): packed bytes,
    sorted, chains another extends left out; `may_serve` answers as the scan over tuples did."""
    import random

    from kvstore import tokens as tk
    from kvstore.learned.coldtier import RESTORE_MIN_GAIN, StoreIndex
    from kvstore.learned.index import leaf_chains

    rng = random.Random(0)
    systems = [[rng.randrange(300) for _ in range(rng.randint(40, 90))] for _ in range(3)]
    chains: list[tuple[int, ...]] = []
    for _ in range(60):
        c = list(rng.choice(systems) if rng.random() < 0.8 else chains[-1] if chains else [])
        chains.append(tuple(c + [rng.randrange(300) for _ in range(rng.randint(1, 80))]))
    chains += [c[: len(c) // 2] for c in chains[:10]]  # prefixes of others

    def scanned(tokens: list[int], served: int) -> bool:  # the tuples' answer
        need = served + RESTORE_MIN_GAIN
        return any(len(c) >= need and c[:need] == tuple(tokens[:need]) for c in chains)

    index = StoreIndex(0, leaf_chains([tk.pack(c) for c in chains]), [])
    assert all(type(c) is bytes for c in index.chains) and index.chains == sorted(index.chains)
    assert len(index.chains) < len(chains)
    answers = set()
    for _ in range(2000):
        c = list(rng.choice(chains))
        tokens = c[: rng.randint(0, len(c))] + [
            rng.randrange(300) for _ in range(rng.randint(0, 40))
        ]
        served = rng.randint(0, len(tokens))
        answers.add(index.may_serve(tokens, served))
        assert index.may_serve(tokens, served) == scanned(tokens, served), (tokens, served)
    assert answers == {True, False}
    assert leaf_chains([]) == [] and not StoreIndex(0, [], []).may_serve([1] * 40, 0)
