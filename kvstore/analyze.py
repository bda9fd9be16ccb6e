"""`kvstore analyze`: how much of each stage's prompts a prefix cache can serve, and what would.

For every stage of a capture: the prefix all its calls share (in tokens with --model, and in
bytes), where the first dynamic block starts, and the cacheable share after a static-first
reordering: lines identical in every call stay in their messages, in order, and the lines that
vary move into one trailing user turn. The reordered prompts are rendered and measured the same
way, so the figure is what a cache would see, template quirks included.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.jsonl import read_objects
from kvstore.staticfirst import moved_lines, static_lines
from kvstore.tokens import common_prefix

CONTEXT = 30  # characters of stable text shown before the first dynamic block
DYNAMIC = 50  # at most this many characters of the dynamic block (it ends at a line end)


class CaptureError(KVStoreError):
    """A capture file cannot be read."""


@dataclass(frozen=True)
class Capture:
    stage: str
    line: int
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    tools: tuple[dict, ...] | None = None


@dataclass
class StageReport:
    stage: str
    calls: int
    unit: str  # "tokens" with a model, else "bytes": the unit of reorder_share
    mean_bytes: float
    stable_bytes: int
    byte_share: float
    mean_tokens: float | None
    stable_tokens: int | None
    token_share: float | None
    first_dynamic_byte: int | None  # None: every call is the same prompt
    first_dynamic_token: int | None
    context_before: str
    dynamic: str  # the first call's text from the first divergence to its line's end
    reorder_share: float
    static_lines: int  # lines of the first call that are the same in every call
    lines: int
    # The pin kvstore's rule gives the leading messages every call shares (with --model).
    pin_tokens: int | None = None
    pin_multi_turn: bool | None = None  # False: single-turn only (the template moves it)
    pin_valid_date: str | None = None  # clock-bound: the template prints the date
    pin_warning: str | None = None

    @property
    def snippet(self) -> str:
        if self.first_dynamic_byte is None:
            return "(no dynamic block: every call is the same prompt)"
        return f"...{_show(self.context_before)}[[{_show(self.dynamic)}]]"


def load_capture(path: str | Path) -> list[Capture]:
    """Read JSONL lines of {"stage", and "text" or "messages" (+ "tools")}."""
    path = Path(path)
    out = []
    for n, obj in read_objects(path, CaptureError, "the capture"):
        text, messages, tools = obj.get("text"), obj.get("messages"), obj.get("tools")
        if isinstance(text, str) == isinstance(messages, list):
            raise CaptureError(f'{path}:{n}: give either "text" (a string) or "messages"')
        if messages is not None and not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
        ):
            raise CaptureError(
                f"{path}:{n}: messages must be {{role, content}} objects with string content"
            )
        out.append(
            Capture(
                str(obj.get("stage", "(none)")),
                n,
                text,
                tuple(messages) if messages is not None else None,
                tuple(tools) if isinstance(tools, list) else None,
            )
        )
    if not out:
        raise CaptureError(f"{path}: no captured prompts")
    return out


class Renderer:
    """Turns a prompt into the text (and tokens) a server would feed the model."""

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    def text(self, messages: Sequence[dict] | None, tools: Any, text: str | None) -> str:
        if text is not None:
            return text
        if self.tokenizer is None:
            return _generic_chat(messages or (), tools)
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages or ()],
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=False,
        )

    def tokens(self, rendered: str, *, raw_text: bool) -> list[int] | None:
        if self.tokenizer is None:
            return None
        # As mlx_lm.server: chat renderings carry their own special tokens; raw text gets BOS.
        ids = self.tokenizer.encode(rendered, add_special_tokens=raw_text)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _generic_chat(messages: Sequence[dict], tools: Any) -> str:
    """A template-free rendering for byte-level stats: tools follow the system turn, as most
    chat templates place them."""
    parts = [f"<|{m.get('role', '')}|>\n{m['content']}\n" for m in messages]
    if tools:
        at = 1 if messages and messages[0].get("role") == "system" else 0
        parts.insert(at, "<|tools|>\n" + json.dumps(list(tools), sort_keys=True) + "\n")
    return "".join(parts) + "<|assistant|>\n"


def static_first(calls: list[Capture]) -> tuple[list[Capture], int, int]:
    """The calls reordered static-first; also (static lines, lines) of the first call."""
    if any(c.messages is None for c in calls):
        groups = [(c.text or "").splitlines(keepends=True) for c in calls]
        static = static_lines(groups)
        out = [
            Capture(c.stage, c.line, text="".join(static + moved_lines(g, static)))
            for c, g in zip(calls, groups)
        ]
        return out, len(static), len(groups[0])
    turns = [c.messages or () for c in calls]  # none is None here
    # Messages align by position while every call has the same role there.
    aligned = 0
    for column in zip(*turns, strict=False):
        if any(m.get("role") != column[0].get("role") for m in column):
            break
        aligned += 1
    statics = [
        static_lines([t[i]["content"].splitlines(keepends=True) for t in turns])
        for i in range(aligned)
    ]
    out = []
    for c, msgs in zip(calls, turns):
        head, moved = [], []
        for i, m in enumerate(msgs):
            lines = m["content"].splitlines(keepends=True)
            static = statics[i] if i < aligned else []
            if static:
                head.append({"role": m.get("role"), "content": "".join(static)})
            moved += moved_lines(lines, static)
        if moved:
            head.append({"role": "user", "content": "".join(moved)})
        out.append(Capture(c.stage, c.line, messages=tuple(head), tools=c.tools))
    n_lines = sum(len(m["content"].splitlines()) for m in turns[0])
    return out, sum(len(s) for s in statics), n_lines


def _measure(renderer: Renderer, calls: list[Capture]) -> tuple[list[str], list | None]:
    texts = [renderer.text(c.messages, c.tools, c.text) for c in calls]
    if renderer.tokenizer is None:
        return texts, None
    return texts, [renderer.tokens(t, raw_text=c.text is not None) for t, c in zip(texts, calls)]


def _share(stable: int | None, lengths: Sequence[int]) -> float:
    """`stable` (None: none, with no token counts) over the mean of `lengths`."""
    mean = sum(lengths) / len(lengths)
    return (stable or 0) / mean if mean else 1.0


def analyze_stage(stage: str, calls: list[Capture], renderer: Renderer) -> StageReport:
    texts, tokens = _measure(renderer, calls)
    nbytes = [len(t.encode()) for t in texts]
    chars = common_prefix(*texts)
    # Stable bytes end at a character boundary: a split multi-byte character is not stable.
    stable_bytes = len(texts[0][:chars].encode())
    same = len(set(texts)) == 1
    first = texts[0]
    line_end = first.find("\n", chars)
    dyn_end = min(len(first), chars + DYNAMIC, line_end if line_end >= 0 else len(first))
    if dyn_end == chars:  # the dynamic block starts with a line break: show the next line
        dyn_end = min(len(first), chars + DYNAMIC)
    stable_tokens = common_prefix(*tokens) if tokens else None
    reordered, n_static, n_lines = static_first(calls)
    r_texts, r_tokens = _measure(renderer, reordered)
    if r_tokens is not None:
        reorder = _share(common_prefix(*r_tokens), [len(t) for t in r_tokens])
    else:
        reorder = _share(
            len(r_texts[0][: common_prefix(*r_texts)].encode()), [len(t.encode()) for t in r_texts]
        )
    return StageReport(
        stage=stage,
        calls=len(calls),
        unit="tokens" if tokens else "bytes",
        mean_bytes=sum(nbytes) / len(nbytes),
        stable_bytes=stable_bytes,
        byte_share=_share(stable_bytes, nbytes),
        mean_tokens=sum(map(len, tokens)) / len(tokens) if tokens else None,
        stable_tokens=stable_tokens,
        token_share=_share(stable_tokens, [len(t) for t in tokens]) if tokens else None,
        first_dynamic_byte=None if same else stable_bytes,
        first_dynamic_token=None if same or not tokens else stable_tokens,
        context_before="" if same else first[max(0, chars - CONTEXT) : chars],
        dynamic="" if same else first[chars:dyn_end],
        # Prompts already static-first may render a hair differently reordered; never report less.
        reorder_share=max(
            reorder,
            _share(stable_tokens, [len(t) for t in tokens])
            if tokens
            else _share(stable_bytes, nbytes),
        ),
        static_lines=n_static,
        lines=n_lines,
    )


def shared_messages(calls: list[Capture]) -> tuple[list[dict], tuple | None]:
    """The leading messages (and tools) identical in every call, the last turn left out: what a
    manifest pin of this stage would hold."""
    if any(c.messages is None for c in calls):
        return [], None
    out = []
    for column in zip(*((c.messages or ())[:-1] for c in calls), strict=False):
        if any(m != column[0] for m in column):
            break
        out.append(dict(column[0]))
    tools = calls[0].tools if all(c.tools == calls[0].tools for c in calls) else None
    return out, tools


def stage_pin(stage: str, calls: list[Capture], tokenizer: Any) -> dict[str, Any]:
    """The pin kvstore's stable-boundary rule gives this stage, as a manifest warm would."""
    from kvstore.pins.manifest import PrefixSpec
    from kvstore.pins.render import render_prefix

    messages, tools = shared_messages(calls)
    if not messages:
        return {}
    spec = PrefixSpec(stage, tuple(messages), None, None, None, tools)
    try:
        pin = render_prefix(tokenizer, spec)
    except KVStoreError as e:
        return {"pin_tokens": 0, "pin_warning": str(e)}
    return {
        "pin_tokens": len(pin.tokens),
        "pin_multi_turn": pin.multi_turn,
        "pin_valid_date": pin.valid_date,
        "pin_warning": pin.warning,
    }


