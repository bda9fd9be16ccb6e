"""The client side of learned prefixes, in process: the cold tier restores what left memory (a
chain of block records, a stored entry) instead of prefilling it, the request's tokens are counted
by source, reporting costs the request path well under a millisecond, and a state layout's
prefill is split at a learned boundary with the state a prefill of that prefix has - and at a
chat turn's prompt end, so a restart before the next turn loses no turn."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from kvstore.client import modelthread
from kvstore.client.learn import Learner
from kvstore.client.persistent import PinnedPromptCache
from kvstore.codec import codec
from kvstore.learned.blockstore import BlockStore, load_entry
from kvstore.learned.chain import cuts
from kvstore.learned.coldtier import LearnTarget
from kvstore.learned.records import slice_record
from kvstore.store.entry import entry_key, pack_tokens
from kvstore.store.store import Store
from tests.client.learn_chat import (
    FP,
    KEY,
    chat_tokens,
    chat_turn,
    learn_two_turns,
    learner_of,
    prompt_tokens_from,
)
from tests.helpers import assert_same_kv, live_states, mlx_lm_prefill


@pytest.fixture(scope="module")
def llama(llama_path: Path):
    return load_model(llama_path)[0]


@pytest.fixture(scope="module")
def hybrid(hybrid_path: Path):
    return load_model(hybrid_path)[0]


@pytest.fixture
def learner_for(kv_home):
    made = []

    def make(model, lru, **kw) -> Learner:
        learner = Learner(kv_home)
        learner.add_target(KEY, LearnTarget(fingerprint=FP, model="tiny", model_obj=model,
                                            extra={}, **kw))  # fmt: skip
        lru.learner = learner
        made.append(learner)
        return learner

    yield make
    for learner in made:
        learner.close(timeout=2.0)


def test_a_miss_is_restored_from_block_records_up_to_the_divergence(llama, kv_home, learner_for):
    tokens = chat_tokens(600)
    full = mlx_lm_prefill(llama, tokens)
    with Store(kv_home) as store:
        records = [(s, e, slice_record(full, s, e)) for s, e in cuts(0, 600)]
        BlockStore(store).put_records(FP, tokens, records, label="learned")
    lru = PinnedPromptCache(max_size=1)
    learner_for(llama, lru)
    request = tokens[:550] + [t ^ 1 for t in tokens[550:553]]  # diverges, inside the vocabulary
    before = {s: prompt_tokens_from(s) for s in ("store", "memory", "prefill")}
    cache, rest = lru.fetch_nearest_cache(KEY, request)
    assert rest == request[550:]  # served up to the divergence, not a token less
    assert_same_kv(cache, mlx_lm_prefill(llama, tokens[:550]))
    assert prompt_tokens_from("store") - before["store"] == 550
    assert prompt_tokens_from("prefill") - before["prefill"] == 3
    # the restored KV sits in the LRU now: the next request is served from memory, still
    # counted as the store's tokens (they were read from it)
    cache2, rest2 = lru.fetch_nearest_cache(KEY, request)
    assert rest2 == request[550:]
    assert prompt_tokens_from("store") - before["store"] == 1100
    assert prompt_tokens_from("memory") - before["memory"] == 0
    # greedy continuation equals a cold prefill's
    nxt = mx.array([request[550:]])
    ref = mlx_lm_prefill(llama, tokens[:550])
    assert mx.allclose(llama(nxt, cache=cache2), llama(nxt, cache=ref)).item()


def test_a_corrupt_record_ends_the_chain_with_one_warning_per_process(
    llama, kv_home, learner_for, caplog
):
    """A learned record whose bytes were flipped is never served: the chain stops before it, the
    rest is prefilled, and the process says so once (naming the record), not on every request."""
    tokens = chat_tokens(600, seed=11)
    full = mlx_lm_prefill(llama, tokens)
    with Store(kv_home) as store:
        blocks = BlockStore(store)
        blocks.put_records(FP, tokens, [(s, e, slice_record(full, s, e)) for s, e in cuts(0, 600)],
                           label="learned")  # fmt: skip
        bad = blocks.lookup(FP, tokens)[1].key  # [256, 512)
        blob = bytearray(store._read(lambda t: bytes(t.get(bad, db=blocks._db(b"bblob")))))
        blob[len(blob) // 2] ^= 0x40
        store._write(lambda t: t.put(bad, bytes(blob), db=blocks._db(b"bblob")))
    request = tokens + [3, 4]
    with caplog.at_level("WARNING", logger="kvstore.client"):
        for _ in range(2):  # two apps' caches in one process: a new cold tier each
            lru = PinnedPromptCache(max_size=1)
            learner_for(llama, lru)
            cache, rest = lru.fetch_nearest_cache(KEY, request)
            assert rest == request[256:]
            assert_same_kv(cache, mlx_lm_prefill(llama, tokens[:256]))
    said = [r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage()]
    assert len(said) == 1, said
    assert bad.hex() in said[0] and "tokens 256-512" in said[0] and "verify --repair" in said[0]


def test_an_evicted_pin_is_restored_from_its_stored_entry(llama, kv_home, learner_for):
    pin = chat_tokens(300, seed=5)
    with Store(kv_home) as store:
        cache = mlx_lm_prefill(llama, pin)
        blob = codec.encode(cache, {"model": "tiny"})
        store.put(entry_key(FP, pin), blob, tokens=pack_tokens(pin), label="classify",
                  pinned=True, model="tiny", classes=codec.cache_classes(cache))  # fmt: skip
    lru = PinnedPromptCache(max_size=1)
    learner_for(llama, lru)
    lru.insert_cache(KEY, pin, mlx_lm_prefill(llama, pin))
    other = chat_tokens(50, seed=9)
    lru.insert_cache(KEY, other, mlx_lm_prefill(llama, other))  # max_size=1: the pin is gone
    assert len(lru) == 1
    request = pin + [11, 12, 13]
    cache, rest = lru.fetch_nearest_cache(KEY, request)
    assert rest == [11, 12, 13]  # from the store, not a prefill
    assert_same_kv(cache, mlx_lm_prefill(llama, pin))


def test_no_store_means_prefill_as_before(llama, learner_for):
    lru = PinnedPromptCache(max_size=2)
    learner_for(llama, lru)
    cache, rest = lru.fetch_nearest_cache(KEY, chat_tokens(100))
    assert cache is None and rest == chat_tokens(100)


def test_reporting_a_request_costs_the_request_path_under_a_millisecond(llama, learner_for):
    """The request path: remember the prompt at fetch, one write-behind job at insert."""
    lru = PinnedPromptCache(max_size=4)
    learner = learner_for(llama, lru)
    learner.writer.close(timeout=1.0)  # measure the request path, not a socket
    prompt = chat_tokens(8192)
    cache = make_prompt_cache(llama)
    best = 1.0
    for _ in range(20):
        t0 = time.perf_counter()
        learner.fetched(KEY, prompt)
        learner.inserted(KEY, prompt + [5, 6], cache)
        best = min(best, time.perf_counter() - t0)
    assert best < 1e-3, f"{best * 1e3:.3f} ms"


def test_a_state_layout_splits_its_prefill_at_a_learned_boundary(hybrid, learner_for):
    """qwen3_5 (KV + ArraysCache layers): the cache snapshot at the boundary equals a prefill of
    tokens[:p], and the request goes on from there."""
    from mlx_lm.models.cache import make_prompt_cache as fresh

    lru = PinnedPromptCache(max_size=4)
    learner = learner_for(hybrid, lru)
    assert not learner.targets[KEY].is_sliceable()
    tokens = chat_tokens(400)
    p = 300
    learner._boundaries[KEY] = {p: tuple(tokens[:p])}
    learner.writer.close(timeout=1.0)  # no daemon here: the snapshot put is dropped
    cache, rest = lru.fetch_nearest_cache(KEY, tokens)
    assert rest == tokens[p:]
    ref = fresh(hybrid)
    hybrid(mx.array(tokens[:p])[None], cache=ref)
    mx.eval([c.state for c in ref])
    for a, b in zip(live_states(cache), live_states(ref), strict=True):
        assert a.shape == b.shape
        assert mx.allclose(a, b, atol=1e-4).item()
    # the boundary's state is in memory now: the next request crossing it is served from it
    _, rest2 = lru.fetch_nearest_cache(KEY, tokens[:p] + [1, 2, 3])
    assert rest2 == [1, 2, 3]


def test_persistent_prompt_cache_learns_with_a_real_daemon(llama_path, kv_home, tmp_path):
    """PersistentPromptCache(learn=True): two calls sharing a system prompt are learned and
    acknowledged; a new cache object (a restarted app, nothing hydrated: no pins) is served
    the shared prefix from the store on its first call."""
    from helpers import Proc, serving
    from mlx_lm import load

    from kvstore.client import PersistentPromptCache, generate

    model, tok = load(str(llama_path))
    system = "You are a careful assistant for a hardware shop. " * 30

    def prompt(user: str) -> list[int]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True)

    a, b, c = prompt("Do you sell hammers?"), prompt("When do you open?"), prompt("Any nails?")
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False) as d:
        with PersistentPromptCache.open(model, tok, llama_path, home=kv_home, learn=True) as first:
            generate(first, model, tok, a, max_tokens=2)
            generate(first, model, tok, b, max_tokens=2)
            assert first.flush(10.0)
            assert first.learner.reported == 2 and first.learner.records_sent > 0
        assert d.request("stats")["learned"]["records"] > 0
        with PersistentPromptCache.open(model, tok, llama_path, home=kv_home, learn=True) as second:
            assert second.report.entries == 0  # nothing pinned: only learned records
            generate(second, model, tok, c, max_tokens=2)
            assert second.stats.calls[-1].cached_tokens >= shared
    with PersistentPromptCache.open(model, tok, llama_path, home=kv_home) as off:  # learn=False
        assert off.learner is None
        generate(off, model, tok, c, max_tokens=2)
        assert off.stats.calls[-1].cached_tokens == 0


def test_restored_records_are_touched_through_the_write_behind(llama, kv_home, tmp_path):
    """A restore marks its records used (touch_blocks, batched with the write-behind): the
    learned LRU keeps what processes restore, not only what they wrote last."""
    from helpers import Proc, serving

    tokens = chat_tokens(400, seed=11)
    full = mlx_lm_prefill(llama, tokens)
    with Store(kv_home) as store:
        records = [(s, e, slice_record(full, s, e)) for s, e in cuts(0, 400)]
        BlockStore(store).put_records(FP, tokens, records, label="learned")
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        lru = PinnedPromptCache(max_size=2)
        learner = Learner(kv_home, learn=False)
        learner.add_target(KEY, LearnTarget(fingerprint=FP, model="tiny", model_obj=llama,
                                            extra={}))  # fmt: skip
        lru.learner = learner
        try:
            _, rest = lru.fetch_nearest_cache(KEY, tokens + [7, 8])
            assert rest == [7, 8]  # restored, not prefilled
            assert learner.drain(10.0) == (1, 0)  # one touch_blocks job, sent
        finally:
            learner.close(timeout=2.0)
        with Store(kv_home, readonly=True) as ro:
            chain = BlockStore(ro).lookup(FP, tokens)
        assert [m.hits for m in chain] == [1, 1]
        assert all(m.last_used > m.created for m in chain)


class _Spy:
    """A model that records the threads it runs on."""

    def __init__(self, model):
        self.model, self.threads = model, []

    def __call__(self, *a, **kw):
        self.threads.append(threading.current_thread())
        return self.model(*a, **kw)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def test_a_hybrid_chat_snapshots_each_turns_prompt_end_for_the_next_turn(
    hybrid, hybrid_path, kv_home, tmp_path
):
    """qwen3_5 chat of 3 turns, a real daemon: turn 2 extends turn 1's whole prompt, so its
    prefill stops one token short, and after the response the worker forwards that token on a
    copy: the store holds the state at turn 2's prompt end, equal to a prefill of it. A fresh
    cache (a restarted app) is served turn 3 at least turn 2's whole prompt from the store, and
    snapshots turn 3's end in turn (restored from a prompt end, it knows turn 3 extends one). The
    forward off the request path ran on a thread that outlives the learner (modelthread)."""
    from helpers import Proc, serving

    spy = _Spy(hybrid)
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        t2, out2 = learn_two_turns(hybrid, kv_home, hybrid_path, learner_model=spy)
        off_path = [t for t in spy.threads if t is not threading.main_thread()]
        assert off_path and all(t.name == modelthread.NAME for t in off_path)
        assert all(t.is_alive() for t in off_path)  # a closed learner ended no forward's thread
        with Store(kv_home, readonly=True) as ro:
            meta = ro.get_meta(entry_key(FP, t2))
            assert meta is not None, "no snapshot at turn 2's prompt end"
            _, stored = load_entry(ro, meta.key, meta.tokens)
        ref = make_prompt_cache(hybrid)
        hybrid(mx.array(t2)[None], cache=ref)
        mx.eval([c.state for c in ref])
        for a, b in zip(live_states(stored), live_states(ref), strict=True):
            assert a.shape == b.shape
            assert mx.allclose(a, b, atol=1e-4).item()
        # a restarted app: nothing in memory, the store is its cold tier
        fresh = PinnedPromptCache(max_size=4)
        learner = learner_of(fresh, kv_home, hybrid, hybrid_path)
        try:
            t3 = t2 + out2 + chat_tokens(30, seed=8)
            served, _ = chat_turn(hybrid, fresh, t3)
            assert served >= len(t2)
            # served from turn 2's end snapshot, so turn 3 extends a known end: its own end is
            # snapshotted too, and a second restart loses no turn either
            assert learner.drain(20.0)[1] == 0
            assert learner.snapshots_sent == 1
        finally:
            learner.close(timeout=5.0)
        with Store(kv_home, readonly=True) as ro:
            assert ro.get_meta(entry_key(FP, t3)).extra.prompt_end is True


CHATS_THEN_EXIT = """
import sys
from pathlib import Path
from mlx_lm.utils import load_model
from kvstore.client.persistent import PinnedPromptCache
from tests.client.learn_chat import learner_of, two_turns

