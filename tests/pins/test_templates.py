"""The battery of real chat templates: pins serve what real requests share, or say why not.

For every family in tests/pins/template_families.py (real templates, a tokenizer that knows each
family's control tokens) and every pin kind (system prompt, system prompt + tools, few-shot): two
real requests of the same day, rendered as mlx_lm.server renders them, must both start with the
pin, and the pin must cover everything they share up to the end of the pinned content, or carry
the exact warning listed in EXPECTED. Tomorrow's request is served by the pin rendered for
tomorrow (what the daemon re-warms). `coverage_figure` is the README's and the note's number:
`python -m tests.pins.test_templates` prints it for this code and for the render rule before
issue 9.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # template_families is imported top-level

from helpers import cli
from template_families import (  # noqa: E402
    BY_NAME,
    FAMILIES,
    FEW_SHOT,
    SYSTEM_PROMPT,
    TOOLS,
    USER_TURNS,
    Family,
    FamilyModels,
    clock_at,
    common_prefix_len,
    messages_for,
    request_tokens,
)

from kvstore.errors import KVStoreError  # noqa: E402
from kvstore.pins.manifest import PrefixSpec  # noqa: E402
from kvstore.pins.render import render_prefix  # noqa: E402

TODAY = dt.datetime(2026, 6, 30, 12, 0, 0)
TOMORROW = TODAY + dt.timedelta(days=1)
KINDS = ("system", "tools", "few_shot")
# (family, kind) -> phrases the pin's warning must hold; every other pin has no warning.
EXPECTED: dict[tuple[str, str], tuple[str, ...]] = {
    ("mistral_nemo", "system"): ("single-turn only", "system text", "last user turn"),
    ("mistral_nemo", "tools"): ("single-turn only", "system text", "tool 'get_order_status'"),
    ("mistral_nemo", "few_shot"): ("single-turn only", "system text", "last user turn"),
    ("mistral_small3_2", "tools"): (
        "serves tool-call turns but not later chat turns",
        "tool 'get_order_status'",
        "tool 'search_products'",
        "last user turn",
    ),
}
# Families whose real requests with these pins do not render (the template raises): the pin must
# fail to render too, naming the pin, rather than store something no request matches.
NO_REQUESTS = {("gemma2", "system"), ("gemma2", "tools"), ("hermes3", "system")}
NO_REQUESTS |= {("hermes3", "few_shot")}


def pinned_for(family: Family, kind: str) -> tuple[list[dict], list[dict] | None]:
    messages = (
        list(FEW_SHOT) if kind == "few_shot" else [{"role": "system", "content": SYSTEM_PROMPT}]
    )
    if not family.supports_system and kind == "few_shot":
        messages = messages[1:]
    return messages, (list(TOOLS) if kind == "tools" else None)


def cases() -> list[tuple[Family, str]]:
    return [(f, k) for f in FAMILIES for k in KINDS if not (k == "tools" and not f.supports_tools)]


@dataclass
class Row:
    family: str
    kind: str
    shared: int  # static tokens two same-day real requests share
    served: int  # of which the pin serves (0 when it is no prefix of both, or failed)
    pin: int
    warned: bool
    failed: bool
    clock: str  # "" or the pin's valid_date
    multi_turn: bool | None


def measure(
    models: FamilyModels, family: Family, kind: str, render: Callable = render_prefix, **kw
) -> tuple[Row, object, list[list[int]]]:
    tok = models.tokenizer(family)
    messages, tools = pinned_for(family, kind)
    reqs = []
    with clock_at(TODAY.replace(hour=9)):  # the real requests come in the morning, pins at noon
        try:
            for user in USER_TURNS[:2]:
                turns = messages + [{"role": "user", "content": user}]
                reqs.append(request_tokens(tok, turns, tools=tools, **kw))
        except Exception:
            reqs = []
    spec = PrefixSpec(kind, tuple(messages), None, None, None, tuple(tools) if tools else None)
    try:
        if render is render_prefix:
            pin = render(tok, spec, now=TODAY)
        else:  # the rule before issue 9 had no clock of its own: give it the requests' day
            with clock_at(TODAY):
                pin = render(tok, spec)
    except KVStoreError:
        pin = None
    shared = common_prefix_len(*reqs) if reqs else 0
    ok = pin is not None and reqs and all(list(pin.tokens) == r[: len(pin.tokens)] for r in reqs)
    row = Row(
        family.name,
        kind,
        shared,
        len(pin.tokens) if ok else 0,
        len(pin.tokens) if pin is not None else 0,
        bool(pin is not None and pin.warning),
        pin is None,
        getattr(pin, "valid_date", None) or "",
        getattr(pin, "multi_turn", None),
    )
    return row, pin, reqs


@pytest.mark.parametrize(("family", "kind"), cases(), ids=lambda v: getattr(v, "name", v))
def test_pin_serves_what_real_requests_share(family_models, family: Family, kind: str) -> None:  # noqa: F811
    row, pin, reqs = measure(family_models, family, kind)
    if (family.name, kind) in NO_REQUESTS:
        assert not reqs and pin is None and row.failed
        return
    assert reqs and pin is not None, f"{family.name}/{kind}: requests render but the pin failed"
    for r in reqs:
        assert r[: len(pin.tokens)] == list(pin.tokens)
    # Everything the requests share up to the end of the pinned content is in the pin.
    assert len(pin.tokens) >= min(row.shared, pin.content_end)
    assert pin.content_end > 0 and not pin.cut_into_content
    expected = EXPECTED.get((family.name, kind))
    if expected is None:
        assert pin.warning is None, pin.warning
    else:
        for phrase in expected:
            assert phrase in pin.warning


@pytest.mark.parametrize(("family", "kind"), cases(), ids=lambda v: getattr(v, "name", v))
def test_tomorrows_request_is_served_by_the_pin_rendered_for_tomorrow(
    family_models,  # noqa: F811
    family: Family,
    kind: str,
) -> None:
    if (family.name, kind) in NO_REQUESTS:
        pytest.skip("the template refuses these requests")
    tok = family_models.tokenizer(family)
    messages, tools = pinned_for(family, kind)
    spec = PrefixSpec(kind, tuple(messages), None, None, None, tuple(tools) if tools else None)
    today = render_prefix(tok, spec, now=TODAY)
    ahead = render_prefix(tok, spec, now=TOMORROW.replace(hour=0, minute=0, second=5))
    with clock_at(TOMORROW.replace(hour=0, minute=1)):
        turns = messages + [{"role": "user", "content": USER_TURNS[2]}]
        req = request_tokens(tok, turns, tools=tools)
    assert req[: len(ahead.tokens)] == list(ahead.tokens)
    if today.clock_bound:
        assert today.valid_date == TODAY.date().isoformat()
        assert ahead.valid_date == TOMORROW.date().isoformat()
        assert req[: len(today.tokens)] != list(today.tokens)  # why it must be re-warmed
    else:
        assert ahead.tokens == today.tokens


def agent_turn(family: Family, tools: list[dict] | None, rounds: int) -> list[dict]:
    """An agent loop's request after `rounds` tool calls: the system prompt, one user message, then
    assistant tool_calls and tool results, as an OpenAI client sends them (JSON arguments, null
    content) and mlx_lm.server hands them to the template (process_message_content)."""
    from mlx_lm.server import process_message_content

    messages = messages_for(family, USER_TURNS[3])
    for k in range(rounds):
        call_id = f"Zq{k}x7Wm4p"  # Mistral's templates demand 9 alphanumeric characters
        call = {"name": "get_order_status", "arguments": json.dumps({"order_id": f"20{k}7"})}
        calls = [{"id": call_id, "type": "function", "function": call}]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": '{"late": true}'})
    process_message_content(messages)
    return messages


def later_chat_turn(family: Family) -> list[dict]:
    return messages_for(family, USER_TURNS[0]) + [
        {"role": "assistant", "content": "Yes, within 30 days."},
        {"role": "user", "content": USER_TURNS[1]},
    ]


def served(pin, tok, messages: list[dict], tools: list[dict] | None) -> int:
    """How many of the pin's tokens this request, rendered as mlx_lm.server does, starts with."""
    with clock_at(TODAY.replace(hour=9)):
        return common_prefix_len(pin.tokens, request_tokens(tok, messages, tools=tools))


