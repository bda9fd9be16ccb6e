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
            hooks.warm_up.started = hooks.ready = True  # no warm-up requests over HTTP here
            cache = server.LRUPromptCache(10)
            try:
                hooks.on_load(provider)
                pin = max(len(t) for t in cache.pins_of(model_key) if list(t) == prompt[: len(t)])
                for key in (key_a, key_a, key_b, list(prompt)):
                    ctx = types.SimpleNamespace(prompt=prompt, prompt_cache_count=0)
                    ctx.prompt_cache_count = request(cache, model, tokenizer, model_key, prompt,
                                                     key)  # fmt: skip
                    served.append(ctx.prompt_cache_count)
                    list(hooks.calls.recorded(ctx, iter([1, 2])))  # the ledger record, its reasons
                hooks.flush()
                assert hooks.learner.drain(10.0)[1] == 0
                calls = list(hooks.calls.stats.calls)
                reported = hooks.learner.reported
            finally:
                hooks.close(5.0)
                hooks.learner.close(5.0)
    assert served == [pin, len(prompt) - 1, at, at], served  # the pin serves the first
    assert [c.label for c in calls] == ["serve:classify"] * 4
    assert reported == 1  # the text prompt's report; no image's
    sent_nothing_bad(caplog)


IMAGE_TOKEN = 7  # the id every image's patches have in the prompt mlx_lm.server prefills


def metric(name: str, **labels: str) -> float:
    from kvstore import metrics

    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def prefilled_by_reason() -> float:
    from kvstore.reasons import REASONS

    return sum(metric("kvstore_prefilled_tokens_total", reason=r) for r in REASONS)


def test_serve_attributes_image_prompts_by_the_key_mlx_lm_caches_them_by(
    llama, llama_path, kv_home, tmp_path
):
    """Two images of one size give one prompt of token ids (`ctx.prompt`); mlx-lm caches each
    under its own key. A second image is new content (`suffix`, not `not_learned_yet` as the
    ids alone said), a resent image is memory's, and the reasons sum to the prefill counter."""
    from test_request_budget import warmed

    from kvstore.client.serve.hooks import patched_server

    home = warmed.__wrapped__(llama_path, kv_home, tmp_path)  # the classify and synthesize pins
    model, tokenizer = llama
    model_key = (str(llama_path), None, None)
    args = argparse.Namespace(host="127.0.0.1", port=0, prefill_step_size=2048)
    provider = types.SimpleNamespace(model_key=model_key, model=model, tokenizer=tokenizer,
                                     cli_args=args)  # fmt: skip
    text = prompt_after_pin(tokenizer, "What is in this picture? Describe it in a few words.")
    at = image_key(text, IMAGE_A)[1]
    prompt = text[:at] + [IMAGE_TOKEN] * PATCHES + text[at + PATCHES :]  # as the server's
    n = len(prompt)
    got: list = []
    rows = []
    with patched_server(home, hooks_out=got) as server:
        (hooks,) = got
        hooks.warm_up.started = hooks.ready = True  # no warm-up requests over HTTP here
        cache = server.LRUPromptCache(10)
        try:
            hooks.on_load(provider)
            pin = max(len(t) for t in cache.pins_of(model_key) if list(t) == prompt[: len(t)])
            for image in (IMAGE_A, IMAGE_A, IMAGE_B):
                key = image_key(prompt, image)[0]
                before = (metric("kvstore_prompt_tokens_total", source="memory"),
                          metric("kvstore_prompt_tokens_total", source="prefill"),
                          prefilled_by_reason())  # fmt: skip
                ids = list(prompt)  # a request's own list, as `_tokenize` gives it
                vision = types.SimpleNamespace(cache_key=list(key))  # mlx_lm.server's Vision
                hooks.calls.tokenized((ids, [ids], ["assistant"], "normal", vision))
                ctx = types.SimpleNamespace(prompt=ids, prompt_cache_count=0)
                ctx.prompt_cache_count = request(cache, model, tokenizer, model_key, ids, key)
                list(hooks.calls.recorded(ctx, iter([1, 2])))  # the ledger record, its reasons
                after = (metric("kvstore_prompt_tokens_total", source="memory"),
                         metric("kvstore_prompt_tokens_total", source="prefill"),
                         prefilled_by_reason())  # fmt: skip
                rows.append((hooks.calls.stats.calls[-1], [b - a for a, b in zip(before, after)]))
        finally:
            hooks.close(5.0)
            if hooks.learner is not None:
                hooks.learner.close(5.0)
    (first, d1), (again, d2), (other, d3) = rows
    assert [c.cached_tokens for c, _ in rows] == [pin, n - 1, at]
    assert first.prefilled_by_reason() == {"suffix": n - pin}
    assert again.prefilled_by_reason() == {"suffix": 1}  # resent: memory served all but one
    assert d2[0] == n - 1 - pin  # memory's (the pin's part is the store's)
    # another image of the same size: the same ids, new content (was not_learned_yet n-1-at)
    assert other.prefilled_by_reason() == {"suffix": n - at}, other.reasons
    for call, (_, prefill, reasons) in rows:  # the reasons sum to the prefill counter
        assert sum(call.prefilled_by_reason().values()) == call.prefilled_tokens
        assert prefill == reasons == call.prefilled_tokens