home, path = Path(sys.argv[1]), Path(sys.argv[2])
model = load_model(path)[0]
for i in range(3):
    lru = PinnedPromptCache(max_size=4)
    learner = learner_of(lru, home, model, path)
    two_turns(model, lru, learner, seed=10 + 3 * i)
    learner.close(timeout=5.0)
    print("closed", i, flush=True)
lru = PinnedPromptCache(max_size=4)
learner = learner_of(lru, home, model, path)
two_turns(model, lru, learner, seed=40)
print("exiting", flush=True)  # the last learner is closed at exit (atexit), as an app's is
"""


def test_an_app_that_closes_learners_of_a_compiled_model_lives_and_exits_cleanly(
    hybrid_path, kv_home, tmp_path
):
    """A real app's lifetime on the qwen3_5 layout (module-level mx.compile functions): learners
    closed mid-process, the last one at interpreter exit. On mlx 0.31 a forward on the
    write-behind's thread aborted the process when that thread exited (SIGABRT or SIGSEGV in
    about half the closes: modelthread's docstring has the mlx issue)."""
    import subprocess
    import sys

    from helpers import Proc, serving

    repo = Path(__file__).resolve().parents[2]
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        p = subprocess.run(
            [sys.executable, "-c", CHATS_THEN_EXIT, str(kv_home), str(hybrid_path)],
            cwd=repo, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-3000:])
    assert p.stdout.split() == ["closed", "0", "closed", "1", "closed", "2", "exiting"]


