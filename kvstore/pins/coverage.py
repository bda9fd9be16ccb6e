"""Which parts of a pin's content (system text, each tool schema, few-shot turns) the pin holds.

The parts are found in a real request's rendering (the pinned messages followed by a probe user
turn); each part ends at some token, and the pin covers it when it reaches that token. A part the
pin does not reach is named with its position, the reason in the template's terms, and what the
user can do: there is no quiet loss.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_SNIPPET = 24

# Why a part falls outside the pin, in the template's terms, and what the user can do about it.
REASONS: dict[str, tuple[str, str]] = {
    "after_user": (
        "the chat template renders it after the start of the user's message "
        "(it moves it into or after the user turn)",
        "No prefix can hold it with this template; keep that content short, or serve with a "
        "template that renders it before the user turn",
    ),
    "time": (
        "the chat template prints the time of day (strftime_now) before it, so every request "
        "differs there",
        "Nothing in the manifest moves it: pass a fixed value through chat_template_kwargs if "
        "the template reads one and the app sends the same, or serve with a template without "
        "the time",
    ),
    "per_request": (
        "the chat template puts content that differs per request before it",
        "Move dynamic content after the static prefix",
    ),
    "not_rendered": (
        "the chat template does not render it (requests do not carry it either)",
        "Check the template supports this role or tools, or drop it from the pin",
    ),
    "text": ("the text's last tokens merge with what follows it", "End the text at a boundary"),
    "not_found": (
        "kvstore cannot find it verbatim in the rendering (the template rewrites it)",
        "Check the pin with `kvstore analyze --model` on captured requests",
    ),
}
# The later turns a pin is checked against: a 2nd user message (user, assistant, user), and an
# agent loop's turns (one user message, then assistant tool_calls and tool results).
LATER_TURN_KINDS = {"chat": "later chat turns", "tool": "tool-call turns"}
# What the chat template does on a later turn with a part the first turn renders before the user.
LATER_TURN_CAUSES = {
    "moved_to_last_user": "moves it to the last user turn",
    "moved_after_user": "renders it after the user's message",
    "left_out": "leaves it out",
    "changed": "renders it differently",
}
_LATER_TURN_ADVICE = {
    "chat": "a 2nd user message re-prefills it from token {n}",
    "tool": "an agent loop re-prefills it from token {n} on every tool-call turn",
}


@dataclass(frozen=True)
class Part:
    """One piece of pinned content and where it ends in a request's rendering."""

    name: str  # "system text", "tool 'calculator'", "few-shot turn 1 (user)"
    end_char: int  # where it ends in the rendering; -1: not in it
    where: str  # "before_user" | "after_user" | "not_rendered" | "not_found"
    needle: str  # what identifies it in a rendering: the content, or the tool's name


@dataclass(frozen=True)
class PartCoverage:
    name: str
    end: int  # token position where the part ends in a request (0 when it is not there)
    covered: bool  # the pin holds all of it on a first turn
    later_turns: bool | None  # ... and on later chat turns (None: not checked)
    reason: str | None = None  # a key of REASONS when not covered
    tool_turns: bool | None = None  # ... and on an agent loop's tool-call turns (None: not checked)


def message_part_name(index: int, role: str, first_system: bool) -> str:
    if index == 0 and role in ("system", "developer"):
        return "system text" if first_system else f"{role} text"
    return f"few-shot turn {index} ({role})"


def _variants(text: str) -> list[str]:
    # Templates print content verbatim, trimmed, or through tojson (quotes and newlines escaped).
    s = text.strip()
    out = [s, json.dumps(s, ensure_ascii=False)[1:-1], json.dumps(s)[1:-1]]
    lines = [ln.strip() for ln in s.splitlines() if ln.strip()]
    if len(lines) > 1:
        out.append(lines[-1])
    return [v for v in dict.fromkeys(out) if v]


def _find_end(text: str, needle: str, start: int, stop: int) -> int:
    """End offset of the first occurrence of any variant of `needle` in text[start:stop], or -1."""
    for v in _variants(needle):
        at = text.find(v, start, stop)
        if at >= 0:
            return at + len(v)
    return -1


def _tool_leaves(tool: dict) -> tuple[str | None, list[str]]:
    """The tool's name and every string it carries (names, descriptions, enum values)."""
    inner = tool.get("function")
    fn: dict = inner if isinstance(inner, dict) else tool
    name = fn.get("name") if isinstance(fn.get("name"), str) else None
    leaves: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and k not in ("type", "function", "parameters"):
                    leaves.append(k)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, str) and len(node) > 2:
            leaves.append(node)

    walk(fn)
    generic = {"type", "object", "string", "properties", "required", "description", "name"}
    return name, [leaf for leaf in leaves if leaf not in generic]


