"""The pin is cut from what requests look like: the template branches, clocks and arguments that
real requests hit, and a loud word for every part of the pinned content a pin cannot hold."""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

import pytest
from toy_templates import DATED_TEMPLATE, TIMED_TEMPLATE, USER_FIRST_TEMPLATE, tokenizer_with

from kvstore.errors import ManifestError
from kvstore.pins.clock import clock_at
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
NOON = dt.datetime(2026, 3, 14, 12, 0, 0)
_TAIL = (
    "{% for m in messages[1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3.2's header: today's date from strftime_now, before the system text.
DAY_TEMPLATE = (
    "<|im_start|>system\nToday Date: {{ strftime_now('%d %b %Y') }}\n\n"
    "{{ messages[0]['content'] }}<|im_end|>\n" + _TAIL
)
# Phi-4-mini's shape: without a generation prompt the rendering ends otherwise.
BRANCH_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% else %}<|endoftext|>{% endif %}"
)
# Llama 3.1 with tools: the schemas go into the first user turn; no user turn is an error.
TOOLS_IN_USER_TEMPLATE = (
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% if tools %}{% if messages | length < 2 %}"
    "{{ raise_exception('Cannot put tools in the first user message when there is none') }}"
    "{% endif %}<|im_start|>user\nTools:{% for t in tools %} {{ t | tojson }}{% endfor %}\n\n"
    "{{ messages[1]['content'] }}<|im_end|>\n{% set rest = messages[2:] %}"
    "{% else %}{% set rest = messages[1:] %}{% endif %}"
    "{% for m in rest %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Mistral Nemo's shape: the system text (and tools) go into the last user turn.
