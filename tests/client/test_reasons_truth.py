"""Reasons that tell the truth (issue 34, section 2), through the library on real chat templates:
a hybrid chat's own prefill (the learner's split inside the fetch) is prefill with a reason and
never cached; a request that shares only a template's fixed header with a pin is not
`diverged`; a stopped daemon over a readable store is not `unavailable`."""

from __future__ import annotations

import mlx_lm
from helpers import OLD, Proc, serving, system, wait_for

from kvstore import metrics
from kvstore.client import PersistentPromptCache, generate
from kvstore.reasons import REASONS
from kvstore.tiny import make_tiny_model

SYSTEM = "You are the guide desk of a small company. Answer in one short sentence. " * 3


def chat_turns(turns: int) -> list[list[dict]]:
    """Each turn's messages: the replies are fixed text, so each prompt extends the last."""
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}]
    out = []
    for i in range(turns):
        msgs = [
            *msgs,
            {"role": "user", "content": f"Question {i}: where is page {i} of the guide?"},
        ]
        out.append(msgs)
        msgs = [*msgs, {"role": "assistant", "content": f"Page {i} is under Guides; editor {i}."}]
    return out


def source(name: str) -> float:
    return metrics.REGISTRY.get_sample_value("kvstore_prompt_tokens_total", {"source": name}) or 0


def prefilled_total() -> float:
    return sum(
        metrics.REGISTRY.get_sample_value("kvstore_prefilled_tokens_total", {"reason": r}) or 0
        for r in REASONS
    )


def test_a_hybrid_chats_own_prefill_is_prefilled_with_a_reason_not_cached(hybrid_path, tmp_path):
    """On a state layout the learner prefills all but the last token inside the fetch (a turn
    that extends the last one's whole prompt) and hands mlx-lm a one-token remainder: those
    tokens are prefilled, with a reason; cached_tokens is what memory and the store served."""
    home = tmp_path / "hybrid-home"
    model, tokenizer = mlx_lm.load(str(hybrid_path))
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in chat_turns(5)]
    with serving(Proc(home, log=tmp_path / "daemon.log"), warm=False):
        with PersistentPromptCache.open(model, tokenizer, hybrid_path, home=home, learn=True,
                                        verbose=False) as cache:  # fmt: skip
            start = (source("prefill"), prefilled_total())
            for prompt in prompts:
                before = (source("memory") + source("store"), source("prefill"))
                generate(cache, model, tokenizer, prompt, max_tokens=2)
                call = cache.stats.calls[-1]
                reused = source("memory") + source("store") - before[0]
                assert call.cached_tokens == reused, (call.line(), reused)
                assert call.prefilled_tokens == source("prefill") - before[1], call.line()
                assert sum(call.prefilled_by_reason().values()) == call.prefilled_tokens
            calls = cache.stats.calls
    # turn 2 extends turn 1's whole prompt: split one short of its end inside the fetch
    assert calls[1].prefilled_tokens > len(prompts[1]) - len(prompts[0]), calls[1].line()
    assert source("prefill") - start[0] == prefilled_total() - start[1]
    assert sum(c.prefilled_tokens for c in calls) == source("prefill") - start[0]