def locate_parts(
    text: str, user_at: int, messages: Sequence[dict], tools: Sequence[dict] | None
) -> list[Part]:
    """Each part of the pinned content, found in `text` (a request's rendering) before the user's
    message at `user_at`, else after it, else not at all."""
    parts: list[Part] = []
    cursor = 0
    for i, m in enumerate(messages):
        name = message_part_name(i, m.get("role", ""), True)
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            continue
        end = _find_end(text, content, cursor, user_at)
        if end < 0:
            end = _find_end(text, content, 0, user_at)
        if end >= 0:
            parts.append(Part(name, end, "before_user", content))
            cursor = max(cursor, end)
            continue
        after = _find_end(text, content, user_at, len(text))
        where = "after_user" if after >= 0 else _absent(text, content)
        parts.append(Part(name, after, where, content))
    named = [(t, *_tool_leaves(t)) for t in tools or ()]
    starts = []
    for _, tool_name, _ in named:
        at = text.find(tool_name, 0, user_at) if tool_name else -1
        starts.append(at)
    for k, (_, tool_name, leaves) in enumerate(named):
        label = f"tool {tool_name!r}" if tool_name else f"tool #{k}"
        start = starts[k]
        if start < 0:
            after = text.find(tool_name, user_at) if tool_name else -1
            where = "after_user" if after >= 0 else "not_rendered"
            parts.append(
                Part(
                    label,
                    after + len(tool_name or "") if after >= 0 else -1,
                    where,
                    tool_name or "",
                )
            )
            continue
        later = [s for s in starts if s > start]
        stop = min(later) if later else user_at
        end = start + len(tool_name or "")
        for leaf in leaves:
            e = _find_end(text, leaf, start, stop)
            end = max(end, e)
        parts.append(Part(label, end, "before_user", tool_name or ""))
    return parts


def found_after(text: str, needle: str, start: int) -> bool:
    return bool(needle) and _find_end(text, needle, start, len(text)) >= 0


def _absent(text: str, content: str) -> str:
    # A few words of it present: the template rewrote it; none: it dropped it.
    words = [w for w in content.split() if len(w) > 3][:8]
    return (
        "not_found"
        if words and sum(w in text for w in words) * 2 >= len(words)
        else ("not_rendered")
    )


def cut_warning(
    name: str,
    lost: list[tuple[PartCoverage, str]],
    *,
    keep: int,
    content_end: int,
    context: tuple[str, str],
) -> str:
    """One warning naming every part the pin does not hold, why, and what to do."""
    before, after = context
    pieces = []
    advice: list[str] = []
    for part, reason in lost:
        cause, todo = REASONS[reason]
        at = f" (ends at token {part.end})" if part.end else ""
        where = "in requests" if reason == "not_rendered" else "in the pin"
        pieces.append(f"the {part.name}{at} is not {where}: {cause}")
        advice.append(todo)
    head = f"pin {name!r}: "
    if any(reason != "not_rendered" for _, reason in lost):
        head += (
            f"the stable prefix ends at token {keep} of {content_end} "
            f"(... {before!r} | {after!r} ...); only {keep} tokens can be cached. "
        )
    return head + "; ".join(pieces) + ". " + ". ".join(dict.fromkeys(advice)) + "."


def later_turns_warning(
    name: str,
    lost: list[tuple[PartCoverage, dict[str, str]]],
    *,
    shared: dict[str, int | None],
    pin_len: int,
) -> str:
    """One warning for the parts later turns do not share: per kind of later turn (a key of
    LATER_TURN_KINDS), how many of the pin's tokens it shares and what the template does."""
    counts, served, missed, advice = [], [], [], []
    for kind, label in LATER_TURN_KINDS.items():
        n = shared.get(kind)
        if n is None:
            counts.append(f"{label} are not checked (the chat template fails on them)")
        elif n >= pin_len:
            counts.append(f"{label} share all {pin_len}")
            served.append(label)
        else:
            counts.append(f"{label} share {n} of {pin_len} tokens")
            missed.append(label)
            advice.append(_LATER_TURN_ADVICE[kind].format(n=n))
    if served:
        head = f"pin {name!r} serves {' and '.join(served)} but not {' and '.join(missed)}"
        tail = f"{'; '.join(advice)}; {' and '.join(served)} are served in full"
    else:
        head = f"pin {name!r} is single-turn only"
        tail = f"The pin serves single-turn requests only: {'; '.join(advice)}"
    pieces = []
    for part, reasons in lost:
        how = ", ".join(
            f"on {LATER_TURN_KINDS[kind]} the chat template {LATER_TURN_CAUSES[reason]}"
            for kind, reason in reasons.items()
        )
        pieces.append(f"the {part.name}: {how}")
    return f"{head}: {'; '.join(counts)}; {'; '.join(pieces)}. {tail[0].upper()}{tail[1:]}."


def snippet(text: str, at: int) -> tuple[str, str]:
    return text[max(0, at - _SNIPPET) : at], text[at : at + _SNIPPET]


def token_end(chars_to_tokens: Callable[[int], int], part: Part) -> int:
    return chars_to_tokens(part.end_char) if part.end_char >= 0 else 0
