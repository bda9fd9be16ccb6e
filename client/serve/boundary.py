"""`kvstore serve`: kvstore's stable-boundary rule for the system segment mlx_lm.server persists,
and a word when the server's template arguments are not the ones the stored pins were made with.

mlx_lm.server cuts its "system" segment where the prompt leaves the rendering of the system
messages followed by an empty user turn, at the request's own clock. That boundary is not one
every request shares: a template that prints the date, or takes another branch for an empty user
turn, moves it. With --persist-system-prompts the segment is re-cut at the pin kvstore's rule gives
for the request's system messages, tools and template arguments (kvstore.pins.render, cached per
distinct system block and day), so what is persisted is what later requests start with.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.serve")

PIN_CACHE = 64  # distinct system blocks whose pin is kept (rendering one takes a few ms)


def template_args_warning(metas: Iterable[Any], server_args: dict | None) -> str | None:
    """A warning naming the stored chat pins rendered with other template arguments than the
    server's --chat-template-args (their tokens will not start its requests), or None."""
    server = dict(server_args or {})
    differ: dict[str, dict] = {}
    for m in metas:
        stored = m.chat_template_kwargs
        if isinstance(stored, dict) and stored != server:
            differ.setdefault(m.label, stored)
    if not differ:
        return None
    names = ", ".join(
        f"{label!r} ({json.dumps(kw, sort_keys=True)})" for label, kw in differ.items()
    )
    return (
        f"kvstore: stored pins rendered with other chat template arguments than this server's "
        f"--chat-template-args {json.dumps(server, sort_keys=True)}: {names}; requests will not "
        f"start with their tokens. Set chat_template_kwargs in the manifest to the server's, or "
        f"pass the same --chat-template-args"
    )


class StableSystemSegment:
    """Re-cuts the system segment of `ResponseGenerator._tokenize`'s result at kvstore's pin."""

    def __init__(self) -> None:
        self._pins: OrderedDict[str, Any] = OrderedDict()  # key -> RenderedPin or None
        self.by_tokens: OrderedDict[tuple[int, ...], Any] = OrderedDict()  # persisted pin info

    def pin_for(self, tokenizer: Any, messages: list, tools: Any, kwargs: dict) -> Any:
        from kvstore.pins.clock import local_now
        from kvstore.pins.manifest import PrefixSpec
        from kvstore.pins.render import render_prefix

        now = local_now()
        key = json.dumps([messages, tools, kwargs, now.date().isoformat()], default=str)
        if key in self._pins:
            self._pins.move_to_end(key)
            return self._pins[key]
        spec = PrefixSpec(
            "system",
            tuple(dict(m) for m in messages),
            None,
            None,
            None,
            tuple(dict(t) for t in tools) if tools else None,
            dict(kwargs) or None,
        )
        try:
            pin = render_prefix(tokenizer, spec, now=now)
        except KVStoreError as e:
            log.info("kvstore: keeping mlx-lm's system segment: %s", e)
            pin = None
        self._pins[key] = pin
        while len(self._pins) > PIN_CACHE:
            self._pins.popitem(last=False)
        return pin

    def resegment(self, tokenizer: Any, request: Any, args: Any, cli_args: Any, out: tuple):
        prompt, segments, types, *rest = out
        if not types or types[0] != "system" or getattr(request, "request_type", "") != "chat":
            return out
        messages = list(request.messages)
        n = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
        kwargs = dict(getattr(cli_args, "chat_template_args", None) or {})
        kwargs.update(getattr(args, "chat_template_kwargs", None) or {})
        pin = self.pin_for(tokenizer, messages[:n], request.tools, kwargs)
        if pin is None:
            return out
        k = len(pin.tokens)
        tail = list(segments[-1]) if types[-1] == "assistant" and len(types) > 1 else []
        tail_start = len(prompt) - len(tail)
        if not 0 < k < tail_start or list(prompt[:k]) != list(pin.tokens):
            return out  # not a prefix of this request (a later turn of Mistral Nemo): as mlx-lm
        self.by_tokens[tuple(pin.tokens)] = (pin, kwargs)
        while len(self.by_tokens) > PIN_CACHE:
            self.by_tokens.popitem(last=False)
        new = [list(prompt[:k]), list(prompt[k:tail_start])] + ([tail] if tail else [])
        new_types = ["system", "user"] + (["assistant"] if tail else [])
        return (prompt, new, new_types, *rest)

    def extra_for(self, tokens: Iterable[int]) -> dict:
        """Meta extra for a persisted system segment: its template arguments and valid date."""
        from kvstore.pins.render import pin_extra

        found = self.by_tokens.get(tuple(tokens))
        return {} if found is None else pin_extra(found[0], found[1])