def _kv_bytes(cache: list) -> int:
    return sum(c.keys.nbytes + c.values.nbytes for c in cache if type(c).__name__ == "KVCache")


def _state_bytes(cache: list) -> int:
    from mlx.utils import tree_flatten

    return sum(a.nbytes for c in cache if type(c).__name__ != "KVCache"
               for _, a in tree_flatten(c.state) if a is not None)  # fmt: skip


def test_a_hybrid_chat_stores_its_attention_kv_once_and_each_turn_only_a_state(
    hybrid, hybrid_path, kv_home, tmp_path
):
    """qwen3_5, a real daemon: a turn's end snapshot holds only the state layers (ArraysCache);
    its KV layers go as shared block records, so the next turn writes its new tokens' KV and
    one state, not the whole prompt's KV again. After a restart the store serves turn 3 turn 2's
    whole prompt, assembled from both, and turn 3's logits equal a cold prefill of that split."""
    from helpers import Proc, serving

    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        t2, out2 = learn_two_turns(hybrid, kv_home, hybrid_path)
        ref = make_prompt_cache(hybrid)
        hybrid(mx.array(t2)[None], cache=ref)
        mx.eval([c.state for c in ref])
        with Store(kv_home, readonly=True) as ro:
            meta = ro.get_meta(entry_key(FP, t2))
            assert meta.extra.kv_layers == [i for i, c in enumerate(ref)
                                               if type(c).__name__ == "KVCache"]  # fmt: skip
            assert meta.nbytes < _state_bytes(ref) + 2**16  # the state, not the KV again
            assert BlockStore(ro).stored_end(FP, t2) == len(t2)
            written = BlockStore(ro).written_today()
        # a restarted app: turn 3 restored from records + the state-only snapshot
        fresh = PinnedPromptCache(max_size=4)
        learner = learner_of(fresh, kv_home, hybrid, hybrid_path)
        try:
            t3 = t2 + out2 + chat_tokens(30, seed=8)
            before = prompt_tokens_from("store")
            cache, rest = fresh.fetch_nearest_cache(KEY, t3)
            assert prompt_tokens_from("store") - before == len(
                t2
            )  # turn 2's whole prompt from the store
            assert rest == t3[-1:]  # and split one short of its end, as in memory
            cold = make_prompt_cache(hybrid)
            hybrid(mx.array(t2)[None], cache=cold)
            hybrid(mx.array(t3[len(t2) : -1])[None], cache=cold)
            for a, b in zip(live_states(cache), live_states(cold), strict=True):
                assert a.shape == b.shape and mx.array_equal(a, b).item()
            logits = hybrid(mx.array(rest)[None], cache=cache)
            want = hybrid(mx.array(rest)[None], cache=cold)
            assert mx.array_equal(logits, want).item()
            fresh.insert_cache(KEY, t3, cache)
            assert learner.drain(20.0)[1] == 0
        finally:
            learner.close(timeout=5.0)
        with Store(kv_home, readonly=True) as ro:
            added = BlockStore(ro).written_today() - written
            assert ro.get_meta(entry_key(FP, t3)).extra.kv_layers
        new_kv = _kv_bytes(cold) * (len(t3) - len(t2)) / (len(t3) + 1)
        assert added <= 1.15 * (new_kv + _state_bytes(cold)) + 2**16, (added, new_kv)


