"""kvstore.client.load: the model and tokenizer mlx_lm.load gives, and a PersistentPromptCache
hydrated on a second thread while the weights loaded, equal to a fresh prefill; the thread is gone
afterwards, and a process that used it exits cleanly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import mlx.core as mx
import mlx_lm
import pytest
from helpers import assert_same_kv, mlx_lm_prefill, warm_two_pins
from mlx_lm import load as mlx_load

from kvstore import client
from kvstore.identity.fingerprint import model_fingerprint

LOAD_MODULE = sys.modules["kvstore.client.load"]  # `kvstore.client.load` is the function
HYDRATE_MODULE = sys.modules["kvstore.client.hydrate"]
LOADER_MODULE = sys.modules["kvstore.client.loader"]


@pytest.mark.parametrize(
    "overlap, idle, reader",
    [
        (True, None, "kvstore-prefetch"),
        (False, None, "MainThread"),
        (None, "2", "kvstore-prefetch"),  # by default: beside the load only on an idle core
        (None, "0", "MainThread"),
    ],
)
def test_load_returns_a_cache_hydrated_while_the_weights_loaded(
    overlap, idle, reader, hybrid_path, kv_home, tmp_path, monkeypatch
):
    metas = warm_two_pins(tmp_path, kv_home, hybrid_path)
    seen: list[str] = []
    real = LOAD_MODULE.prefetch

    def spy(*a, **k):
        seen.append(threading.current_thread().name)
        return real(*a, **k)

    fingerprints = []
    for module in (HYDRATE_MODULE, LOADER_MODULE):
        counted = module.model_fingerprint
        monkeypatch.setattr(
            module,
            "model_fingerprint",
            lambda *a, _f=counted, **k: fingerprints.append(1) or _f(*a, **k),
        )
    if idle is not None:
        monkeypatch.setenv("KVSTORE_IDLE_CORES", idle)
    monkeypatch.setattr(LOAD_MODULE, "prefetch", spy)
    model, tokenizer, cache = client.load(hybrid_path, home=kv_home, stats=False, overlap=overlap)
    try:
        assert seen == [reader]  # read once, beside the load or after it
        assert fingerprints == [1]  # the files' fingerprint, taken once before the load
        assert cache.report.warning is None and cache.report.entries == 2
        fp = model_fingerprint(hybrid_path, model_object=model)  # layout from the loaded model
        assert cache.fingerprint == fp.digest
        reference, _ = mlx_load(str(hybrid_path))
        for meta in metas.values():
            kv, rest = cache.fetch_nearest_cache(str(hybrid_path), [*meta.token_ids(), 7])
            assert rest == [7]
            assert_same_kv(kv, mlx_lm_prefill(reference, meta.token_ids()))
        assert tokenizer.encode("hello") == mlx_load(str(hybrid_path))[1].encode("hello")
    finally:
        cache.close()
    assert not [t for t in threading.enumerate() if t.name == "kvstore-prefetch"]


@pytest.mark.parametrize("overlap", [True, False])
def test_load_hydrates_nothing_when_the_weights_change_while_they_load(
    overlap, model_copy, kv_home, tmp_path, monkeypatch
):
    """Read beside the load or after it: entries of the files as they were when load started
    are never filed for weights read from changed files."""
    warm_two_pins(tmp_path, kv_home, model_copy)
    real = mlx_lm.load

    def load_during_an_update(path, *a, **kw):
        weights = model_copy / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
        return real(path, *a, **kw)

    monkeypatch.setattr(mlx_lm, "load", load_during_an_update)
    _, _, cache = client.load(model_copy, home=kv_home, stats=False, overlap=overlap)
    try:
        assert cache.report.entries == 0 and len(cache) == 0
        assert "changed while it was loading" in cache.report.warning
    finally:
        cache.close()


def test_load_without_a_store_warns_and_loads(llama_path, tmp_path):
    model, _, cache = client.load(llama_path, home=tmp_path / "no-home", stats=False)
    try:
        assert cache.report.entries == 0 and "prefilling as usual" in cache.report.warning
        assert model(mx.array([[1, 2]])).shape[-1] == 512
    finally:
        cache.close()


def test_a_process_that_used_load_exits_cleanly(hybrid_path, kv_home, tmp_path):
    warm_two_pins(tmp_path, kv_home, hybrid_path)
    code = textwrap.dedent(f"""
        from kvstore import client
        for _ in range(3):
            model, tok, cache = client.load({str(hybrid_path)!r}, home={str(kv_home)!r},
                                            stats=False)
            assert cache.report.entries == 2, cache.report
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("warm", [True, False])
def test_load_pays_the_first_calls_one_time_costs(
    warm, hybrid_path, kv_home, tmp_path, monkeypatch
):
    """The chat template is compiled and one forward runs on a copy of the largest hydrated
    prefix inside load (warm=True), so the app's first generate does not pay them; the cache's
    own entries are untouched by it."""
    from transformers.utils import chat_template_utils

    from kvstore.codec import codec

    metas = warm_two_pins(tmp_path, kv_home, hybrid_path)
    compiled = chat_template_utils._compile_jinja_template  # an lru_cache
    compiled.cache_clear()
    forwards = []
    real = LOAD_MODULE.first_call
    monkeypatch.setattr(
        LOAD_MODULE,
        "first_call",
        lambda m, t, e, k: forwards.append((e, k)) or real(m, t, e, k),
    )
    model, _, cache = client.load(hybrid_path, home=kv_home, stats=False, warm=warm)
    try:
        assert (compiled.cache_info().currsize == 1) is warm
        if warm:
            longest = max(metas.values(), key=lambda m: m.ntokens)
            ((kv, tokens),) = forwards
            assert codec.cache_tokens(kv) == longest.ntokens and tokens == longest.token_ids()
        for meta in metas.values():
            kv, rest = cache.fetch_nearest_cache(str(hybrid_path), [*meta.token_ids(), 7])
            assert rest == [7]
            assert_same_kv(kv, mlx_lm_prefill(model, meta.token_ids()))
    finally:
        cache.close()


