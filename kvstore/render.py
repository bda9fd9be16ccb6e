"""Render a manifest prefix to the token ids a pin stores: the stable boundary rule.

A pin only pays off if real prompts start with exactly its tokens. So the prefix is rendered
alone and followed by two different probe turns, and only the tokens all three share are kept.
Templates that put per-request content (a date, the user turn) before the pinned text are
reported loudly, since they defeat every prefix cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ManifestError
from kvstore.manifest import PrefixSpec

log = logging.getLogger("kvstore")

# First characters differ so no BPE merge can make the probes agree past the prefix.
CHAT_PROBES = ("Alpha: what is 2+2?", "7 zebras, why?")
TEXT_PROBES = ("\nAlpha: what is 2+2?", " 7 zebras, why?")
# Templates such as Llama 3's print a date; a real request may carry any date.
PROBE_DATES = ("01 Jan 2001", "31 Dec 2099")
_SNIPPET = 24
# Why a pin can lose pinned tokens, and what the author can do about it.
_CUT_REASONS = {
    "chat": (
        "the chat template puts content that differs per request before the end of the "
        "pinned messages",
        "Move dynamic content after the static prefix",
    ),
    "text": ("the text's last tokens merge with what follows it", "End the text at a boundary"),
}


@dataclass(frozen=True)
class RenderedPin:
    name: str
    tokens: tuple[int, ...]  # the pin: the prefix shared by the rendering and every probe
    rendered: tuple[int, ...]  # the full rendering (add_generation_prompt=False), before the cut
    content_end: int  # token position where the pinned content ends (approximate)
    warning: str | None  # set when the cut falls inside the pinned content

    @property
    def cut_into_content(self) -> bool:
        return self.warning is not None


def render_prefix(tokenizer: Any, prefix: PrefixSpec) -> RenderedPin:
    """Render `prefix` with `tokenizer` (mlx-lm TokenizerWrapper or a transformers tokenizer)."""
    if prefix.text is not None:
        text, probes, anchors = _render_text(prefix.text)
    elif prefix.messages is not None:
        text, probes, anchors = _render_messages(tokenizer, prefix)
    else:
        raise ManifestError(f"prefix {prefix.name!r}: has neither messages nor text")
    special = prefix.text is not None and _wants_special_tokens(tokenizer, text)
    rendered = _encode(tokenizer, text, special)
    probe_ids = [_encode(tokenizer, p, special) for p in probes]
    keep = _common_prefix_len([rendered, *probe_ids])
    chars = _CharIndex(tokenizer, text, rendered, special)
    content_chars = _content_end_char(text, anchors)
    content_end = chars.tokens_to_cover(content_chars)
    warning = None
    if chars.end_of(keep) < content_chars:
        kind = "text" if prefix.text is not None else "chat"
        warning = _cut_warning(prefix.name, kind, text, keep, content_end, chars.end_of(keep))
        log.warning(warning)
    return RenderedPin(prefix.name, tuple(rendered[:keep]), tuple(rendered), content_end, warning)


def _render_messages(tokenizer: Any, prefix: PrefixSpec) -> tuple[str, list[str], list[str]]:
    messages = [dict(m) for m in prefix.messages or ()]
    tools = [dict(t) for t in prefix.tools_data] if prefix.tools_data else None
    text = _template(tokenizer, prefix.name, messages, tools, add_generation_prompt=False)
    probes = [
        _template(
            tokenizer,
            prefix.name,
            messages + [{"role": "user", "content": probe}],
            tools,
            add_generation_prompt=True,
            date_string=date,
        )
        for probe, date in zip(CHAT_PROBES, PROBE_DATES, strict=True)
    ]
    anchors = [m["content"] for m in messages] + _tool_anchors(tools or [])
    return text, probes, anchors


def _render_text(text: str) -> tuple[str, list[str], list[str]]:
    return text, [text + probe for probe in TEXT_PROBES], [text]


def _template(
    tokenizer: Any, name: str, messages: list[dict], tools: list | None, **kwargs: Any
) -> str:
    try:
        try:
            out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
        except TypeError:
            if "date_string" not in kwargs:
                raise
            # A template callable that rejects extra kwargs: probe without the date.
            kwargs.pop("date_string")
            out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    except Exception as e:
        raise ManifestError(
            f"prefix {name!r}: the chat template failed on these messages: {e}"
        ) from e
    if not isinstance(out, str):
        raise ManifestError(f"prefix {name!r}: the chat template returned {type(out).__name__}")
    return out


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


def _common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    n = 0
    # Lengths differ on purpose: the shortest sequence bounds the common prefix.
    for column in zip(*seqs, strict=False):
        if any(t != column[0] for t in column[1:]):
            break
        n += 1
    return n


def _tool_anchors(tools: list[dict]) -> list[str]:
    # Names and descriptions are what templates print verbatim; the JSON layout varies.
    anchors = []
    for tool in tools:
        for table in (tool, tool.get("function")):
            if isinstance(table, dict):
                anchors += [v for k, v in table.items() if k in ("name", "description")]
    return [a for a in anchors if isinstance(a, str)]


def _content_end_char(text: str, anchors: list[str]) -> int:
    """Character offset in `text` where the pinned content ends (0 when none is found)."""
    end = 0
    for anchor in anchors:
        # Whitespace at the edges is not content a cache miss would cost, and templates trim it.
        anchor = anchor.strip()
        found = text.rfind(anchor) if anchor else -1
        if found >= 0:
            end = max(end, found + len(anchor))
        elif anchor:
            log.debug("pinned content not found verbatim in the rendering: %.40r", anchor)
    return end


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
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    # The wrapper's own __call__ is not the transformers one; ask the tokenizer it wraps.
    backend = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    try:
        enc = backend(text, add_special_tokens=special, return_offsets_mapping=True)
        if _as_ids(enc["input_ids"]) != ids:
            return None
        ends, reach = [0], 0
        for _, stop in enc["offset_mapping"]:
            reach = max(reach, int(stop))
            ends.append(reach)
        return ends
    except Exception:  # slow tokenizers have no offsets; decoding still works
        return None


def _cut_warning(
    name: str, kind: str, text: str, keep: int, content_end: int, cut_char: int
) -> str:
    cause, advice = _CUT_REASONS[kind]
    before = text[max(0, cut_char - _SNIPPET) : cut_char]
    after = text[cut_char : cut_char + _SNIPPET]
    return (
        f"pin {name!r}: {cause}; the stable prefix ends at token {keep} of {content_end} "
        f"(... {before!r} | {after!r} ...); only {keep} tokens can be cached and "
        f"{content_end - keep} pinned tokens are lost. {advice}."
    )
