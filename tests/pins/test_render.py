"""The stable boundary rule: pins are prefixes of real prompts, and unstable templates are named."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from toy_templates import TIMED_TEMPLATE, USER_FIRST_TEMPLATE, tokenizer_with

from kvstore.pins import render
from kvstore.pins.manifest import PrefixSpec
from kvstore.pins.render import render_prefix

SYSTEM = "You are a careful assistant. Classify the request and return JSON with the fields."
TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
        },
    },
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tokenizer_with(tmp_path_factory.mktemp("tok"))


def chat_pin(name: str, messages: list[dict], tools: tuple | None = None) -> PrefixSpec:
    return PrefixSpec(name, tuple(messages), None, None, None, tools)


def real_prompt(tokenizer, messages: list[dict], question: str, tools=None) -> list[int]:
    """Tokens of a real request, built the way mlx_lm.server builds them."""
    turns = messages + [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(turns, tools=tools, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_system_pin_is_a_prefix_of_real_prompts(tokenizer) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    pin = render_prefix(tokenizer, chat_pin("classify", messages))
    assert pin.warning is None and not pin.cut_into_content
    for question in ("Is 7 prime?", "hello", "{json}"):
        prompt = real_prompt(tokenizer, messages, question)
        assert prompt[: len(pin.tokens)] == list(pin.tokens)
        assert len(prompt) > len(pin.tokens)
    assert SYSTEM in tokenizer.decode(list(pin.tokens))
    assert 0 < pin.content_end <= len(pin.tokens) <= len(pin.rendered)
    assert pin.rendered[: len(pin.tokens)] == pin.tokens


def test_few_shot_pin_covers_every_message(tokenizer) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Is the sky blue?"},
        {"role": "assistant", "content": '{"category": "fact"}'},
    ]
    pin = render_prefix(tokenizer, chat_pin("shots", messages))
    assert pin.warning is None
    prompt = real_prompt(tokenizer, messages, "What is 2+2?")
    assert prompt[: len(pin.tokens)] == list(pin.tokens)
    assert '{"category": "fact"}' in tokenizer.decode(list(pin.tokens))


def test_tools_appear_in_the_pin(tokenizer) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    pin = render_prefix(tokenizer, chat_pin("reason", messages, TOOLS))
    assert pin.warning is None
    text = tokenizer.decode(list(pin.tokens))
    assert SYSTEM in text and "calculator" in text and "arithmetic expression" in text
    prompt = real_prompt(tokenizer, messages, "2*21?", tools=list(TOOLS))
    assert prompt[: len(pin.tokens)] == list(pin.tokens)
    plain = render_prefix(tokenizer, chat_pin("plain", messages))
    assert len(pin.tokens) > len(plain.tokens)


@pytest.mark.parametrize("text", ["Answer in JSON.", "You are terse.\n", "Classify"])
def test_text_pin_is_a_prefix_of_text_continuations(tokenizer, text: str) -> None:
    pin = render_prefix(tokenizer, PrefixSpec("raw", None, text, None, None, None))
    assert pin.warning is None
    for more in (" Then explain.", "\nQ: why?", "ify the request"):
        ids = tokenizer.encode(text + more)
        assert ids[: len(pin.tokens)] == list(pin.tokens)
    assert tokenizer.decode(list(pin.tokens)).strip() == text.strip()


def test_raw_transformers_tokenizer_gives_the_same_pin(tokenizer) -> None:
    spec = chat_pin("classify", [{"role": "system", "content": SYSTEM}], TOOLS)
    assert render_prefix(tokenizer._tokenizer, spec) == render_prefix(tokenizer, spec)


@pytest.mark.parametrize("template", [USER_FIRST_TEMPLATE, TIMED_TEMPLATE], ids=["user", "time"])
def test_dynamic_content_before_the_system_text_is_named(
    tmp_path: Path, caplog, template: str
) -> None:
    tok = tokenizer_with(tmp_path / "tok", template)
    messages = [{"role": "system", "content": SYSTEM}]
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        pin = render_prefix(tok, chat_pin("classify", messages))
    assert pin.cut_into_content
    assert len(pin.tokens) < pin.content_end
    assert "'classify'" in pin.warning
    assert f"token {len(pin.tokens)} of {pin.content_end}" in pin.warning
    assert pin.warning in caplog.text
    # Even so, the shorter pin must still be a prefix of real prompts.
    prompt = real_prompt(tok, messages, "Is 7 prime?")
    assert prompt[: len(pin.tokens)] == list(pin.tokens)


def test_decoded_lengths_stand_in_for_missing_offsets(tmp_path: Path, monkeypatch) -> None:
    # Slow tokenizers have no offset mapping; the decode fallback must agree with offsets.
    tok = tokenizer_with(tmp_path / "tok", TIMED_TEMPLATE)
    specs = [
        chat_pin("dated", [{"role": "system", "content": SYSTEM}]),
        PrefixSpec("raw", None, SYSTEM, None, None, None),
    ]
    with_offsets = [render_prefix(tok, spec) for spec in specs]
    monkeypatch.setattr(render, "_offset_ends", lambda *args: None)
    assert [render_prefix(tok, spec) for spec in specs] == with_offsets
    assert with_offsets[0].cut_into_content and not with_offsets[1].cut_into_content


def test_default_template_logs_nothing(tokenizer, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        render_prefix(tokenizer, chat_pin("classify", [{"role": "system", "content": SYSTEM}]))
    assert caplog.records == []
