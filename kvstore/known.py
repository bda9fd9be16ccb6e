"""What a process knows of its home for `kvstore.reasons.Attributor`, told when it hydrates (off
the request path): this model's learned prefixes and those of its other fingerprints, tombstones
of evictions, whether the daemon that ran on the home is gone. The Attributor itself, which each
request calls, is kvstore.reasons'."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstore import tokens as tk
from kvstore.degrade import library_call
from kvstore.errors import KVStoreError
from kvstore.home.settings import LOCK_NAME
from kvstore.reasons import LEARNED_PREFIXES, LEARNED_TOKENS, Attributor
from kvstore.wire.daemon_client import lock_holder, socket_path

log = logging.getLogger("kvstore.client")


def learned_reader(home: Path, fingerprint: bytes) -> Callable[[], tuple[list[bytes], dict]]:
    """`read_learned` of this home and model, as `Attributor.learned_from` calls it (on a thread
    of its own): a store it cannot read leaves what it knew, logged at DEBUG. Each read decodes
    only the records learned since the last (kvstore.learned.index.LearnedChains, shared with
    the cold tier), and gives the same lists again while nothing changed."""
    from kvstore.learned.index import learned_chains

    view = learned_chains(Path(home), fingerprint)
    last: list = [-1, None]  # the view's version and what was given of it

    def read() -> tuple[list[bytes], dict]:
        got: tuple[list[bytes], dict] | None = None
        with library_call("kvstore: learned prefixes not read", level=logging.DEBUG):
            got = read_learned(home, fingerprint, view, last)
        if got is None:
            raise LookupError("not read")
        return got

    return read


def read_learned(
    home: Path, fingerprint: bytes, view: Any = None, last: list | None = None
) -> tuple[list[bytes], dict[bytes, int]]:
    """This model's learned prefixes in the store of `home`, as `Known.learned` takes them
    (none when there is no store yet). With a `view` (LearnedChains), what changed since its
    last update is read, and `last` ([version, given]) gives the same lists again while the
    view did not change."""
    from kvstore.errors import KVStoreError
    from kvstore.learned.blockstore import BlockStore
    from kvstore.learned.index import LearnedChains
    from kvstore.store.store import Store

    try:
        store = Store(home, readonly=True)
    except (KVStoreError, OSError):
        return [], {}
    view = view if view is not None else LearnedChains(fingerprint)
    with store:
        view.update(BlockStore(store))
    if last is not None and last[0] == view.version and last[1] is not None:
        return last[1]
    keys, ends = [], {}
    for packed, end in view.prefixes(max_tokens=LEARNED_TOKENS, limit=LEARNED_PREFIXES):
        keys.append(packed)
        if tk.count(packed) < end:
            ends[packed] = end
    got = sorted(keys), ends
    if last is not None:
        last[:] = [view.version, got]
    return got


def other_fingerprints(
    home: Path, fingerprint: bytes, model: str, parts: Mapping[str, Any]
) -> list[tuple[tuple[int, ...], str]]:
    """This model path's learned prefixes under another fingerprint, each with what differs
    from the running identity (`model_changed`; entries are hydrate's to tell)."""
    from kvstore.errors import KVStoreError
    from kvstore.learned.blockstore import BlockStore
    from kvstore.reasons import identity_diff
    from kvstore.store.store import Store

    try:
        store = Store(home, readonly=True)
    except (KVStoreError, OSError):
        return []
    out = []
    with store:
        blocks = BlockStore(store)
        wanted = {str(model), str(Path(model).expanduser().resolve())}
        for fp, stored in blocks.fingerprints_of(wanted).items():
            if fp == fingerprint:
                continue
            what = identity_diff(stored, parts) if stored is not None else "fingerprint"
            for packed, _ in blocks.learned_prefixes(fp, max_tokens=LEARNED_TOKENS, limit=64):
                out.append((tuple(tk.unpack(packed)), what))
    return out


PROBES = ("A0", "Z9")  # message contents that differ at their first token
# (the messages before, the role of the message whose header is read): a first message, then
# one after a system prompt, a user turn, and a whole exchange
HEADER_CASES: tuple[tuple[tuple[tuple[str, str], ...], str], ...] = (
    ((), "system"),
    ((), "user"),
    ((("system", "S"),), "user"),
    ((("user", "U"),), "assistant"),
    ((("user", "U"), ("assistant", "R")), "user"),
    ((("system", "S"), ("user", "U")), "assistant"),
)


def template_headers(tokenizer: Any) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The chat template's message headers, as token ids: what it renders before a message's
    content (where two renders that differ only in that content start to differ), from where
    the messages before it end. (Those of a first message, with whatever the template puts
    before it; those of any message.) A template that refuses a case (no system role, say)
    leaves it out; no template, none."""
    first: list[tuple[int, ...]] = []
    later: list[tuple[int, ...]] = []
    if getattr(tokenizer, "chat_template", None) is None:
        return first, later
    for before, role in HEADER_CASES:
        msgs = [{"role": r, "content": c} for r, c in before]
        a, b = (_render(tokenizer, [*msgs, {"role": role, "content": p}]) for p in PROBES)
        start = _render(tokenizer, msgs) if msgs else []
        if a is None or b is None or start is None:
            continue
        at = tk.common_prefix(tk.pack(a), tk.pack(b))
        head = tuple(a[tk.common_prefix(tk.pack(start), tk.pack(a)) : at])
        if head and head not in (first if not msgs else later):
            (first if not msgs else later).append(head)
    return first, later


def _render(tokenizer: Any, messages: list[dict]) -> list[int] | None:
    """The template's token ids of `messages` (as a prompt's history), or None if it refuses."""
    from kvstore.degrade import foreign

    try:
        with foreign(lambda e: KVStoreError(f"{type(e).__name__}: {e}")):
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    except KVStoreError:
        return None
    if isinstance(out, Mapping):
        out = out.get("input_ids")
    return [int(t) for t in out] if isinstance(out, Sequence) else None


def after_hydrate(
    attr: Attributor,
    report: Any,
    home: Path | None,
    model: str | None = None,
    dated: Mapping[tuple[int, ...], str] | None = None,
    parts: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
) -> None:
    """What hydrating told: entries of this path under another fingerprint (`model_changed`),
    tombstones of this model's evicted entries (`evicted`), a daemon that was there but no
    longer answers while nothing is stored (`unavailable`), entries that failed their checks
    (`corrupt`); and this model's learned prefixes are read (`diverged`). The `tokenizer`'s chat
    template tells where messages start (a header shared is not content shared)."""
    if tokenizer is not None:
        with library_call("kvstore: chat template headers not read", level=logging.DEBUG):
            attr.first_headers, attr.headers = template_headers(tokenizer)
    attr.other_model = list(getattr(report, "other_model", None) or [])
    attr.dated = dict(dated or {})
    if home is not None and model:
        from kvstore.home import tombstones

        attr.tombstones.extend(tombstones.load(home, model))
    attr.unavailable = home is not None and not getattr(report, "entries", 0) and daemon_gone(home)
    for tokens, label in getattr(report, "corrupt", None) or ():
        attr.failed_checks(tokens, f"entry {label!r}")
    fp = getattr(report, "fingerprint", "")
    if home is not None and fp:
        attr.learned_from(learned_reader(Path(home), bytes.fromhex(fp)))
        if model and parts is not None and not getattr(report, "entries", 0) and not attr.learned:
            # nothing stored for this identity: learned under another one of this path?
            what = "kvstore: learned prefixes of other fingerprints not read"
            with library_call(what, level=logging.DEBUG):
                attr.other_model += other_fingerprints(home, bytes.fromhex(fp), model, parts)


def daemon_gone(home: Path) -> bool:
    """A daemon ran on this home and is gone: its socket is there but nothing accepts on it
    (killed), or its lock file is there and no process holds it (killed before it made its
    socket, or stopped)."""
    try:
        path = socket_path(home)
    except (KVStoreError, OSError, RuntimeError):  # no socket path; Path.home() without HOME
        return False
    if path.exists():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(str(path))
            except OSError:
                return True
        return False
    return (Path(home) / LOCK_NAME).exists() and lock_holder(home) is None
