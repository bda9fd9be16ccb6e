"""The learning policy: what recurs, what extends, what is wanted, when learning pauses."""

from __future__ import annotations

from kvstore.learned.chain import chain_hashes
from kvstore.learned.policy import LearnPolicy, Sighting, worth_storing
from kvstore.store.entry import pack_tokens

FP = bytes(range(16))


def report(policy: LearnPolicy, tokens: list[int]) -> int:
    data = pack_tokens(tokens)
    return policy.learned_end(FP, data, chain_hashes(FP, data, policy.block))


def prompt(shared: int, tail: int, seed: int) -> list[int]:
    return list(range(1, shared + 1)) + [100_000 + seed * 1000 + i for i in range(tail)]


def test_a_prefix_shared_by_two_requests_is_learned_exactly():
    p = LearnPolicy()
    assert report(p, prompt(800, 50, 1)) == 0  # seen once
    assert report(p, prompt(800, 70, 2)) == 800  # the exact divergence, inside a block
    assert report(p, prompt(300, 10, 3)) == 300


def test_short_common_prefixes_are_not_learned():
    p = LearnPolicy()
    report(p, prompt(40, 300, 1))
    assert report(p, prompt(40, 300, 2)) == 0


def test_min_requests_three():
    p = LearnPolicy(min_requests=3)
    report(p, prompt(600, 20, 1))
    assert report(p, prompt(600, 20, 2)) == 0
    assert report(p, prompt(500, 20, 3)) == 500


def test_a_prompt_that_extends_an_earlier_one_is_learned_whole():
    p = LearnPolicy()
    turn1 = prompt(0, 90, 1)
    turn2 = turn1 + [7] * 120
    report(p, turn1)
    assert report(p, turn2) == len(turn2)
    turn3 = turn2 + [8] * 300
    assert report(p, turn3) == len(turn3)


def test_wants_skip_what_is_in_flight_then_expire():
    now = [0.0]
    p = LearnPolicy(clock=lambda: now[0])
    data = pack_tokens(prompt(800, 0, 0))
    hs = chain_hashes(FP, data)
    assert p.wants(FP, data, hs, 0, 800) == [(0, 256), (256, 512), (512, 768), (768, 800)]
    assert p.wants(FP, data, hs, 0, 800) == []  # another client: already asked
    assert p.wants(FP, data, hs, 200, 900 - 100) == []
    now[0] = 31.0
    assert p.wants(FP, data, hs, 512, 800) == [(512, 768), (768, 800)]


def test_paused_by_the_write_budget_and_said_once_a_day():
    p = LearnPolicy()
    msg = p.paused(written_today=5 * 2**30, write_budget=4 * 2**30)
    assert msg and "learning paused" in msg and "learn_write_bytes_per_day" in msg
    assert p.paused(written_today=1, write_budget=4 * 2**30) is None
    assert p.paused(written_today=1, write_budget=10, want_bytes=100, learned_budget=50)
    assert p.first_time(msg, "2026-01-01") and not p.first_time(msg, "2026-01-01")
    assert p.first_time(msg, "2026-01-02")


def test_cost_rule():
    assert worth_storing(None, 800, None)
    assert worth_storing(4 * 2**20, 800, 1500.0)  # 4 ms read vs 0.27 s prefill
    assert not worth_storing(4 * 2**30, 800, 1e6)  # reading 4 GiB is slower than prefill


def sight(policy: LearnPolicy, tokens: list[int]):
    data = pack_tokens(tokens)
    return policy.sighting(FP, data, chain_hashes(FP, data, policy.block))


def test_the_nodes_a_request_sees_first_are_the_fleets_to_answer():
    p = LearnPolicy()
    # all new here: every full block (node 1..3) is a first sighting
    assert sight(p, prompt(800, 50, 1)) == Sighting(0, (1, 3))
    # its first 800 tokens are counted now: only the blocks past them are new
    assert sight(p, prompt(800, 500, 2)) == Sighting(800, (4, 5))
    # nothing new (whole blocks already counted): the bucket is not asked
    assert sight(p, prompt(800, 500, 2)).fleet is None
    # a node shallower than MIN_LCP is never the fleet's (blocks of 32 tokens: node 2 first)
    small = LearnPolicy(block=32)
    assert sight(small, prompt(0, 100, 3)) == Sighting(0, (2, 3))
    # a marker counts as one earlier request: with min_requests 3 the fleet is not asked
    assert sight(LearnPolicy(min_requests=3), prompt(800, 0, 4)).fleet is None
    # a prompt shorter than a block has no node to ask about
    assert sight(LearnPolicy(), prompt(0, 200, 5)).fleet is None
