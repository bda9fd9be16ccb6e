"""`diverged` on real chat templates (the battery's families), through the library: a system
header that prints today's date is diverged at the date's token with both dates in the text;
tool schemas in another order are diverged at the first differing schema."""

from __future__ import annotations

import datetime as dt
import json

import mlx_lm
from template_families import SYSTEM_PROMPT, TOOLS, clock_at, request_tokens

from kvstore.client import PersistentPromptCache, generate
from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store
from kvstore.warm import warm as warm_module

DAY1, DAY2 = dt.date(2026, 11, 30), dt.date(2026, 12, 1)


def _diverged(path, pin_kwargs, prompt_of, pin_at=DAY1, ask_at=DAY1):
    model, tokenizer = mlx_lm.load(str(path))
    with PersistentPromptCache.open(model, tokenizer, path, verbose=False, learn=False) as cache:
        with clock_at(pin_at):
            pin = cache.pin("stage", **pin_kwargs)
        with clock_at(ask_at):
            prompt = prompt_of(tokenizer)
            generate(cache, model, tokenizer, prompt, max_tokens=2)
        (call,) = cache.stats.calls
    assert sum(call.prefilled_by_reason().values()) == call.prefilled_tokens
    (d,) = [s for s in call.reasons if s["reason"] == "diverged"]
    assert d["entry"] == "stage" and d["stored_length"] == len(pin.tokens)
    assert d["position"] == next(i for i, (a, b) in enumerate(zip(pin.tokens, prompt)) if a != b)
    return tokenizer, prompt, d


def _first_char_diff(a: str, b: str) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def test_todays_date_in_the_system_header_is_diverged_at_the_date(family_models):
    path = family_models.path("llama3_2")  # strftime_now('%d %b %Y') in the system header
    system = [{"role": "system", "content": SYSTEM_PROMPT}]
    user = system + [{"role": "user", "content": "Where is my order 1042?"}]
    ask = lambda tok: request_tokens(tok, user)  # noqa: E731
    tokenizer, prompt, d = _diverged(path, {"messages": system}, ask, ask_at=DAY2)
    assert "30 Nov 2026" in d["stored_text"] and "01 Dec 2026" in d["request_text"]
    # the position is the date's token: the first character that differs is in it
    before = len(tokenizer.decode(prompt[: d["position"]]))
    with clock_at(DAY1):
        old = tokenizer.decode(request_tokens(tokenizer, user))
    at = _first_char_diff(old, tokenizer.decode(prompt))
    assert before <= at < len(tokenizer.decode(prompt[: d["position"] + 1]))
    assert tokenizer.decode(prompt)[at - 12 : at + 11].find("Dec 2026") >= 0


def test_tool_schemas_in_another_order_are_diverged_at_the_first_schema(family_models):
    path = family_models.path("qwen2_5")  # tools rendered into the system turn
    system = [{"role": "system", "content": SYSTEM_PROMPT}]
    user = system + [{"role": "user", "content": "Find me a red kettle."}]
    reordered = list(reversed(TOOLS))
    tokenizer, prompt, d = _diverged(
        path, {"messages": system, "tools": TOOLS},
        lambda tok: request_tokens(tok, user, tools=reordered),
    )  # fmt: skip
    text = tokenizer.decode(prompt)
    first_schema = text.index('"search_products"')  # the request's first schema, stored second
    before = len(tokenizer.decode(prompt[: d["position"]]))
    assert text.rfind("{", 0, first_schema) <= before <= first_schema + len("search_products")
    assert "get_order_status" in d["stored_text"] and "search_products" in d["request_text"]


def test_a_clock_bound_pin_of_another_day_is_other_date(
    family_models, kv_home, tmp_path, monkeypatch
):
    path = family_models.path("llama3_2")
    system = [{"role": "system", "content": SYSTEM_PROMPT}]
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        f'[[model]]\npath = "{path}"\n[[model.prefix]]\nname = "shop"\n'
        f'messages = [{{ role = "system", content = {json.dumps(SYSTEM_PROMPT)} }}]\n'
    )
    yesterday = dt.datetime.combine(dt.date.today() - dt.timedelta(days=1), dt.time(12))
    with monkeypatch.context() as m, Store(kv_home) as store:
        m.setattr(warm_module, "local_now", lambda: yesterday)  # warmed yesterday
        warm(load_manifest(manifest), store, home=kv_home)
    model, tokenizer = mlx_lm.load(str(path))
    user = system + [{"role": "user", "content": "Where is my order 1042?"}]
    with PersistentPromptCache.open(model, tokenizer, path, verbose=False, learn=False) as cache:
        generate(cache, model, tokenizer, request_tokens(tokenizer, user), max_tokens=2)
        (call,) = cache.stats.calls
    by = call.prefilled_by_reason()
    assert by.get("other_date", 0) > 0 and "diverged" not in by, call.reasons
    (o,) = [s for s in call.reasons if s["reason"] == "other_date"]
    assert o["entry"] == f"shop ({yesterday.date().isoformat()})"