def test_an_old_whole_cache_snapshot_is_still_served(hybrid, hybrid_path, kv_home, tmp_path,
                                                      monkeypatch):  # fmt: skip
    """A store written before state-only snapshots: its whole-cache snapshot is served as is."""
    from helpers import Proc, serving

    from kvstore.client import learn as client_learn

    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        monkeypatch.setattr(client_learn, "STATE_ONLY_SNAPSHOTS", False)
        t2, out2 = learn_two_turns(hybrid, kv_home, hybrid_path)
        monkeypatch.setattr(client_learn, "STATE_ONLY_SNAPSHOTS", True)
        with Store(kv_home, readonly=True) as ro:
            assert "kv_layers" not in ro.get_meta(entry_key(FP, t2)).extra.to_map()
        fresh = PinnedPromptCache(max_size=4)
        learner = learner_of(fresh, kv_home, hybrid, hybrid_path)
        try:
            before = prompt_tokens_from("store")
            chat_turn(hybrid, fresh, t2 + out2 + chat_tokens(30, seed=8))
            assert prompt_tokens_from("store") - before == len(t2)
        finally:
            learner.close(timeout=5.0)


def test_a_state_only_snapshot_whose_records_are_gone_is_not_served(hybrid, hybrid_path,
                                                                    kv_home, tmp_path):  # fmt: skip
    """Its KV layers are block records: when those were evicted, the snapshot is passed over
    (KeyError from load_entry; the cold tier prefills), never served with empty KV layers."""
    from helpers import Proc, serving

    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        t2, out2 = learn_two_turns(hybrid, kv_home, hybrid_path)
    with Store(kv_home) as rw:  # the daemon has stopped: this process may write
        blocks = BlockStore(rw)
        assert blocks.delete([m.key for m in blocks.records()]) > 0
        with pytest.raises(KeyError):
            load_entry(rw, entry_key(FP, t2), pack_tokens(t2))
    fresh = PinnedPromptCache(max_size=4)
    learner = learner_of(fresh, kv_home, hybrid, hybrid_path)
    try:
        before = prompt_tokens_from("store")
        cache, rest = fresh.fetch_nearest_cache(KEY, t2 + out2 + chat_tokens(30, seed=8))
        assert (
            cache is None and prompt_tokens_from("store") == before
        )  # prefilled, as without a store
    finally:
        learner.close(timeout=5.0)


def test_a_state_only_snapshot_exports_as_its_whole_cache(hybrid, hybrid_path, kv_home, tmp_path):
    """`kvstore export` of a state-only snapshot writes the assembled cache (KV from its records),
    a file mlx-lm loads, not the state with empty KV layers."""
    from helpers import Proc, cli, serving
    from mlx_lm.models.cache import load_prompt_cache

    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        t2, _ = learn_two_turns(hybrid, kv_home, hybrid_path)
    key = entry_key(FP, t2)
    with Store(kv_home, readonly=True) as ro:
        assert ro.get_meta(key).extra.kv_layers
        _, whole = load_entry(ro, key, pack_tokens(t2))
    cli("export", "--home", kv_home, key.hex(), tmp_path / "t2.safetensors", code=0)
    loaded = load_prompt_cache(str(tmp_path / "t2.safetensors"))
    assert codec.encode(loaded) == codec.encode(whole)
    assert all(c.offset == len(t2) for c in loaded if type(c).__name__ == "KVCache")
