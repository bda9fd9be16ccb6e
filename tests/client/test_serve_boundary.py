"""`kvstore serve --persist-system-prompts` cuts the system segment by kvstore's rule, through
mlx_lm.server's own ResponseGenerator._tokenize; and it names pins made with other template
arguments than the server's."""

from __future__ import annotations

import datetime as dt
import types
from pathlib import Path

import pytest
from mlx_lm import server
from mlx_lm.utils import load_tokenizer

from kvstore.client.serve.hooks import _Hooks, _subclasses
from kvstore.client.serve.persist import template_args_warning
from kvstore.pins.clock import clock_at
from kvstore.tiny import CHAT_TEMPLATE, write_tokenizer

SYSTEM = "You are a careful assistant. Classify the request and return JSON with the fields."
# The time of day in the system header: mlx-lm's own segment holds this minute's time.
TIMED = (
    "<|im_start|>system\nNow: {{ strftime_now('%d %b %Y %H:%M') }}\n"
    "{{ messages[0]['content'] }}<|im_end|>\n"
    "{% for m in messages[1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def generator(hooks: _Hooks):
    gen_cls = _subclasses(server, hooks)[2]
    gen = gen_cls.__new__(gen_cls)  # only _tokenize runs: it reads model_provider alone
    cli_args = types.SimpleNamespace(chat_template_args={})
    gen.model_provider = types.SimpleNamespace(processor=None, cli_args=cli_args,
                                               model_key=("model", None, None))  # fmt: skip
    return gen


def request(question: str):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    req = server.CompletionRequest("chat", "", messages, None, None)
    return req, types.SimpleNamespace(chat_template_kwargs=None)


def test_the_persisted_system_segment_is_one_every_request_shares(tmp_path: Path):
    write_tokenizer(tmp_path / "tok", chat_template=TIMED)
    tok = load_tokenizer(tmp_path / "tok")
    now = dt.datetime.now().replace(hour=10, minute=31)
    plain = types.SimpleNamespace(
        boundary=None,
        warm_up=types.SimpleNamespace(take=lambda request: None),
        calls=types.SimpleNamespace(tokenized=lambda out: None),
    )
    with clock_at(now):
        mlx_out = generator(plain)._tokenize(tok, *request("Is 7 prime?"))
    hooks = _Hooks(tmp_path / "home", persist=True)
    with clock_at(now):
        ours = generator(hooks)._tokenize(tok, *request("Is 7 prime?"))
    assert ours[0] == mlx_out[0]  # the prompt itself is untouched
    mlx_sys, our_sys = mlx_out[1][0], ours[1][0]
    assert ours[2][0] == "system" and sum(map(len, ours[1])) == len(ours[0])
    # A request later that day: it starts with kvstore's segment, not with mlx-lm's.
    with clock_at(now.replace(hour=14, minute=2)):
        later = generator(plain)._tokenize(tok, *request("Why?"))[0]
    assert later[: len(our_sys)] == our_sys
    assert later[: len(mlx_sys)] != mlx_sys
    # What the persister stores with it: the template arguments and the day it holds for.
    assert hooks.boundary.extra_for(our_sys) == {
        "chat_template_kwargs": {},
        "valid_date": now.date().isoformat(),
    }


def test_pins_made_with_other_template_arguments_are_named():
    def meta(label, kwargs):  # what an EntryMeta gives of a chat pin (None for a text pin)
        return types.SimpleNamespace(label=label, chat_template_kwargs=kwargs)

    metas = [meta("think", {"enable_thinking": True}), meta("plain", {}), meta("text", None)]
    warning = template_args_warning(metas, {"enable_thinking": False})
    assert "'think'" in warning and "'plain'" in warning and "'text'" not in warning
    assert '--chat-template-args {"enable_thinking": false}' in warning
    assert template_args_warning(metas[1:], {}) is None


@pytest.mark.parametrize(("template", "skipped"), [(CHAT_TEMPLATE, True), (TIMED, False)])
def test_a_pin_past_both_cuts_is_served_without_the_re_cut(tmp_path: Path, template, skipped):
    """Once a request gave the cut of its system segment, a request a pin serves past both that
    cut and mlx-lm's segment keeps mlx-lm's segments, not re-cut (nothing of its system segment is
    prefilled, inserted or persisted either way); a pin short of mlx-lm's segment (the time of day
    in it) is re-cut as before."""
    write_tokenizer(tmp_path / "tok", chat_template=template)
    tok = load_tokenizer(tmp_path / "tok")
    hooks = _Hooks(tmp_path / "home", persist=True)
    gen = generator(hooks)
    recuts = []
    resegment = hooks.boundary.resegment
    hooks.boundary.resegment = lambda *a: recuts.append(a) or resegment(*a)
    first = gen._tokenize(tok, *request("Is 7 prime?"))
    assert len(recuts) == 1 and first[2][0] == "system"
    pin = tuple(first[1][0])  # kvstore's cut: what a warmed pin of these messages holds
    hooks.cache = types.SimpleNamespace(pins_of=lambda key: {pin: 0})
    later = gen._tokenize(tok, *request("Why?"))
    assert len(recuts) == (1 if skipped else 2)
    assert later[0][: len(pin)] == list(pin)
