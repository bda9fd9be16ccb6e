"""What a request's fetch did beyond memory (a learned split's prefill, tokens read through from
the fleet) travels to its call's record as one per-prompt `FetchRecord` in the store tier: kept
under the tier's lock, bounded, taken once. No module global carries it (kvstore/fleet/reads.py's
SERVED dict did): the fleet's tokens reach the call's line, the ledger record and
`kvstore_prompt_tokens_total{source="fleet"}` in the library and through serve's hooks."""

from __future__ import annotations

import types

from helpers import mlx_lm_prefill

from kvstore import metrics
from kvstore.client.callstats import StatsRecorder, generate
from kvstore.client.persistent import (
    FETCH_RECORDS,
    FETCH_RECORDS_EACH,
    STORE_PREFIXES,
    FetchRecord,
    PinnedPromptCache,
    StoreTier,
)
from kvstore.fleet import reads as fleetread
from kvstore.learned.coldtier import Restored

KEY = "m"


def fleet_sample() -> float:
    return metrics.REGISTRY.get_sample_value("kvstore_prompt_tokens_total",
                                             {"source": "fleet"}) or 0.0  # fmt: skip


def test_a_fetch_record_is_kept_per_prompt_taken_once_and_bounded():
    assert not hasattr(fleetread, "SERVED")  # no module global on the request path
    tier = StoreTier()
    prompt = list(range(1, 700))
    tier.served(KEY, prompt, 0, 600, 600)  # the store's: nothing beyond it to tell
    assert tier.fetch_record(prompt) == FetchRecord()
    tier.served(KEY, prompt, 0, 600, 690, 512, (90, 0.25))
    tier.served(KEY, prompt, 0, 600, 600, 512)  # the same prompt again, untaken yet
    assert tier.fetch_record(list(prompt)) == FetchRecord(90, 0.25, 512)  # the oldest first
    assert tier.fetch_record(tuple(prompt)) == FetchRecord(0, 0.0, 512)
    assert tier.fetch_record(prompt) == FetchRecord()  # each taken once
    for i in range(FETCH_RECORDS + 10):  # fetches nobody's call takes (an app's own fetch)
        for _ in range(FETCH_RECORDS_EACH + 3):
            tier.served(KEY, [i, 1, 2], 0, 3, 3, 3)
    assert tier.fetch_record([0, 1, 2]) == FetchRecord()  # the oldest prompts dropped
    last = [FETCH_RECORDS + 9, 1, 2]
    taken = [tier.fetch_record(last) for _ in range(FETCH_RECORDS_EACH + 3)]
    assert taken.count(FetchRecord(0, 0.0, 3)) == FETCH_RECORDS_EACH


def test_serve_reads_the_fleet_and_the_split_from_one_record(kv_home):
    """serve's record of a request: its cached tokens less the split, the fleet's in its line."""
    from kvstore.client.serve.hooks import _Hooks

    hooks = _Hooks(kv_home, persist=False, learn=False)
    try:
        hooks.calls.stats = StatsRecorder("m", send=False, verbose=False)
        prompt = list(range(1, 700))
        hooks.tier.served(KEY, prompt, 0, 512, 640, 512, (128, 0.5))
        ctx = types.SimpleNamespace(prompt=list(prompt), prompt_cache_count=640)
        hooks.calls.record_call(ctx, 0.1, 0.1, 2)
        call = hooks.calls.stats.calls[-1]
        assert ctx.prompt_cache_count == 512  # usage.prompt_tokens_details.cached_tokens
        assert (call.cached_tokens, call.fleet_tokens) == (512, 512)
        assert "512 from cache (512 from the fleet), 187 prefilled" in call.line()
        assert sum(call.prefilled_by_reason().values()) == call.prefilled_tokens == 187
        ctx = types.SimpleNamespace(prompt=list(prompt), prompt_cache_count=698)
        hooks.calls.record_call(ctx, 0.1, 0.1, 2)  # the next request of it: memory's
        again = hooks.calls.stats.calls[-1]
        assert (again.cached_tokens, again.fleet_tokens) == (698, 0)
        assert "from the fleet" not in again.line()
    finally:
        hooks.close(1.0)


def test_the_library_call_reads_the_fleet_from_its_fetch(llama):
    """A library `generate` whose fetch the fleet served (the learner's restore, as
    kvstore.fleet.reads hands it back) says so in its line; the next call is memory's."""
    model, tokenizer = llama
    prompt = [(7 * i + 3) % 200 + 1 for i in range(300)]
    kv = mlx_lm_prefill(model, prompt[:256])
    cache = PinnedPromptCache(4)
    served = Restored(cache=kv, n=256, nbytes=0, what="2 records from the fleet", fleet=256)
    cache.tier.restore = lambda model, tokens, n, quiet: served if n < 256 else None
    rec = StatsRecorder("m", send=False, verbose=False)
    before = fleet_sample()
    generate(cache, model, tokenizer, prompt, model_key=KEY, stats=rec, max_tokens=2)
    assert fleet_sample() - before == 256
    call = rec.calls[-1]
    assert (call.cached_tokens, call.fleet_tokens) == (256, 256)
    assert "256 from cache (256 from the fleet)" in call.line()
    generate(cache, model, tokenizer, prompt, model_key=KEY, stats=rec, max_tokens=2)
    again = rec.calls[-1]
    assert again.cached_tokens >= 256 and again.fleet_tokens == 0
    assert fleet_sample() - before == 256


def test_what_a_process_restored_is_remembered_for_its_hits_within_a_bound(llama):
    """Every request the store serves on a miss (a learned restore) is remembered so that its
    later uses count as hits; before, a set of every restored prefix grew request after request
    (issue 34 item 6, found by the soak's tracemalloc) and every request scanned all of it."""
    model, _ = llama
    kv = mlx_lm_prefill(model, list(range(1, 17)))
    cache = PinnedPromptCache(4)
    cache.tier.serving(KEY, b"\0" * 16)

    def restore(model_, tokens, n, quiet):
        return Restored(cache=kv, n=16, nbytes=0, what="1 record") if n < 16 else None

    cache.tier.restore = restore
    for i in range(STORE_PREFIXES + 50):
        cache.fetch_nearest_cache(KEY, [1000 + i] + list(range(2, 20)))
    tier = cache.tier
    remembered = len(tier.stored) + len(getattr(tier, "restored", ()))
    assert remembered == STORE_PREFIXES  # before: STORE_PREFIXES + 50, and growing
    tier._hits.clear()
    last = [1000 + STORE_PREFIXES + 49] + list(range(2, 20))
    cache.fetch_nearest_cache(KEY, last)  # in memory now: a use of the restored prefix
    assert tier._hits == [tuple(last[:16])]
