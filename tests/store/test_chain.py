"""Chain hashes: one key per position whoever cut it, cuts at block multiples."""

from __future__ import annotations

import time

import xxhash

from kvstore.learned.chain import CHAIN_SEED, chain_hashes, cuts, is_cut, position_hash
from kvstore.store.entry import pack_tokens

FP = bytes(range(16))


def test_chain_matches_its_definition():
    toks = list(range(600))
    hs = chain_hashes(FP, toks, 256)
    assert len(hs) == 3  # h_0 and two full blocks
    h0 = xxhash.xxh3_128_digest(CHAIN_SEED + FP)
    h1 = xxhash.xxh3_128_digest(h0 + pack_tokens(toks[:256]))
    h2 = xxhash.xxh3_128_digest(h1 + pack_tokens(toks[256:512]))
    assert hs == [h0, h1, h2]
    assert chain_hashes(FP, pack_tokens(toks), 256) == hs  # packed bytes are the same tokens
    assert position_hash(FP, toks, 512, 256, hs) == h2
    assert position_hash(FP, toks, 600, 256) == xxhash.xxh3_128_digest(
        h2 + pack_tokens(toks[512:600])
    )
    assert position_hash(FP, toks, 0) == h0


def test_position_hash_depends_on_the_whole_prefix_and_the_model():
    a, b = list(range(700)), list(range(700))
    b[3] = 99999
    assert position_hash(FP, a, 300) != position_hash(FP, b, 300)
    assert position_hash(FP, a, 300) != position_hash(bytes(16), a, 300)
    # a longer prompt keys its shared positions the same
    assert position_hash(FP, a, 300) == position_hash(FP, a + [1, 2, 3], 300)
    assert position_hash(FP, a, 299) != position_hash(FP, a, 300)


def test_cuts():
    assert cuts(200, 800) == [(200, 256), (256, 512), (512, 768), (768, 800)]
    assert cuts(0, 256) == [(0, 256)]
    assert cuts(256, 300) == [(256, 300)]
    assert cuts(5, 5) == []
    assert all(is_cut(s, e) for s, e in cuts(3, 2000))
    assert not is_cut(200, 300) and not is_cut(5, 5)


def test_chain_hashes_of_8k_tokens_is_fast():
    toks = list(range(8192))
    best = min(_timed(lambda: chain_hashes(FP, toks)) for _ in range(20))
    assert best < 1e-3, f"chain_hashes of 8k tokens took {best * 1e3:.3f} ms"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
