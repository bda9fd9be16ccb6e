"""`kvstore serve --persist-system-prompts`: new system-prompt caches the server inserts are
sent to the daemon (kvstore.client.serve.hooks offers them), so later starts hydrate them, each
cut where every request of its system messages shares it (kvstore's stable-boundary rule, not
mlx_lm.server's); and a word when the server's template arguments are not the ones the stored
pins were made with."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvstore.client.writebehind import Job, WriteBehind
from kvstore.degrade import serve_hook
from kvstore.errors import KVStoreError
from kvstore.learned.coldtier import LearnTarget, fingerprint_parts

log = logging.getLogger("kvstore.serve")

PERSIST_QUEUE = 8  # system prefixes waiting to be sent; more are dropped (never block a request)
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
    """Re-cuts the system segment of `ResponseGenerator._tokenize`'s result at kvstore's pin.

    mlx_lm.server cuts its "system" segment where the prompt leaves the rendering of the system
    messages followed by an empty user turn, at the request's own clock. That boundary is not one
    every request shares: a template that prints the date, or takes another branch for an empty
    user turn, moves it. The segment is re-cut at the pin kvstore's rule gives for the request's
    system messages, tools and template arguments (kvstore.pins.render, cached per distinct system
    block and day), so what is persisted is what later requests start with.

    `cuts` keeps, per mlx-lm system segment (the rendering of the system block it starts), the
    length of kvstore's pin of that block (0: none): the hooks read it to skip the re-cut of a
    request a pin serves past both (nothing of its system segment is prefilled, inserted or
    persisted, cut or not)."""

    def __init__(self) -> None:
        self._pins: OrderedDict[str, Any] = OrderedDict()  # key -> RenderedPin or None
        self.by_tokens: OrderedDict[tuple[int, ...], Any] = OrderedDict()  # persisted pin info
        self.cuts: OrderedDict[tuple[int, ...], int] = OrderedDict()  # mlx-lm's segment -> cut

    def pin_for(self, tokenizer: Any, messages: list, tools: Any, kwargs: dict) -> Any:
        from kvstore.pins.manifest import PrefixSpec
        from kvstore.pins.render import render_prefix

        now = _dt.datetime.now()  # the real local wall clock, as `strftime_now` prints it
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
        self.cuts[tuple(segments[0])] = len(pin.tokens) if pin is not None else 0
        while len(self.cuts) > PIN_CACHE:
            self.cuts.popitem(last=False)
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


class SystemPromptPersister:
    """Sends new system-prompt caches to the daemon through the client's write-behind queue.

    The request path only evaluates and enqueues; encoding and the socket happen on its worker.
    With no daemon, one warning, then prefixes are dropped and serving goes on.
    """

    def __init__(
        self,
        home: Path,
        writer: WriteBehind | None = None,
        boundary: StableSystemSegment | None = None,
    ):
        self.home = home
        self.writer = writer if writer is not None else WriteBehind(home, maxsize=PERSIST_QUEUE)
        self.boundary = boundary  # what a persisted system segment's entry records of its cut
        self.targets: dict[Any, LearnTarget] = {}  # model_key -> what a persisted entry needs
        self.seen: set[tuple] = set()
        self.sent = 0

    def on_insert(
        self, model_key: Any, tokens: Sequence[int], cache: list, cache_type: str
    ) -> bool:
        """The store tier's offer of a request's insert (its `on_insert`): a served model's system
        segment goes to the daemon. Whether it was sent (its later uses are hits)."""
        target = self.targets.get(model_key)
        if cache_type != "system" or target is None:
            return False
        if (target.fingerprint, tuple(tokens)) in self.seen:
            return True
        with serve_hook("kvstore: not persisting a system prefix"):  # never fail the insert
            extra = self.boundary.extra_for(tokens) if self.boundary is not None else {}
            self.offer(target, tokens, cache, extra)
            return True
        return False

    def offer(
        self, target: LearnTarget, tokens: Sequence[int], cache: list, extra: dict | None = None
    ) -> None:
        ident = (target.fingerprint, tuple(tokens))
        if ident in self.seen:
            return
        self.seen.add(ident)
        import mlx.core as mx

        # Evaluate on the generation thread (its stream); the worker only reads finished arrays.
        mx.eval([c.state for c in cache])
        tokens = list(tokens)
        job = Job(
            f"system prefix ({len(tokens)} tokens)",
            lambda client: self._send(client, target, tokens, cache, extra or {}),
        )
        if not self.writer.submit(job):
            self.seen.discard(ident)  # offered again the next time the server inserts it

    def _send(
        self, client: Any, target: LearnTarget, tokens: list[int], cache: list, extra: dict
    ) -> None:
        from kvstore.client.writebehind import store_entry
        from kvstore.store.entry import entry_key, pack_tokens
        from kvstore.store.store import Store

        key = entry_key(target.fingerprint, tokens)
        with contextlib.suppress(KVStoreError), Store(self.home, readonly=True) as store:
            meta = store.get_meta(key)
            if meta is not None and meta.tokens == pack_tokens(tokens):
                return  # hydrated or persisted before
        identity = target.identity
        if identity is None:
            raise ValueError("a system prefix needs the served model's identity")
        store_entry(
            client,
            target.fingerprint,
            tokens,
            cache,
            model=identity.path,
            template_hash=target.template_hash,
            label="system",
            pinned=False,
            state=identity.state,
            source="serve",
            extra={**extra, **fingerprint_parts(target.extra)},
        )
        self.sent += 1
        log.info("kvstore: persisted a %d-token system prefix of %s", len(tokens), identity.path)