def test_a_stopped_daemon_over_a_readable_store_is_not_unavailable(model_copy, tmp_path):
    """The daemon stopped, its store readable, the weights changed since a pin was stored:
    `model_changed (weights)` and `suffix`, not `unavailable` (only when nothing could be
    read)."""
    home = tmp_path / "stopped-home"
    model, tokenizer = mlx_lm.load(str(model_copy))
    router = [{"role": "system", "content": system(OLD)}]
    with serving(Proc(home, log=tmp_path / "daemon.log"), warm=False):
        with PersistentPromptCache.open(model, tokenizer, model_copy, home=home,
                                        verbose=False) as cache:  # fmt: skip
            cache.pin("router", messages=router)
            assert cache.flush()
    other = make_tiny_model(tmp_path / "other" / "llama", "llama", seed=1)
    (model_copy / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    model, tokenizer = mlx_lm.load(str(model_copy))
    request = [*router, {"role": "user", "content": "My invoice 2291 was charged twice."}]
    with PersistentPromptCache.open(model, tokenizer, model_copy, home=home,
                                    verbose=False) as cache:  # fmt: skip
        generate(cache, model, tokenizer,
                 tokenizer.apply_chat_template(request, add_generation_prompt=True),
                 max_tokens=2)  # fmt: skip
        (call,) = cache.stats.calls
    by = call.prefilled_by_reason()
    assert "unavailable" not in by, call.reasons
    (m,) = [s for s in call.reasons if s["reason"] == "model_changed"]
    assert m["differs"] == "weights" and m["tokens"] > 0, call.reasons
    assert by.get("suffix", 0) > 0 and sum(by.values()) == call.prefilled_tokens


def _ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_a_request_sharing_only_the_template_header_with_a_pin_is_cold(
    llama, llama_path, kv_home, tmp_path
):
    """A system prompt never stored, and a user-only request, share only the chat template's
    header with a pin: `cold` (and the last token, which every request prefills, `suffix`)."""
    from helpers import ROUTER, manifest_for

    from kvstore.ops.warm import warm
    from kvstore.pins.manifest import load_manifest
    from kvstore.store.store import Store

    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, llama_path, ROUTER)), store, home=kv_home)
    model, tokenizer = llama
    user = {"role": "user", "content": "What is the weather in Paris tomorrow?"}
    helpful = {"role": "system", "content": "You are a helpful assistant."}
    with PersistentPromptCache.open(model, tokenizer, llama_path, verbose=False) as cache:
        for messages in ([helpful, user], [user]):
            generate(cache, model, tokenizer, _ids(tokenizer, messages), max_tokens=1)
            call = cache.stats.calls[-1]
            assert call.prefilled_by_reason() == {"suffix": 1, "cold": call.prefilled_tokens - 1}, (
                call.line()
            )
        # the pin's own system prompt: served it, the rest is the request's own
        router = [{"role": "system", "content": system(OLD)}, user]
        generate(cache, model, tokenizer, _ids(tokenizer, router), max_tokens=1)
        call = cache.stats.calls[-1]
        assert call.prefilled_by_reason() == {"suffix": call.prefilled_tokens}, call.line()


def test_a_new_user_turn_after_a_learned_chain_is_not_diverged(llama, llama_path, tmp_path):
    """A conversation learned (turn 2 extends turn 1's whole prompt), then, after a restart, a
    new conversation with the same system prompt: it leaves the learned chain where its user
    turn starts, which is its own content, not a divergence."""
    model, tokenizer = llama
    home = tmp_path / "learned-home"
    turns = chat_turns(2)
    with serving(Proc(home, log=tmp_path / "daemon.log"), warm=False) as d:
        with PersistentPromptCache.open(model, tokenizer, llama_path, home=home, learn=True,
                                        verbose=False) as cache:  # fmt: skip
            for messages in turns:
                generate(cache, model, tokenizer, _ids(tokenizer, messages), max_tokens=2)
            wait_for(lambda: d.request("stats")["learned"].get("records"), 10, d.text)
            assert cache.flush()
        other = [turns[0][0], {"role": "user", "content": "Who wrote the onboarding guide?"}]
        with PersistentPromptCache.open(model, tokenizer, llama_path, home=home, learn=True,
                                        verbose=False) as cache:  # fmt: skip
            assert cache.stats.attribute.learned, "the learned chain was read at hydrate"
            generate(cache, model, tokenizer, _ids(tokenizer, other), max_tokens=2)
            call = cache.stats.calls[-1]
    by = call.prefilled_by_reason()
    assert "diverged" not in by and "cold" not in by, call.line()
    assert set(by) <= {"suffix", "not_learned_yet"} and sum(by.values()) == call.prefilled_tokens