def test_load_warms_on_a_fresh_cache_when_every_entry_is_large(
    hybrid_path, kv_home, tmp_path, monkeypatch
):
    """Above WARM_ENTRY_BYTES a stored prefix's grown copy would cost load as much as the
    request it spares: the warm-up forward then runs on a fresh cache."""
    warm_two_pins(tmp_path, kv_home, hybrid_path)
    monkeypatch.setattr(LOAD_MODULE, "WARM_ENTRY_BYTES", 0)
    forwards = []
    real = LOAD_MODULE.first_call
    monkeypatch.setattr(
        LOAD_MODULE,
        "first_call",
        lambda m, t, e, k: forwards.append((e, k)) or real(m, t, e, k),
    )
    _, _, cache = client.load(hybrid_path, home=kv_home, stats=False)
    try:
        assert forwards == [(None, [])] and cache.report.entries == 2
    finally:
        cache.close()


FIRST_CALL_PROBE = """
import json, sys
import kvstore.client.persistent
from kvstore import client
kvstore.client.persistent.HIT_BATCH_S = 1e9  # no hits batch falls due in one call only
model, tok, cache = client.load(sys.argv[1], home=sys.argv[2], stats=False, warm=sys.argv[3] == "1")
def ran(i):  # the Python functions one request runs, its template to its first token
    seen = set()
    def probe(frame, event, arg):
        if event == "call":
            seen.add((frame.f_code.co_filename, frame.f_code.co_name))
    messages = [{"role": "system", "content": sys.argv[4]}, {"role": "user", "content": f"q {i}"}]
    sys.setprofile(probe)
    try:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        for _ in client.stream_generate(cache, model, tok, prompt, max_tokens=2):
            sys.setprofile(None)  # before the generator's end inserts the transcript
            break
    finally:
        sys.setprofile(None)
    return seen
first, later = ran(0), ran(1) | ran(2)
print(json.dumps(sorted(name for _, name in first - later)))
cache.close()
"""


