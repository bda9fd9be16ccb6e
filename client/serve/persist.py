"""`kvstore serve --persist-system-prompts`: new system-prompt caches the server inserts are
sent to the daemon (kvstore.client.serve.hooks offers them), so later starts hydrate them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.client.serve.boundary import StableSystemSegment
from kvstore.client.writebehind import Job, WriteBehind
from kvstore.degrade import serve_hook
from kvstore.errors import KVStoreError
from kvstore.learned.coldtier import LearnTarget, fingerprint_parts

log = logging.getLogger("kvstore.serve")

PERSIST_QUEUE = 8  # system prefixes waiting to be sent; more are dropped (never block a request)


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