def test_mistral_small_serves_every_tool_call_turn_of_an_agent_loop(family_models) -> None:  # noqa: F811
    family = BY_NAME["mistral_small3_2"]
    tok = family_models.tokenizer(family)
    messages, tools = pinned_for(family, "tools")
    spec = PrefixSpec("agent", tuple(messages), None, None, None, tuple(tools))
    pin = render_prefix(tok, spec, now=TODAY)
    n = len(pin.tokens)
    # [AVAILABLE_TOOLS] stays before the only user message on every tool-call turn.
    for rounds in (1, 2, 3):
        assert served(pin, tok, agent_turn(family, tools, rounds), tools) == n
    chat = served(pin, tok, later_chat_turn(family), tools)
    assert chat < n and "single-turn" not in pin.warning and pin.multi_turn is not False
    assert f"later chat turns share {chat} of {n} tokens; tool-call turns share all {n}" in (
        pin.warning
    )
    assert (pin.later_turn_tokens, pin.tool_turn_tokens) == (chat, n)


@pytest.mark.parametrize("kind", ["system", "tools"])
def test_mistral_nemo_says_what_chat_and_tool_call_turns_share(family_models, kind) -> None:  # noqa: F811
    family = BY_NAME["mistral_nemo"]
    tok = family_models.tokenizer(family)
    messages, tools = pinned_for(family, kind)
    spec = PrefixSpec(kind, tuple(messages), None, None, None, tuple(tools) if tools else None)
    pin = render_prefix(tok, spec, now=TODAY)
    n = len(pin.tokens)
    # On tool-call turns the last message is no user turn: Nemo drops the system text.
    tool = min(served(pin, tok, agent_turn(family, tools, r), tools) for r in (1, 2))
    chat = served(pin, tok, later_chat_turn(family), tools)
    assert chat < n and tool < n and "single-turn only" in pin.warning
    assert f"later chat turns share {chat} of {n} tokens" in pin.warning
    assert f"tool-call turns share {tool} of {n} tokens" in pin.warning
    assert "on tool-call turns the chat template leaves it out" in pin.warning
    assert (pin.later_turn_tokens, pin.tool_turn_tokens) == (chat, tool) and pin.single_turn
    if tools:  # the tools stay before the user message: more of the pin than a 2nd user turn
        assert tool > chat


