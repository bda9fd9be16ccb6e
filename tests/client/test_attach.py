"""`kvstore.client.attach`: mlx-lm calls made without a prompt_cache, for an attached model, are
served from its persistent cache with the tokens mlx-lm alone gives; everything else is left to
mlx-lm; detach undoes it; a fault of the cache costs one warning and nothing else. The frameworks
themselves: tests/integrations."""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
from unittest import mock

import mlx.core as mx
import mlx_lm
import mlx_lm.generate  # noqa: F401  (the module, for sys.modules)
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from kvstore.client import attach
from kvstore.client.persistent import PersistentPromptCache
from tests.helpers import CLASSIFY, assert_same_kv, mlx_lm_prefill

GEN = sys.modules["mlx_lm.generate"]
MAX = 12


@pytest.fixture(scope="module")
def llama(llama_path):
    return mlx_lm.load(str(llama_path))


def turns(tok, *extra: str) -> list[int]:
    """An agent's prompt: the system prompt, the task, and each earlier step's exchange."""
    messages = [{"role": "system", "content": CLASSIFY * 3}, {"role": "user", "content": "Task 1"}]
    for i, said in enumerate(extra):
        messages += [
            {"role": "assistant", "content": said},
            {"role": "user", "content": f"Obs {i}"},
        ]
    return list(tok.apply_chat_template(messages, add_generation_prompt=True))


def penalty():
    # over the whole prompt: a processor that saw only the uncached rest would change the output
    return make_logits_processors(repetition_penalty=1.6, repetition_context_size=100_000)


def spying(seen: list) -> list:
    """mlx-lm's repetition penalty, after a processor that records the history it is given."""
    return [lambda tokens, logits: seen.append(tokens.tolist()) or logits, *penalty()]


def test_an_attached_model_prefills_only_what_is_new_and_answers_as_mlx_lm(llama, llama_path):
    model, tok = llama
    first = turns(tok)
    plain1 = mlx_lm.generate(model, tok, first, max_tokens=MAX, logits_processors=penalty())
    second = turns(tok, plain1)
    plain_seen: list = []
    plain2 = mlx_lm.generate(
        model, tok, second, max_tokens=MAX, logits_processors=spying(plain_seen)
    )
    with attach(model, tok, llama_path, verbose=False) as att:
        step1 = mlx_lm.generate(model, tok, first, max_tokens=MAX, logits_processors=penalty())
        seen: list = []
        step2 = mlx_lm.generate(model, tok, second, max_tokens=MAX, logits_processors=spying(seen))
        calls = att.calls
        kept, rest = att.cache.fetch_nearest_cache(att.cache.model_key, second)
    assert (step1, step2) == (plain1, plain2)  # token-identical to mlx-lm without kvstore
    assert [c.prompt_tokens for c in calls] == [len(first), len(second)]
    assert calls[0].cached_tokens == 0
    assert calls[1].cached_tokens >= len(first)  # the second step prefilled only what is new
    # processors get the history mlx-lm gives them (0.32: the whole prompt, not only the rest)
    assert seen == plain_seen
    assert_same_kv(kept, mlx_lm_prefill(model, second[: len(second) - len(rest)]))


def test_a_call_with_its_own_prompt_cache_or_another_model_is_left_alone(llama, llama_path):
    model, tok = llama
    other, _ = mlx_lm.load(str(llama_path))  # the same files, another model object
    prompt = turns(tok)
    with attach(model, tok, llama_path, verbose=False) as att:
        own = make_prompt_cache(model)
        mlx_lm.generate(model, tok, prompt, max_tokens=MAX, prompt_cache=own)
        mlx_lm.generate(other, tok, prompt, max_tokens=MAX)
        assert att.calls == [] and len(att.cache) == 0  # neither went through the cache
    assert own[0].offset >= len(prompt)  # the app's cache holds its whole prompt, as always


def test_detach_puts_mlx_lm_back(llama, llama_path):
    model, tok = llama
    plain = GEN.generate_step
    att = attach(model, tok, llama_path, verbose=False)
    assert GEN.generate_step is not plain and att.attached
    assert attach(model, tok, llama_path) is att  # attached already: the same attachment
    att.detach()
    att.detach()  # twice: nothing more
    assert GEN.generate_step is plain and not att.attached
    mlx_lm.generate(model, tok, turns(tok), max_tokens=MAX)
    assert att.calls == []


