"""Render a manifest prefix to the token ids a pin stores: the stable boundary rule.

A pin only pays off if real requests start with exactly its tokens, so it is cut from what
requests look like: the pinned messages followed by several different user turns, rendered with
add_generation_prompt=True as mlx_lm.server renders them (same tools, same template arguments),
at several times of day and on other days. The pinned messages are never rendered alone: no
request looks like that, and templates may take another branch or refuse it. What the cut leaves
out of the pinned content (kvstore.pins.coverage) is said loudly. When only the date cuts it, the
pin
is today's full prefix and says the date it holds for (`valid_date`); the daemon re-warms it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass
from typing import Any

from kvstore import tokens as tk
from kvstore.degrade import foreign
from kvstore.errors import ManifestError
from kvstore.pins import coverage
from kvstore.pins.clock import clock_at, local_now
from kvstore.pins.coverage import PartCoverage
from kvstore.pins.manifest import PrefixSpec, oversized

log = logging.getLogger("kvstore")

# Different first characters, content and lengths: no BPE merge can make them agree past the pin.
CHAT_PROBES = (
    "Alpha: what is 2+2?",
    "7 zebras, why?",
    "¿Por qué? Explain in one short paragraph why the sky looks blue at noon, please.",
    '{"task": "summarize", "text": "x"}',
)
LATER_TURN_ANSWER = "4."  # the assistant reply (and tool result) of the later-turn probes
# Mistral's templates refuse tool-call ids that are not 9 alphanumeric characters.
TOOL_CALL_IDS = ("a1B2c3D4e", "f5G6h7J8k")
TEXT_PROBES = ("\nAlpha: what is 2+2?", " 7 zebras, why?")
# Times of day a request of the same date may be rendered at, and other days it may come on.
PROBE_TIMES = (dt.time(0, 0, 1), dt.time(23, 59, 58))
PROBE_DAYS = (1, 400)


@dataclass(frozen=True)
class RenderedPin:
    name: str
    tokens: tuple[int, ...]  # the pin: the prefix every probe request shares
    rendered: tuple[int, ...]  # one full probe request, before the cut
    content_end: int  # token position where the pinned content ends in a request
    warning: str | None  # set when the pin misses part of the pinned content
    parts: tuple[PartCoverage, ...] = ()  # system text, each tool, few-shot turns
    valid_date: str | None = None  # ISO date: the pin holds its template's date for this day
    # True: every later turn checked (chat and tool-call) shares the whole pin; False: none does
    # (single-turn only); None: a text pin, nothing checked, or one kind only (the warning says).
    multi_turn: bool | None = None
    later_turn_tokens: int | None = None  # how many of its tokens a later chat turn shares
    tool_turn_tokens: int | None = None  # ... an agent loop's tool-call turn shares

    @property
    def cut_into_content(self) -> bool:
        """Part of the pinned content is not in the pin, even on a first turn."""
        return any(not p.covered for p in self.parts)

    @property
    def single_turn(self) -> bool:
        """No kind of later turn (2nd user message, tool-call turn) shares the whole pin."""
        return self.multi_turn is False

    @property
    def clock_bound(self) -> bool:
        return self.valid_date is not None


def render_prefix(
    tokenizer: Any,
    prefix: PrefixSpec,
    *,
    now: dt.datetime | None = None,
    max_tokens: int | None = None,
) -> RenderedPin:
    """Render `prefix` with `tokenizer` (mlx-lm TokenizerWrapper or a transformers tokenizer)
    as requests on the local day of `now` (default: the real clock) render it. Content whose
    size alone says it cannot fit `max_tokens` is refused before it is tokenized."""
    if max_tokens is not None and (why := oversized(prefix, max_tokens)):
        raise ManifestError(why)
    if prefix.text is not None:
        pin = _render_text(tokenizer, prefix)
    elif prefix.messages is not None:
        pin = _render_chat(tokenizer, prefix, now or local_now())
    else:
        raise ManifestError(f"prefix {prefix.name!r}: has neither messages nor text")
    if not pin.tokens:
        raise ManifestError(
            f"pin {prefix.name!r}: empty: requests built from it share no leading token "
            f"(the chat template starts with per-request content); nothing can be cached"
        )
    if pin.warning:
        log.warning(pin.warning)
    return pin


def pin_extra(pin: RenderedPin, template_kwargs: dict | None, *, chat: bool = True) -> dict:
    """Meta extra fields of a rendered pin: for a chat pin the template arguments it was rendered
    with ({} for none: `kvstore serve` compares them), for a clock-bound pin its local date."""
    out: dict = {}
    if chat:
        out["chat_template_kwargs"] = dict(template_kwargs or {})
    if pin.valid_date:
        out["valid_date"] = pin.valid_date
    return out


class _Requests:
    """Renders requests of the pinned messages as mlx_lm.server does, at a chosen clock."""

    def __init__(self, tokenizer: Any, prefix: PrefixSpec):
        self.tokenizer, self.name = tokenizer, prefix.name
        self.messages = [dict(m) for m in prefix.messages or ()]
        self.tools = [dict(t) for t in prefix.tools_data] if prefix.tools_data else None
        self.kwargs = dict(prefix.chat_template_kwargs or {})

    def ids(self, turns: list[dict], at: dt.datetime) -> list[int]:
        with clock_at(at):
            return _as_ids(self._apply(turns, tokenize=True))

    def text(self, turns: list[dict], at: dt.datetime) -> str:
        with clock_at(at):
            out = self._apply(turns, tokenize=False)
        if not isinstance(out, str):
            raise ManifestError(
                f"prefix {self.name!r}: the chat template returned {type(out).__name__}"
            )
        return out

    def _apply(self, turns: list[dict], *, tokenize: bool) -> Any:
        # As mlx_lm.server: TokenizerWrapper.apply_chat_template injects enable_thinking.
        def failed(e: Exception) -> ManifestError:
            return ManifestError(
                f"pin {self.name!r}: the chat template failed on a request built from these "
                f"messages: {type(e).__name__}: {e}"
            )

        with foreign(failed):
            return self.tokenizer.apply_chat_template(
                self.messages + turns,
                tools=self.tools,
                add_generation_prompt=True,
                tokenize=tokenize,
                **({"return_dict": False} if tokenize and not _is_wrapper(self.tokenizer) else {}),
                **self.kwargs,
            )


def _is_wrapper(tokenizer: Any) -> bool:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return isinstance(tokenizer, TokenizerWrapper)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _render_chat(tokenizer: Any, prefix: PrefixSpec, now: dt.datetime) -> RenderedPin:
    req = _Requests(tokenizer, prefix)
    first = [_user(CHAT_PROBES[0])]
    ids0 = req.ids(first, now)
    text0 = req.text(first, now)
    keep_req = tk.common_prefix(ids0, *[req.ids([_user(p)], now) for p in CHAT_PROBES[1:]])
    times = [dt.datetime.combine(now.date(), t, now.tzinfo) for t in PROBE_TIMES]
    keep_time = tk.common_prefix(ids0, *[req.ids(first, t) for t in times])
    days = [now + dt.timedelta(days=d) for d in PROBE_DAYS]
    keep_day = tk.common_prefix(ids0, *[req.ids(first, d) for d in days])
    keep = min(keep_req, keep_time)

    chars = _CharIndex(tokenizer, text0, ids0, False)
    user_at = text0.rfind(CHAT_PROBES[0])
    user_at = len(text0) if user_at < 0 else user_at
    located = coverage.locate_parts(text0, user_at, req.messages, req.tools)
    ends = [coverage.token_end(chars.tokens_to_cover, p) for p in located]
    content_end = max(ends, default=0)
    valid_date = None
    if keep_day < keep:
        if keep_day >= content_end:
            keep = keep_day  # the date comes after the pinned content: cut there, lose nothing
        else:
            valid_date = now.date().isoformat()
    tokens = ids0[:keep]
    reach = chars.end_of(keep)

    later = {kind: _later_turn(req, kind, tokens, now) for kind in coverage.LATER_TURN_KINDS}
    later_reach = {k: None if t is None else chars.end_of(t.shared) for k, t in later.items()}
    later_text = {k: t.text for k, t in later.items() if t is not None}

    parts, later_lost = [], []
    lost: list[tuple[PartCoverage, str]] = []
    for part, end in zip(located, ends, strict=True):
        covered = part.where == "before_user" and reach >= part.end_char
        ok = {
            k: None if r is None else covered and r >= part.end_char for k, r in later_reach.items()
        }
        reason = None if covered else _reason(part, keep, keep_req, keep_time)
        pc = PartCoverage(part.name, end, covered, ok["chat"], reason, ok["tool"])
        parts.append(pc)
        if reason is not None:  # not covered
            lost.append((pc, reason))
        elif False in ok.values():
            why = {k: _later_reason(part, later_text[k], k) for k, v in ok.items() if v is False}
            later_lost.append((pc, why))
    warnings = []
    if lost:
        warnings.append(
            coverage.cut_warning(
                prefix.name,
                lost,
                keep=keep,
                content_end=content_end,
                context=coverage.snippet(text0, reach),
            )
        )
    shared = {k: None if t is None else t.shared for k, t in later.items()}
    if later_lost:
        warnings.append(
            coverage.later_turns_warning(
                prefix.name, later_lost, shared=shared, pin_len=len(tokens)
            )
        )
    full = [n == len(tokens) for n in shared.values() if n is not None]
    # False only when no kind of later turn gets the whole pin: "single-turn only".
    multi_turn = all(full) if full and (all(full) or not any(full)) else None
    return RenderedPin(
        prefix.name,
        tuple(tokens),
        tuple(ids0),
        content_end,
        " ".join(warnings) or None,
        tuple(parts),
        valid_date,
        multi_turn,
        shared["chat"],
        shared["tool"],
    )


def _reason(part: coverage.Part, keep: int, keep_req: int, keep_time: int) -> str:
    if part.where != "before_user":
        return part.where
    return "time" if keep_time < keep_req and keep == keep_time else "per_request"


@dataclass(frozen=True)
class _LaterTurn:
    shared: int  # how many of the pin's tokens this later turn shares
    text: str  # its rendering


def _later_turn(
    req: _Requests, kind: str, tokens: list[int], now: dt.datetime
) -> _LaterTurn | None:
    """The later turn of this kind (a key of coverage.LATER_TURN_KINDS) that shares the least of
    the pin; None when the template cannot render one (mlx_lm.server could not either)."""
    if kind == "chat":
        probes = [[_user(CHAT_PROBES[0]), _assistant(LATER_TURN_ANSWER), _user(CHAT_PROBES[1])]]
    else:  # an agent loop: its 1st and 2nd tool-call turns
        probes = [_tool_call_turns(req.tools, rounds) for rounds in (1, 2)]
    worst = None
    for turns in probes:
        try:
            ids, text = req.ids(turns, now), req.text(turns, now)
        except ManifestError as e:
            log.info("pin %r: %s not checked: %s", req.name, coverage.LATER_TURN_KINDS[kind], e)
            return None
        shared = tk.common_prefix(tokens, ids)
        if worst is None or shared < worst.shared:
            worst = _LaterTurn(shared, text)
    return worst


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _tool_call_turns(tools: list[dict] | None, rounds: int) -> list[dict]:
    """One user message, then `rounds` tool calls and their results, as an OpenAI client sends
    them and mlx_lm.server hands them to the template (arguments parsed, None content as "")."""
    from kvstore import mlxlm

    tool = (tools or [{}])[0]
    function = tool.get("function")
    fn = function if isinstance(function, dict) else tool
    name = fn.get("name") if isinstance(fn.get("name"), str) else "lookup"
    turns = [_user(CHAT_PROBES[0])]
    for call_id in TOOL_CALL_IDS[:rounds]:
        args = json.dumps({"query": CHAT_PROBES[1]})
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        turns.append({"role": "tool", "tool_call_id": call_id, "content": LATER_TURN_ANSWER})
    mlxlm.process_message_content(turns)
    return turns


def _later_reason(part: coverage.Part, later_text: str, kind: str) -> str:
    """What a later turn does with the part (a key of coverage.LATER_TURN_CAUSES): after the first
    user message means the template moves it there (Mistral's system text and [AVAILABLE_TOOLS]);
    nowhere, that it leaves it out (Mistral Nemo's system text on tool-call turns)."""
    first_user = later_text.find(CHAT_PROBES[0])
    if first_user >= 0 and coverage.found_after(later_text, part.needle, first_user):
        return "moved_to_last_user" if kind == "chat" else "moved_after_user"
    if not coverage.found_after(later_text, part.needle, 0):
        return "left_out"
    return "changed"


def _render_text(tokenizer: Any, prefix: PrefixSpec) -> RenderedPin:
    text = prefix.text or ""
    special = _wants_special_tokens(tokenizer, text)
    rendered = _encode(tokenizer, text, special)
    probe_ids = [_encode(tokenizer, text + p, special) for p in TEXT_PROBES]
    keep = tk.common_prefix(rendered, *probe_ids)
    chars = _CharIndex(tokenizer, text, rendered, special)
    # Whitespace at the end is not content a cache miss would cost.
    content_chars = len(text.rstrip())
    content_end = chars.tokens_to_cover(content_chars)
    covered = chars.end_of(keep) >= content_chars
    part = PartCoverage("text", content_end, covered, None, None if covered else "text")
    warning = None
    if not covered:
        warning = coverage.cut_warning(
            prefix.name,
            [(part, "text")],
            keep=keep,
            content_end=content_end,
            context=coverage.snippet(text, chars.end_of(keep)),
        )
    return RenderedPin(
        prefix.name, tuple(rendered[:keep]), tuple(rendered), content_end, warning, (part,)
    )


def _wants_special_tokens(tokenizer: Any, text: str) -> bool:
    # Mirrors mlx_lm.generate: add BOS to a raw prompt unless the text already starts with it.
    bos = getattr(tokenizer, "bos_token", None)
    return bos is None or not text.startswith(bos)


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    # Chat renderings carry their own special tokens, so mlx-lm encodes them without extras.
    return _as_ids(tokenizer.encode(text, add_special_tokens=special))


def _as_ids(out: Any) -> list[int]:
    # transformers 5 may hand back a mapping with input_ids instead of a list.
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


class _CharIndex:
    """Maps token counts to character offsets in the rendered string."""

    def __init__(self, tokenizer: Any, text: str, ids: list[int], special: bool):
        self.tokenizer, self.ids = tokenizer, ids
        self.ends = _offset_ends(tokenizer, text, ids, special)

    def end_of(self, n: int) -> int:
        """Characters covered by the first `n` tokens."""
        if self.ends is not None:
            return self.ends[n]
        # No offsets: fall back to the decoded length, which is exact for byte-level BPE.
        return len(self.tokenizer.decode(self.ids[:n])) if n else 0

    def tokens_to_cover(self, chars: int) -> int:
        """The fewest tokens whose text reaches `chars` characters."""
        lo, hi = 0, len(self.ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.end_of(mid) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo


def _offset_ends(tokenizer: Any, text: str, ids: list[int], special: bool) -> list[int] | None:
    from kvstore import mlxlm

    # The wrapper's own __call__ is not the transformers one; ask the tokenizer it wraps.
    backend = mlxlm.tokenizer_backend(tokenizer)
    try:
        enc = backend(text, add_special_tokens=special, return_offsets_mapping=True)
        if _as_ids(enc["input_ids"]) != ids:
            return None
        ends, reach = [0], 0
        for _, stop in enc["offset_mapping"]:
            reach = max(reach, int(stop))
            ends.append(reach)
        return ends
    except (NotImplementedError, TypeError, ValueError, KeyError, AttributeError):
        return None  # slow tokenizers have no offsets (NotImplementedError); decoding still works
