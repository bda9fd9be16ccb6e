"""Why tokens were prefilled, through the library: the report line and the stats carry the
reasons (kvstore.reasons) on a real chat template."""

from __future__ import annotations

from helpers import manifest_for

from kvstore.client import PersistentPromptCache, generate
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.warm.warm import warm

OLD, NEW = "2026-11-30", "2026-12-01"


def system(date: str) -> str:
    return f"Today is {date}. You are the router. Classify the request and answer with JSON only."


def chat(tokenizer, sys: str, user: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": sys}, {"role": "user", "content": user}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_cold_then_date_in_system_prompt_is_diverged(llama, llama_path, kv_home, tmp_path):
    model, tokenizer = llama
    with PersistentPromptCache(model, tokenizer, llama_path, verbose=False) as cache:
        generate(cache, model, tokenizer, chat(tokenizer, system(NEW), "hi"), max_tokens=2)
        (first,) = cache.stats.calls
        assert first.prefilled_by_reason() == {"cold": first.prompt_tokens}

    prefixes = f"""
[[model.prefix]]
name = "router"
messages = [{{ role = "system", content = "{system(OLD)}" }}]
"""
    with Store(kv_home) as store:
        warm(load_manifest(manifest_for(tmp_path, llama_path, prefixes)), store, home=kv_home)
    prompt = chat(tokenizer, system(NEW), "My invoice 2291 was charged twice.")
    with PersistentPromptCache(model, tokenizer, llama_path, verbose=False) as cache:
        generate(cache, model, tokenizer, prompt, label="classify", max_tokens=2)
        (call,) = cache.stats.calls
    by = call.prefilled_by_reason()
    assert sum(by.values()) == call.prefilled_tokens
    (d,) = [s for s in call.reasons if s["reason"] == "diverged"]
    assert d["entry"] == "router"
    # the position is the date's first differing token
    date_at = len(tokenizer.decode(prompt[: d["position"]]))
    text = tokenizer.decode(prompt)
    assert text.index(NEW) <= date_at <= text.index(NEW) + len(NEW)
    assert OLD in d["stored_text"] and NEW in d["request_text"]
    assert "diverged" in call.line() and "router at" in call.line()