def test_interleaved_calls_keep_their_own_state(llama, llama_path):
    """Two generations in flight at once (two agents, two threads' generators): each has its own
    prefix, rest and transcript."""
    model, tok = llama
    a, b = turns(tok), turns(tok, "step one said this")
    want = [mlx_lm.generate(model, tok, p, max_tokens=MAX) for p in (a, b)]
    with attach(model, tok, llama_path, verbose=False) as att:
        mlx_lm.generate(model, tok, a, max_tokens=MAX)  # a is cached now: b is served from it
        ga = mlx_lm.stream_generate(model, tok, a, max_tokens=MAX)
        gb = mlx_lm.stream_generate(model, tok, b, max_tokens=MAX)
        got = ["", ""]
        for ra, rb in itertools.zip_longest(ga, gb):
            got[0] += ra.text if ra else ""
            got[1] += rb.text if rb else ""
        calls = att.calls
    assert got == want
    assert [c.prompt_tokens for c in calls[1:]] == [len(a), len(b)]
    assert all(c.cached_tokens > len(a) // 2 for c in calls[1:])


def test_a_fault_of_the_cache_is_one_warning_and_a_plain_prefill(llama, llama_path, caplog):
    model, tok = llama
    prompt = turns(tok)
    want = mlx_lm.generate(model, tok, prompt, max_tokens=MAX)
    broken = mock.patch.object(
        PersistentPromptCache, "fetch_nearest_cache", side_effect=OSError("disk gone")
    )
    with attach(model, tok, llama_path, verbose=False), broken, caplog.at_level(logging.WARNING):
        got = [mlx_lm.generate(model, tok, prompt, max_tokens=MAX) for _ in range(2)]
    assert got == [want, want]
    said = [r.getMessage() for r in caplog.records if "disk gone" in r.getMessage()]
    assert len(said) == 1 and "prefilling as without kvstore" in said[0]


def test_a_call_generate_step_refuses_fails_as_it_does_without_kvstore(llama, llama_path):
    model, tok = llama
    with pytest.raises(TypeError) as plain:
        mlx_lm.generate(model, tok, turns(tok), max_tokens=MAX, formatter=None)
    with attach(model, tok, llama_path, verbose=False) as att:
        with pytest.raises(TypeError) as attached:
            mlx_lm.generate(model, tok, turns(tok), max_tokens=MAX, formatter=None)
    assert str(attached.value) == str(plain.value) and att.calls == []


def test_whole_history_puts_the_cached_head_in_front_where_mlx_lm_shows_the_prompt():
    from kvstore import mlxlm

    seen: list = []
    head = mx.array([5, 6, 7])
    (p,) = mlxlm.whole_history(
        GEN.generate_step, [lambda t, lg: seen.append(t.tolist()) or lg], head
    )
    p(mx.array([8, 9]), mx.zeros((1, 4)))
    whole = mlx_lm.__version__ >= "0.32"  # 0.31 shows processors the last prompt token only
    assert seen == [[5, 6, 7, 8, 9] if whole else [8, 9]]
    assert mlxlm.whole_history(GEN.generate_step, None, head) is None


THREADS = r"""
import json, os, sys, threading
import mlx_lm
from kvstore.client import attach

path = sys.argv[1]
model, tok = mlx_lm.load(path)
system = {"role": "system", "content": "You are the router. " * 40}
prompts = [tok.apply_chat_template([system, {"role": "user", "content": f"request {i}"}],
                                   add_generation_prompt=True) for i in range(4)]
want = [mlx_lm.generate(model, tok, p, max_tokens=12) for p in prompts]
got = [None] * 4
with attach(model, tok, path, verbose=False) as att:
    mlx_lm.generate(model, tok, prompts[0], max_tokens=12)

    def run(i):
        got[i] = mlx_lm.generate(model, tok, prompts[i], max_tokens=12)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    cached = [c.cached_tokens for c in att.calls]
print(json.dumps({"same": got == want, "cached": cached, "prompt": len(prompts[1])}), flush=True)
os._exit(0)  # mlx-lm alone can abort at interpreter exit after generating on several threads
"""


def test_four_threads_generate_through_one_attached_model(llama_path, kv_home):
    """Each call's state is its own (the cache's LRU and stats are locked between calls); in a
    process of its own, since mlx may abort at exit after threads generated, with or without
    kvstore."""
    proc = subprocess.run(
        [sys.executable, "-c", THREADS, str(llama_path)], capture_output=True, text=True,
        timeout=300, env={**os.environ, "KVSTORE_HOME": str(kv_home)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["same"]  # every thread's answer is mlx-lm's
    assert len(res["cached"]) == 5 and all(c > res["prompt"] // 2 for c in res["cached"][1:])


def test_progress_counts_the_whole_prompt(llama, llama_path):
    model, tok = llama
    prompt = turns(tok)
    plain: list = []
    mlx_lm.generate(
        model, tok, prompt, max_tokens=2, prompt_progress_callback=lambda *a: plain.append(a)
    )
    seen: list = []
    with attach(model, tok, llama_path, verbose=False):
        mlx_lm.generate(model, tok, prompt, max_tokens=2)
        mlx_lm.generate(
            model, tok, prompt, max_tokens=2, prompt_progress_callback=lambda *a: seen.append(a)
        )
    assert plain[-1] == seen[-1] == (len(prompt), len(prompt))  # a progress bar still ends full
    assert seen[0][0] >= len(prompt) - 1  # and starts where the cache left off


@pytest.mark.parametrize("where", ["/nonexistent/model", 42])
def test_a_bad_model_path_is_one_warning_and_the_answers_of_mlx_lm(llama, where, caplog):
    """Nothing hydrated or persisted; calls still answer as mlx-lm does (served from memory)."""
    model, tok = llama
    prompt = turns(tok)
    want = mlx_lm.generate(model, tok, prompt, max_tokens=MAX)
    with caplog.at_level(logging.WARNING, logger="kvstore.client"):
        with attach(model, tok, where, verbose=False) as att:  # type: ignore[arg-type]
            got = [mlx_lm.generate(model, tok, prompt, max_tokens=MAX) for _ in range(2)]
    assert got == [want, want]
    said = [r.getMessage() for r in caplog.records if "not hydrating" in r.getMessage()]
    assert len(said) == 1 and str(where) in said[0]
    assert att.cache.report.warning == said[0]