LAST_USER_TEMPLATE = (
    "{% set sys = messages[0]['content'] %}{% set ns = namespace(last=0) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages[1:] %}{% if m['role'] == 'user' %}<|im_start|>user\n"
    "{% if loop.index0 + 1 == ns.last %}{{ sys }}\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>assistant\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template argument (Qwen 3's enable_thinking) changes the system turn.
KWARG_TEMPLATE = (
    "<|im_start|>system\n{% if terse is defined and terse %}Be terse. {% endif %}"
    "{{ messages[0]['content'] }}<|im_end|>\n" + _TAIL
)


def chat_pin(name: str, messages: list[dict], tools=None, kwargs=None) -> PrefixSpec:
    return PrefixSpec(name, tuple(messages), None, None, None, tools, kwargs)


def request(tok, messages, question, *, at=None, tools=None, **kwargs) -> list[int]:
    """A real request's tokens, as mlx_lm.server builds them, at a chosen clock."""
    turns = list(messages) + [{"role": "user", "content": question}]
    with clock_at(at or NOON):
        ids = tok.apply_chat_template(
            turns, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs
        )
    return list(ids)


def is_prefix(pin, ids) -> bool:
    return list(pin.tokens) == ids[: len(pin.tokens)]


SYS = [{"role": "system", "content": SYSTEM}]


def test_a_date_by_the_day_is_todays_full_pin_marked_with_its_date(tmp_path: Path, caplog):
    tok = tokenizer_with(tmp_path / "tok", DAY_TEMPLATE)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        pin = render_prefix(tok, chat_pin("dated", SYS), now=NOON)
    assert pin.valid_date == "2026-03-14" and pin.clock_bound
    assert pin.warning is None and not pin.cut_into_content and caplog.records == []
    assert SYSTEM in tok.decode(list(pin.tokens))
    # Any request of that day, morning or night, starts with it; the next day's does not.
    for hour in (0, 9, 23):
        assert is_prefix(pin, request(tok, SYS, "Is 7 prime?", at=NOON.replace(hour=hour)))
    tomorrow = NOON + dt.timedelta(days=1)
    assert not is_prefix(pin, request(tok, SYS, "Is 7 prime?", at=tomorrow))
    # Rendered with tomorrow's clock (what the daemon prepares before midnight): it serves then.
    ahead = render_prefix(tok, chat_pin("dated", SYS), now=tomorrow.replace(hour=0, minute=5))
    assert ahead.valid_date == "2026-03-15" and len(ahead.tokens) == len(pin.tokens)
    assert is_prefix(ahead, request(tok, SYS, "Why?", at=tomorrow.replace(hour=0, minute=0)))


def test_a_hard_coded_default_date_is_not_a_cut(tmp_path: Path):
    # Llama 3.3: "26 Jul 2024" unless the app passes date_string; kvstore never invents one.
    tok = tokenizer_with(tmp_path / "tok", DATED_TEMPLATE)
    pin = render_prefix(tok, chat_pin("llama33", SYS), now=NOON)
    assert pin.warning is None and pin.valid_date is None
    assert "26 Jul 2024" in tok.decode(list(pin.tokens)) and SYSTEM in tok.decode(list(pin.tokens))
    # An app that passes date_string: the pin is rendered with it, and matches its requests.
    dated = render_prefix(tok, chat_pin("d", SYS, kwargs={"date_string": "01 Jan 2030"}))
    assert is_prefix(dated, request(tok, SYS, "Is 7 prime?", date_string="01 Jan 2030"))
    assert not is_prefix(dated, request(tok, SYS, "Is 7 prime?"))


def test_the_time_of_day_is_cut_and_named(tmp_path: Path):
    tok = tokenizer_with(tmp_path / "tok", TIMED_TEMPLATE)
    pin = render_prefix(tok, chat_pin("timed", SYS), now=NOON)
    # The date before the time is still today's: the pin up to the time holds for this day.
    assert pin.valid_date == "2026-03-14" and pin.cut_into_content
    assert "system text" in pin.warning and "time of day (strftime_now)" in pin.warning
    assert f"ends at token {len(pin.tokens)} of {pin.content_end}" in pin.warning
    for at in (NOON.replace(hour=0, minute=1), NOON.replace(hour=23, minute=59)):
        assert is_prefix(pin, request(tok, SYS, "Is 7 prime?", at=at))


def test_a_branch_taken_only_without_a_user_turn_costs_nothing(tmp_path: Path, caplog):
    tok = tokenizer_with(tmp_path / "tok", BRANCH_TEMPLATE)
    shots = SYS + [
        {"role": "user", "content": "Is the sky blue?"},
        {"role": "assistant", "content": '{"category": "fact"}'},
    ]
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        pin = render_prefix(tok, chat_pin("shots", shots))
    assert caplog.records == [] and pin.multi_turn
    assert [p.name for p in pin.parts] == [
        "system text",
        "few-shot turn 1 (user)",
        "few-shot turn 2 (assistant)",
    ]
    assert all(p.covered and p.later_turns for p in pin.parts)
    assert '{"category": "fact"}' in tok.decode(list(pin.tokens))
    assert is_prefix(pin, request(tok, shots, "What is 2+2?"))


def test_a_template_that_needs_a_user_turn_pins_its_tools(tmp_path: Path):
    tok = tokenizer_with(tmp_path / "tok", TOOLS_IN_USER_TEMPLATE)
    pin = render_prefix(tok, chat_pin("tools", SYS, TOOLS))
    assert pin.warning is None
    assert {p.name: p.covered for p in pin.parts} == {
        "system text": True,
        "tool 'calculator'": True,
    }
    assert "arithmetic expression" in tok.decode(list(pin.tokens))
    assert is_prefix(pin, request(tok, SYS, "2*21?", tools=list(TOOLS)))


def test_system_text_moved_to_the_last_user_turn_is_lost_on_later_chat_turns_only(tmp_path: Path):
    # This template keeps the system text with the only user message of an agent loop.
    tok = tokenizer_with(tmp_path / "tok", LAST_USER_TEMPLATE)
    pin = render_prefix(tok, chat_pin("nemo", SYS))
    assert not pin.cut_into_content and not pin.single_turn and pin.multi_turn is None
    (part,) = pin.parts
    assert part.name == "system text" and part.later_turns is False and part.tool_turns is True
    n = len(pin.tokens)
    assert pin.tool_turn_tokens == n and pin.later_turn_tokens < n
    assert f"later chat turns share {pin.later_turn_tokens} of {n} tokens" in pin.warning
    assert f"tool-call turns share all {n}" in pin.warning and "single-turn" not in pin.warning
    assert "moves it to the last user turn" in pin.warning
    assert SYSTEM in tok.decode(list(pin.tokens))
    assert is_prefix(pin, request(tok, SYS, "Is 7 prime?"))
    turn2 = SYS + [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert not is_prefix(pin, request(tok, turn2, "Is 7 prime?"))


def test_system_text_after_the_user_message_is_named_with_what_to_do(tmp_path: Path):
    tok = tokenizer_with(tmp_path / "tok", USER_FIRST_TEMPLATE)
    pin = render_prefix(tok, chat_pin("late", SYS))
    assert pin.parts[0].name == "system text" and pin.parts[0].reason == "after_user"
    assert "after the start of the user's message" in pin.warning
    assert "No prefix can hold it" in pin.warning


def test_template_arguments_render_the_pin_as_the_app_does(tmp_path: Path):
    tok = tokenizer_with(tmp_path / "tok", KWARG_TEMPLATE)
    terse = render_prefix(tok, chat_pin("t", SYS, kwargs={"terse": True}))
    plain = render_prefix(tok, chat_pin("t", SYS))
    assert terse.tokens != plain.tokens
    assert is_prefix(terse, request(tok, SYS, "Why?", terse=True))
    assert not is_prefix(terse, request(tok, SYS, "Why?"))
    assert is_prefix(plain, request(tok, SYS, "Why?"))


def test_a_template_error_names_the_pin(tmp_path: Path):
    bad = "{{ raise_exception('only user turns, please') }}"
    tok = tokenizer_with(tmp_path / "tok", bad)
    with pytest.raises(ManifestError, match=r"pin 'broken'.*only user turns, please"):
        render_prefix(tok, chat_pin("broken", SYS))


def test_an_empty_pin_is_an_error_naming_it(tmp_path: Path):
    # Every request starts with per-request content: nothing can be cached.
    first = "{% for m in messages|reverse %}{{ m['content'] }}\n{% endfor %}"
    tok = tokenizer_with(tmp_path / "tok", first)
    with pytest.raises(ManifestError, match=r"pin 'void': empty"):
        render_prefix(tok, chat_pin("void", SYS))
