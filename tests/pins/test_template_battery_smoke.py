"""The chat-template battery's harness works: every family's real template renders real requests
through mlx-lm's TokenizerWrapper with its control tokens as single ids, on a loadable tiny model.

Coverage of pins against these renderings is asserted elsewhere; this file proves the ground they
stand on (tests/pins/template_families.py).
"""

from __future__ import annotations

import datetime as dt

import mlx.core as mx
import pytest
from template_families import (
    FAMILIES,
    FEW_SHOT,
    SYSTEM_PROMPT,
    TOOLS,
    USER_TURNS,
    Family,
    clock_at,
    common_prefix_len,
    messages_for,
    request_text,
    request_tokens,
    server_system_end,
    text_end_token,
)

from kvstore.tiny import ARCHITECTURES

DAY = dt.date(2026, 12, 1)
MODEL_VOCAB = ARCHITECTURES["llama"]["vocab_size"]


def _tool_options(family: Family) -> tuple[bool, ...]:
    if family.tools_variant:
        return (True,)  # the file is the tool_use variant: transformers uses it only with tools
    return (False, True) if family.supports_tools else (False,)


CASES = [
    pytest.param(f, tools, id=f"{f.name}-{'tools' if tools else 'plain'}")
    for f in FAMILIES
    for tools in _tool_options(f)
]


@pytest.mark.parametrize("family,with_tools", CASES)
def test_real_requests_render_with_single_token_control_tokens(
    family_models,  # noqa: F811
    family: Family,
    with_tools: bool,
    record_property,
):
    tok = family_models.tokenizer(family)
    tools = TOOLS if with_tools else None
    kwargs = family.chat_template_kwargs
    with clock_at(DAY):  # two requests of the same day, different user turns
        reqs = [
            request_tokens(tok, messages_for(family, u), tools=tools, chat_template_kwargs=kwargs)
            for u in USER_TURNS[:2]
        ]
        texts = [
            request_text(tok, messages_for(family, u), tools=tools, chat_template_kwargs=kwargs)
            for u in USER_TURNS[:2]
        ]
    for ids, text, user in zip(reqs, texts, USER_TURNS[:2]):
        assert tok.decode(ids) == text  # the ids are exactly the rendered text
        assert max(ids) < MODEL_VOCAB  # the tiny model can prefill them
        assert user in text
        if family.supports_system:
            assert SYSTEM_PROMPT in text
        if with_tools:
            assert "get_order_status" in text and "search_products" in text
        seen = [ct for ct in family.control_tokens if ct in text]
        assert seen, f"{family.name}: no control token in the rendering"
        for ct in seen:
            tid = tok.convert_tokens_to_ids(ct)
            assert ids.count(tid) == text.count(ct), f"{ct!r} is not one token id every time"
        if family.bos_token and text.startswith(family.bos_token):
            bos = tok.convert_tokens_to_ids(family.bos_token)
            assert ids[0] == bos and ids[1] != bos  # the template's BOS, not doubled by encode

    shared = common_prefix_len(*reqs)
    assert 0 < shared < min(map(len, reqs))
    record_property("shared_prefix_tokens", shared)
    if family.supports_system:
        system_end = text_end_token(tok, reqs[0], SYSTEM_PROMPT)
        assert system_end is not None and system_end <= len(reqs[0])
        record_property("system_end_token", system_end)
        with clock_at(DAY):
            server_end = server_system_end(
                tok, messages_for(family, USER_TURNS[0]), tools=tools, chat_template_kwargs=kwargs
            )
        assert 0 <= server_end <= shared  # mlx_lm.server's own system segment of the request
        record_property("server_system_end", server_end)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_tokenizer_adds_bos_as_the_real_one_does(family_models, family: Family):  # noqa: F811
    tok = family_models.tokenizer(family)
    ids = tok.encode(USER_TURNS[0])
    if family.add_bos:
        assert ids[0] == tok.convert_tokens_to_ids(family.bos_token)
        assert tok.encode(USER_TURNS[0], add_special_tokens=False) == ids[1:]
    else:
        assert ids == tok.encode(USER_TURNS[0], add_special_tokens=False)
    assert tok.eos_token == family.eos_token


def test_family_models_load_and_prefill_a_request(family_models):  # noqa: F811
    from mlx_lm.utils import load

    for family in FAMILIES:
        model, tok = load(str(family_models.path(family)))
        tools = TOOLS if family.tools_variant else None
        ids = request_tokens(tok, messages_for(family, USER_TURNS[2]), tools=tools)
        logits = model(mx.array([ids]))
        assert logits.shape == (1, len(ids), MODEL_VOCAB), family.name


def test_clock_at_moves_strftime_now(family_models):  # noqa: F811
    tok = family_models.tokenizer("gpt_oss")
    msgs = messages_for(FAMILIES[0], USER_TURNS[0])
    with clock_at(DAY):
        today = request_text(tok, msgs)
    with clock_at(DAY + dt.timedelta(days=1)):
        tomorrow = request_text(tok, msgs)
    assert "Current date: 2026-12-01" in today
    assert "Current date: 2026-12-02" in tomorrow


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_few_shot_requests_render_and_share_the_examples(
    family_models,  # noqa: F811
    family: Family,
    record_property,
):
    tok = family_models.tokenizer(family)
    tools = TOOLS if family.tools_variant else None
    with clock_at(DAY):
        reqs = [
            request_tokens(tok, messages_for(family, u, few_shot=True), tools=tools)
            for u in USER_TURNS[:2]
        ]
    text = tok.decode(reqs[0])
    last_example = FEW_SHOT[-1]["content"]
    assert FEW_SHOT[1]["content"] in text and last_example in text
    shared = common_prefix_len(*reqs)
    examples_end = text_end_token(tok, reqs[0], last_example)
    record_property("shared_prefix_tokens", shared)
    record_property("examples_end_token", examples_end)
    assert 0 < shared < min(map(len, reqs)) and examples_end is not None