@pytest.mark.parametrize("arch, warm", [("llama", True), ("qwen3_5", True), ("llama", False)])
def test_the_first_generate_after_load_runs_nothing_later_ones_do_not(
    arch, warm, llama_path, hybrid_path, kv_home, tmp_path
):
    """In a new interpreter, the first request after load(warm=True) runs no Python function
    that the next two do not: no `mx.compile` trace on mlx-lm's generation stream (a warm-up
    forward on the default stream left the generate's own to trace), no detokenizer table, no
    lazy import. Without the warm-up the same probe sees them."""
    from helpers import CLASSIFY

    path = llama_path if arch == "llama" else hybrid_path
    warm_two_pins(tmp_path, kv_home, path)
    out = subprocess.run(
        [sys.executable, "-c", FIRST_CALL_PROBE, str(path), str(kv_home), str(int(warm)), CLASSIFY],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    only_first = json.loads(out.stdout.strip().splitlines()[-1])
    if warm:
        assert only_first == []
    else:
        assert only_first  # the probe sees what the first call pays


def test_loads_warm_up_changes_no_later_call(llama_path, kv_home, tmp_path):
    """The warm-up runs on a copy: the cache's entries and byte count, its stats and mlx's
    random state are as without it, and greedy and seeded sampled calls return the same."""
    from helpers import CLASSIFY
    from mlx_lm.sample_utils import make_sampler

    warm_two_pins(tmp_path, kv_home, llama_path)
    seen = {}
    for warm in (False, True):
        mx.random.seed(7)
        model, tok, cache = client.load(llama_path, home=kv_home, warm=warm, verbose=False)
        try:
            state = (len(cache), cache.nbytes, list(cache.stats.calls), mx.random.state[0].tolist())
            texts = []
            for i, sampler in enumerate((None, make_sampler(temp=1.0), None)):
                messages = [
                    {"role": "system", "content": CLASSIFY},
                    {"role": "user", "content": f"my invoice {i} was charged twice"},
                ]
                prompt = tok.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
                texts.append(
                    client.generate(cache, model, tok, prompt, max_tokens=8, sampler=sampler)
                )
            seen[warm] = (state, texts, [c.cached_tokens for c in cache.stats.calls])
        finally:
            cache.close()
    assert seen[True] == seen[False]


@pytest.mark.parametrize("warm", [True, False])
def test_the_warmed_pin_has_room_for_the_first_request(warm, llama_path, kv_home, tmp_path):
    """A hydrated prefix holds exactly its tokens; the one load's warm-up extended a copy of
    holds the same KV with mlx-lm's 256 tokens of room (the copy, trimmed back), so the app's
    first request through it does not copy the whole prefix into a longer buffer. Without the
    warm-up it is the stored size."""
    metas = warm_two_pins(tmp_path, kv_home, llama_path)
    longest = max(metas.values(), key=lambda m: m.ntokens)
    model, _, cache = client.load(llama_path, home=kv_home, stats=False, warm=warm)
    try:
        kv, rest = cache.fetch_nearest_cache(str(llama_path), [*longest.token_ids(), 7])
        assert rest == [7]
        n = longest.ntokens
        assert all(c.offset == n for c in kv)
        assert all((c.keys.shape[2] > n) is warm for c in kv)
        assert_same_kv(kv, mlx_lm_prefill(model, longest.token_ids()))
        others = [m for m in metas.values() if m is not longest]
        for meta in others:  # not warmed: as stored
            other, _ = cache.fetch_nearest_cache(str(llama_path), meta.token_ids())
            assert all(c.keys.shape[2] == meta.ntokens for c in other)
    finally:
        cache.close()