def analyze(captures: list[Capture], *, tokenizer: Any = None) -> list[StageReport]:
    """One report per stage, in order of first appearance."""
    stages: dict[str, list[Capture]] = {}
    for c in captures:
        stages.setdefault(c.stage, []).append(c)
    renderer = Renderer(tokenizer)
    reports = []
    for name, calls in stages.items():
        report = analyze_stage(name, calls, renderer)
        if tokenizer is not None:
            for key, value in stage_pin(name, calls, tokenizer).items():
                setattr(report, key, value)
        reports.append(report)
    return reports


def _show(text: str) -> str:
    return text.replace("\n", "\\n")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_table(reports: list[StageReport]) -> str:
    rows = [
        f"{'stage':20} {'calls':>5} {'stable tok':>10} {'stable B':>9} "
        f"{'1st dynamic @tok/B':>19} {'static-first':>12}"
    ]
    for r in reports:
        at = (
            "-"
            if r.first_dynamic_byte is None
            else (
                f"{'-' if r.first_dynamic_token is None else r.first_dynamic_token}/"
                f"{r.first_dynamic_byte}"
            )
        )
        rows.append(
            f"{r.stage[:20]:20} {r.calls:5d} {_pct(r.token_share):>10} "
            f"{_pct(r.byte_share):>9} {at:>19} {_pct(r.reorder_share):>12}"
        )
        rows.append(f"  first dynamic block: {r.snippet}")
        if r.pin_tokens is not None:
            notes = [] if r.pin_multi_turn is not False else ["single-turn only"]
            if r.pin_valid_date:
                notes.append(f"clock-bound: valid {r.pin_valid_date}, re-warmed daily")
            more = f" ({'; '.join(notes)})" if notes else ""
            rows.append(f"  pin of its shared messages: {r.pin_tokens} tokens{more}")
            if r.pin_warning:
                rows.append(f"  warning: {r.pin_warning}")
        if r.calls == 1:
            rows.append("  (one call: nothing to compare; capture more calls of this stage)")
        else:
            rows.append(
                f"  {r.static_lines} of {r.lines} lines are the same in every call; "
                f"static-first ({r.unit}) moves the rest into a trailing user turn"
            )
    return "\n".join(rows)
