"""Prompts with images (issue 34 item 5): mlx_lm.server 0.32.2 keys an image's patch tokens with a
negative id of its image (`_make_vision`: -1 - 60 bits of the image URL's sha256), which the
store's uint32 layout cannot hold. Memory serves them as mlx-lm's own cache would, a stored pin
that prefixes one serves it, and nothing of them is restored, learned, offered or packed: no
failed job, no traceback, no wrong key. Through the library's cache and through serve's hooks,
with a real daemon taking what is sent."""

from __future__ import annotations

import argparse
import logging
import types

import pytest
from helpers import Proc, serving
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from test_request_budget import prompt_after_pin

from kvstore import tokens

pytestmark = pytest.mark.slow

# two images, as mlx_lm.server numbers them
IMAGE_A = -1 - 0x0ABC_DEF0_1234_567
IMAGE_B = -1 - 0x0FED_CBA9_8765_432
PATCHES = 4  # image tokens a picture takes in these prompts


def image_key(prompt: list[int], image: int) -> tuple[list[int], int]:
    """The key mlx_lm.server fetches `prompt` under with `image`'s patches a few tokens before
    its end (where the user's turn holds it), and where they start."""
    at = len(prompt) - 6 - PATCHES
    return prompt[:at] + [image] * PATCHES + prompt[at + PATCHES :], at


def request(cache, model, tokenizer, model_key, prompt: list[int], key: list[int]) -> int:
    """One request as mlx_lm.server runs it with images: fetch and insert under `key`, prefill
    the real prompt's rest; the tokens the cache served."""
    kv, rest = cache.fetch_nearest_cache(model_key, key)
    served = len(prompt) - len(rest)
    kv = kv if kv is not None else make_prompt_cache(model)
    out = [r.token for r in stream_generate(model, tokenizer, prompt[served:], max_tokens=2,
                                            prompt_cache=kv)]  # fmt: skip
    cache.insert_cache(model_key, key + out, kv)
    return served


def test_ids_without_a_packed_form_are_not_storable():
    assert tokens.storable([]) and tokens.storable([0, 5, 2**32 - 1])
    assert not tokens.storable([1, 2, IMAGE_A, 3])
    assert not tokens.storable([1, 2**32])
    with pytest.raises(ValueError):
        tokens.pack([1, IMAGE_A])


def sent_nothing_bad(caplog) -> None:
    bad = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
           and "no daemon answers" not in r.getMessage()]  # fmt: skip
    assert bad == [], bad
    said = [r for r in caplog.records if "prompts with images" in r.getMessage()]
    assert len(said) == 1, said  # once a process


def test_the_library_cache_serves_image_prompts_from_memory_only(
    llama, llama_path, kv_home, tmp_path, caplog
):
    from kvstore.client import PersistentPromptCache

    caplog.set_level(logging.INFO)
    model, tokenizer = llama
    prompt = prompt_after_pin(tokenizer, "What is in this picture? Describe it in a few words.")
    key_a, at = image_key(prompt, IMAGE_A)
    key_b, _ = image_key(prompt, IMAGE_B)
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False) as d:
        with PersistentPromptCache.open(model, tokenizer, llama_path, home=kv_home, learn=True,
                                        persist_chains=True, verbose=False) as cache:  # fmt: skip
            key = cache.model_key
            assert request(cache, model, tokenizer, key, prompt, key_a) == 0
            assert request(cache, model, tokenizer, key, prompt, key_a) == len(prompt) - 1
            assert request(cache, model, tokenizer, key, prompt, key_b) == at  # not A's image
            assert request(cache, model, tokenizer, key, prompt, list(prompt)) == at  # text only
            assert cache.flush(10.0)
            assert cache.learner.reported == 1  # the text prompt's report; no image's
        chains = [e for e in d.request("ls") if e["label"] == "chain"]
        assert [e["tokens"] for e in chains] == [len(prompt) + 2], chains  # the text one
    sent_nothing_bad(caplog)


def test_serve_hooks_serve_image_prompts_from_pins_and_memory(
    llama, llama_path, kv_home, tmp_path, caplog
):
    from test_request_budget import warmed

    from kvstore.client.serve.hooks import patched_server

    caplog.set_level(logging.INFO)
    home = warmed.__wrapped__(llama_path, kv_home, tmp_path)  # the classify and synthesize pins
    model, tokenizer = llama
    model_key = (str(llama_path), None, None)
    args = argparse.Namespace(host="127.0.0.1", port=0, prefill_step_size=2048)
    provider = types.SimpleNamespace(model_key=model_key, model=model, tokenizer=tokenizer,
                                     cli_args=args)  # fmt: skip
    prompt = prompt_after_pin(tokenizer, "What is in this picture? Describe it in a few words.")
    key_a, at = image_key(prompt, IMAGE_A)
    key_b, _ = image_key(prompt, IMAGE_B)
    served, calls = [], []
    with serving(Proc(home, log=tmp_path / "daemon.log"), warm=False):
        got: list = []
        with patched_server(home, hooks_out=got) as server:
            (hooks,) = got
            hooks.warm_thread_started = hooks.ready = True  # no warm-up requests over HTTP here
            cache = server.LRUPromptCache(10)
            try:
                hooks.on_load(provider)
                pin = max(len(t) for t in cache.pins_of(model_key) if list(t) == prompt[: len(t)])
                for key in (key_a, key_a, key_b, list(prompt)):
                    ctx = types.SimpleNamespace(prompt=prompt, prompt_cache_count=0)
                    ctx.prompt_cache_count = request(cache, model, tokenizer, model_key, prompt,
                                                     key)  # fmt: skip
                    served.append(ctx.prompt_cache_count)
                    list(hooks.recorded(ctx, iter([1, 2])))  # the ledger record, its reasons
                hooks.flush()
                assert hooks.learner.drain(10.0)[1] == 0
                calls = list(hooks.stats.calls)
                reported = hooks.learner.reported
            finally:
                hooks.close(5.0)
                hooks.learner.close(5.0)
    assert served == [pin, len(prompt) - 1, at, at], served  # the pin serves the first
    assert [c.label for c in calls] == ["serve:classify"] * 4
    assert reported == 1  # the text prompt's report; no image's
    sent_nothing_bad(caplog)