def coverage_figure(models: FamilyModels, render: Callable = render_prefix) -> tuple[float, list]:
    rows = []
    for family, kind in cases():
        if (family.name, kind) in NO_REQUESTS:
            continue
        rows.append(measure(models, family, kind, render)[0])
    shared = sum(r.shared for r in rows)
    return (sum(min(r.served, r.shared) for r in rows) / shared if shared else 1.0), rows


def test_the_battery_coverage_figure(family_models, capsys) -> None:  # noqa: F811
    figure, rows = coverage_figure(family_models)
    with capsys.disabled():
        print(f"\nchat-template battery: pins serve {100 * figure:.1f}% of the static tokens "
              f"that same-day real requests share ({len(rows)} pins)")  # fmt: skip
    assert figure >= 0.99
    assert not [r for r in rows if r.failed], "a pin failed where real requests render"
    assert not [r for r in rows if r.served < r.shared and not r.warned and r.served < r.pin]


def _old_render() -> Callable:
    """kvstore/render.py as it was before issue 9 (git), for the before figure."""
    import importlib.util
    import subprocess
    import tempfile

    src = subprocess.run(
        ["git", "show", "a5360d9:kvstore/render.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "render_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("render_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.render_prefix


def tomorrow_figure(models: FamilyModels, render: Callable = render_prefix) -> float:
    """Share of what tomorrow's requests share that the pin kvstore holds then serves: the pin
    re-warmed with tomorrow's clock (this code) or the one warmed today (the rule before)."""
    shared = served = 0
    for family, kind in cases():
        if (family.name, kind) in NO_REQUESTS:
            continue
        tok = models.tokenizer(family)
        messages, tools = pinned_for(family, kind)
        spec = PrefixSpec(kind, tuple(messages), None, None, None, tuple(tools) if tools else None)
        try:
            if render is render_prefix:
                pin = render(tok, spec, now=TOMORROW.replace(hour=0, minute=0, second=5))
            else:
                with clock_at(TODAY):
                    pin = render(tok, spec)
        except KVStoreError:
            pin = None  # failed to warm: serves nothing
        with clock_at(TOMORROW.replace(hour=8)):
            reqs = [
                request_tokens(tok, messages + [{"role": "user", "content": u}], tools=tools)
                for u in USER_TURNS[:2]
            ]
        shared += common_prefix_len(*reqs)
        if pin is not None and all(r[: len(pin.tokens)] == list(pin.tokens) for r in reqs):
            served += len(pin.tokens)
    return served / shared


if __name__ == "__main__":
    import logging
    import tempfile

    logging.disable(logging.WARNING)
    models = FamilyModels(Path(tempfile.mkdtemp()))
    for label, render in (("before", _old_render()), ("after", render_prefix)):
        figure, rows = coverage_figure(models, render)
        print(f"{label}: {100 * figure:.1f}% of shared static tokens served")
        print(f"  next day: {100 * tomorrow_figure(models, render):.1f}% served")
        for r in rows:
            print(
                f"  {r.family:26} {r.kind:9} shared {r.shared:5} served {r.served:5} "
                f"pin {r.pin:5} {'warned' if r.warned else '':6} {'FAILED' if r.failed else ''}"
                f" {r.clock} {'single-turn' if r.multi_turn is False else ''}"
            )


def test_analyze_says_single_turn_only_for_mistral_nemo(family_models, tmp_path) -> None:  # noqa: F811
    import json

    capture = tmp_path / "captured.jsonl"
    system = {"role": "system", "content": SYSTEM_PROMPT}
    calls = [{"stage": "support", "messages": [system, {"role": "user", "content": u}]}
             for u in USER_TURNS]  # fmt: skip
    capture.write_text("".join(json.dumps(c) + "\n" for c in calls))
    model = family_models.path("mistral_nemo")
    table = cli("analyze", capture, "--model", model)
    assert table.exit_code == 0, table.output
    assert "single-turn only" in table.output
    assert "moves it to the last user turn" in table.output
    qwen = family_models.path("qwen3")
    res = cli("analyze", capture, "--model", qwen, "--json")
    (report,) = json.loads(res.output)
    assert report["pin_multi_turn"] is True and report["pin_warning"] is None
    assert report["pin_tokens"] >= report["stable_tokens"] - 1 > 0