def test_a_context_without_its_tokenize_is_attributed_by_its_prompt(llama_path, kv_home):
    """A key kept for another prompt list, one of another length, or none: never used."""
    from kvstore.client.serve.hooks import _Hooks

    hooks = _Hooks(kv_home, persist=False, learn=False)
    try:
        ids, other = [1, 2, 3], [1, 2, 3]
        # no images: nothing kept
        hooks.calls.tokenized((ids, [ids], ["assistant"], "normal", None))
        assert hooks.calls.image_key_of(ids, 3) is None
        hooks.calls.tokenized((ids, [ids], ["assistant"], "normal",
                         types.SimpleNamespace(cache_key=[1, IMAGE_A, 3])))  # fmt: skip
        assert hooks.calls.image_key_of(other, 3) is None  # equal, but not the request's own list
        assert hooks.calls.image_key_of(ids, 3) == [1, IMAGE_A, 3]
        assert hooks.calls.image_key_of(ids, 3) is None  # taken once
        image_a = types.SimpleNamespace(cache_key=[IMAGE_A])
        hooks.calls.tokenized((ids, [ids], [], "normal", image_a))
        assert hooks.calls.image_key_of(ids, 3) is None  # not a key of this prompt
        for _ in range(40):  # bounded: contexts that never record leave nothing behind
            x = [5]
            image_b = types.SimpleNamespace(cache_key=[IMAGE_B])
            hooks.calls.tokenized((x, [x], [], "normal", image_b))
        assert len(hooks.calls._image_keys) <= 16
    finally:
        hooks.close(1.0)


def test_the_adapter_reads_the_key_mlx_lm_server_makes():
    """kvstore.mlxlm.image_cache_key against the installed mlx_lm.server's own `_make_vision`
    (0.32; 0.31 has no images: its `_tokenize` gives four values)."""
    from mlx_lm import server

    from kvstore import mlxlm

    assert mlxlm.image_cache_key(([1, 2], [[1, 2]], ["assistant"], "normal")) is None
    assert mlxlm.image_cache_key(([1, 2], [[1, 2]], ["assistant"], "normal", None)) is None
    make = getattr(server, "_make_vision", None)
    if make is None:
        pytest.skip(f"mlx-lm {mlxlm.version()} serves no images")
    prompt = [1, 2, IMAGE_TOKEN, IMAGE_TOKEN, 3, IMAGE_TOKEN, IMAGE_TOKEN, 4]
    vision = make(prompt, urls=["data:a", "data:b"], pixel_values=[], token_id=IMAGE_TOKEN)
    key = mlxlm.image_cache_key((prompt, [prompt], ["assistant"], "normal", vision))
    assert key == vision.cache_key and key is not vision.cache_key  # a copy: mlx-lm appends
    assert key[:2] == [1, 2] and key[2] == key[3] < 0 and key[5] == key[6] < 0 != key[2] - key[5]
    assert not tokens.storable(key)


def test_attribution_of_an_image_key_never_decodes_an_image():
    """The attribution compares an image key packed (each image its own id past the vocabulary)
    and decodes only text: a tokenizer given a negative id may raise anything."""
    from kvstore.reasons import Attributor, packed

    def decode(ids):
        if any(t < 0 for t in ids):
            raise RuntimeError("negative id")
        return " ".join(map(str, ids))

    text = list(range(10, 60))
    key_a = text[:20] + [IMAGE_A] * 4 + text[24:]
    key_b = text[:20] + [IMAGE_B] * 4 + text[24:]
    assert packed(key_a) != packed(key_b) and packed(key_a)[:80] == packed(text)[:80]
    attribute = Attributor()
    pins = {tuple(text[:30]): "sys"}  # the request leaves it where its image starts
    spans = attribute(key_a, 10, pins, decode)
    assert sum(s["tokens"] for s in spans) == len(key_a) - 10
    assert spans[0]["reason"] == "diverged" and spans[0]["position"] == 20, spans
    assert "stored_text" in spans[0]
    again = attribute(key_b, 20, pins, decode)  # the same ids but another image: not seen
    assert "not_learned_yet" not in {s["reason"] for s in again}, again
    resent = attribute(key_a, 22, {}, decode)  # the same image again: seen
    assert resent[0]["reason"] == "not_learned_yet", resent
