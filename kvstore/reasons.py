"""Why a token was prefilled: each request's prefilled tokens, in order along the prompt, get a
reason (the names are a contract: serve's log line, `kvstore_prefilled_tokens_total{reason}`,
the library's report, the ledger and `kvstore explain` use them).

`attribute` runs RULES in order along the prompt, each telling the tokens of its reason(s) as
`Span`s. Pure and cheap: prefixes are compared packed (kvstore.tokens) by slice compares (C
speed, a binary search over the length), so a request against a few dozen candidates costs a
fraction of a millisecond (`python -m bench.reasons` measures it).
"""

from __future__ import annotations

import bisect
import datetime as _dt
import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import cached_property
from typing import Any, TypedDict, cast

from kvstore import tokens as tk


class Reason(str, Enum):
    """Why prefilled tokens were not served (a str: its value is what every output prints). A
    new reason is a member here, a rule in RULES and a row in docs/reasons.md."""

    SUFFIX = "suffix"
    DIVERGED = "diverged"
    MODEL_CHANGED = "model_changed"
    OTHER_DATE = "other_date"
    EVICTED = "evicted"
    NOT_LEARNED_YET = "not_learned_yet"
    WRITE_BUDGET = "write_budget"
    CORRUPT = "corrupt"
    UNAVAILABLE = "unavailable"
    COLD = "cold"

    def __str__(self) -> str:  # "cold", not "Reason.COLD", in f-strings and labels alike
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


REASONS = tuple(r.value for r in Reason)
CONTEXT_CHARS = 40  # decoded text on each side of a divergence
MAX_TEXT = 160  # characters of a span's text a ledger record keeps
MAX_SPANS = 64  # spans a ledger record keeps (more: its reasons are dropped)
# Content tokens (past the template's header) a request must share with a stored or seen prefix
# for that prefix to be why its tokens were prefilled; fewer is an opening word or two ("You ")
SHARED_TOKENS = 4


class _Counted(TypedDict):
    reason: str
    tokens: int


class SpanRecord(_Counted, total=False):
    """A Span as `Span.record()` gives it, in reports, the ledger (its JSON: these keys, in this
    order, those of None left out) and the wire."""

    by: str
    ts: float
    entry: str
    position: int
    stored_length: int
    stored_text: str
    request_text: str
    differs: str


@dataclass
class Span:
    """Adjacent prefilled tokens of one reason, with what that reason names; `record()` is its
    form in reports, the ledger and the wire (fields that are None left out, in this order)."""

    reason: Reason
    tokens: int
    by: str | None = None  # evicted: "kvstore evict", "byte budget", ... (kvstore.ops.evict)
    ts: float | None = None  # evicted: when
    entry: str | None = None  # the stored prefix it names (a pin's label, a learned chain, ...)
    position: int | None = None  # diverged, other_date: the first prompt token that differs
    stored_length: int | None = None  # diverged: the stored prefix's length
    stored_text: str | None = None  # diverged: decoded text around the position, stored ...
    request_text: str | None = None  # ... and the request's
    differs: str | None = None  # model_changed: what differs (identity_diff)

    def details(self) -> dict[str, Any]:
        return {k: v for k in _DETAILS if (v := getattr(self, k)) is not None}

    def record(self) -> SpanRecord:
        return cast(
            SpanRecord, {"reason": self.reason.value, "tokens": self.tokens, **self.details()}
        )


_DETAILS = tuple(f.name for f in fields(Span))[2:]


def tombstone_digest(prompt: Sequence[int] | bytes) -> str:
    """A tombstone's hash of a prefix (its tokens or packed bytes): blake2b-64 of its ids as
    big-endian uint32, the layout the home's tombstones were first written with."""
    packed = prompt if isinstance(prompt, bytes) else tk.pack(prompt)
    return hashlib.blake2b(tk.swapped(packed), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Tombstone:
    """A recent eviction: which prefix (its length and hash), by what, when."""

    length: int
    digest: str
    by: str  # "byte budget", "kvstore evict", ... (kvstore.ops.evict)
    ts: float
    entry: str = ""
    tail: bytes = b""  # its last TAIL_TOKENS tokens, packed: most misses end at them

    @classmethod
    def of(cls, tokens: Sequence[int], by: str, ts: float, entry: str = "") -> Tombstone:
        key = tk.pack(tokens)
        return cls(len(tokens), tombstone_digest(key), by, ts, entry, tail_of(key))

    def covers(self, prompt: Sequence[int] | bytes) -> bool:
        """Whether the prompt (its tokens, or packed) starts with this prefix."""
        key = prompt if isinstance(prompt, bytes) else tk.pack(prompt)
        n = tk.nbytes(self.length)
        if len(key) < n or (self.tail and key[n - len(self.tail) : n] != self.tail):
            return False
        return tombstone_digest(key[:n]) == self.digest


TAIL_TOKENS = 2


def tail_of(key: bytes) -> bytes:
    """The last TAIL_TOKENS tokens of packed tokens (a tombstone's cheap first check)."""
    return tk.cut(key, -TAIL_TOKENS) if key else b""


@dataclass
class Known:
    """What this process knows when a request comes (any part may be empty). Prefixes given as
    bytes are packed token ids (kvstore.tokens)."""

    pins: Mapping[tuple[int, ...], str] = field(default_factory=dict)  # stored, this model
    # the same pins as (packed, label), when the caller keeps them packed (taken over `pins`)
    pin_keys: Sequence[tuple[bytes, str]] = ()
    # learned prefixes stored for this model, packed, sorted (bisect); one holds at most a cap
    # of tokens: `learned_ends` gives the stored length of those it cuts
    learned: Sequence[bytes] = ()
    learned_ends: Mapping[bytes, int] = field(default_factory=dict)
    other_day: Sequence[tuple[Sequence[int], str]] = ()  # clock-bound pins of another day
    other_model: Sequence[tuple[Sequence[int], str]] = ()  # (tokens, what differs)
    model_changed: str = ""  # this path stored under another fingerprint: what differs
    tombstones: Sequence[Tombstone] = ()
    seen: Sequence[bytes] = ()  # recent prompts of this model, packed, sorted (bisect)
    corrupt: Sequence[tuple[Sequence[int], str]] = ()  # failed their checks
    unavailable: bool = False  # the store cannot be read / the daemon is down, nothing stored
    write_budget: bool = False  # learning paused by the daily write budget
    # the chat template's message headers (what it renders before a message's content): those
    # of a conversation's first message (with whatever the template puts before it), and those
    # of any message (kvstore.known.template_headers)
    first_headers: Sequence[tuple[int, ...]] = ()
    headers: Sequence[tuple[int, ...]] = ()


@dataclass
class _Walk:
    """One attribution under way: the spans told so far, up to `pos` along the prompt."""

    prompt: Sequence[int]
    served: int
    known: Known
    decode: Callable[[Sequence[int]], str] | None
    key: bytes  # the prompt, packed
    spans: list[Span] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.n = len(self.prompt)
        self.pos = max(0, min(self.served, self.n))  # told up to here
        # the rules tell up to the last token: every request prefills that one (`attribute`)
        self.limit = max(self.pos, self.n - 1)

    def agree(self, tokens: Sequence[int] | bytes) -> int:
        """Tokens the prompt shares with these (token ids or packed)."""
        return tk.common_prefix(self.key, tokens if type(tokens) is bytes else tk.pack(tokens))

    def take(self, end: int, reason: Reason, **details: Any) -> None:
        """The prompt's tokens from `pos` to `end` are `reason`'s (none when `end` <= `pos`)."""
        end = min(end, self.limit)
        if end <= self.pos:
            return
        last = self.spans[-1] if self.spans else None
        if last is not None and last.reason is reason and not details and not last.details():
            last.tokens += end - self.pos
        else:
            self.spans.append(Span(reason, end - self.pos, **details))
        self.pos = end

    @cached_property
    def content_start(self) -> int:
        """Where the content of the request's first message starts: past the template's header
        (and whatever it renders before it) when the request starts with one it knows, else 0."""
        p = self.prompt
        return max((len(h) for h in self.known.first_headers if _at(p, 0, h)), default=0)

    def only_header(self, at: int) -> bool:
        """An agreement of `at` tokens holds nothing of the request's content: only what the
        template renders before its first message's content."""
        return at <= self.content_start

    def shares_content(self, at: int) -> bool:
        """An agreement of `at` tokens holds a meaningful part of the request's content: at least
        SHARED_TOKENS tokens past the template's header (an opening word or two is not)."""
        return at - self.content_start >= SHARED_TOKENS

    def at_turn(self, at: int) -> bool:
        """Token `at` is where a message of the request starts: inside or at the end of a
        template header the request holds around it (a new turn, not a change inside one)."""
        p = self.prompt
        return any(
            _at(p, at - k, h)
            for h in (*self.known.first_headers, *self.known.headers)
            for k in range(1, len(h) + 1)
            if at - k >= 0
        )

    @cached_property
    def learned(self) -> tuple[int, bytes | None, int]:
        """`_learned_divergence` of the prompt against this model's learned prefixes."""
        k = self.known
        return _learned_divergence(self.key, k.learned, k.learned_ends)


def _at(prompt: Sequence[int], start: int, header: tuple[int, ...]) -> bool:
    """The prompt holds `header` from `start`."""
    end = start + len(header)
    return end <= len(prompt) and tuple(prompt[start:end]) == header


def _corrupt(w: _Walk) -> None:
    """A stored prefix the request holds whole that could not serve it: its tokens are lost to
    that (and a divergence before its end is not why: the request is the other prefix's)."""
    for tokens, what in w.known.corrupt:
        if w.agree(tokens) == len(tokens):
            w.take(len(tokens), Reason.CORRUPT, entry=what)


def _evicted(w: _Walk) -> None:
    """The longest evicted prefixes the request starts with (each length hashed once)."""
    hashed: dict[int, str] = {}
    n, key, size = w.n, w.key, tk.SIZE
    for t in sorted(w.known.tombstones, key=lambda t: -t.length):
        if w.pos < t.length <= n:
            end = size * t.length
            if t.tail and key[end - len(t.tail) : end] != t.tail:
                continue
            if t.length not in hashed:
                hashed[t.length] = tombstone_digest(key[:end])
            if hashed[t.length] == t.digest:
                w.take(t.length, Reason.EVICTED, by=t.by, ts=t.ts, entry=t.entry)


def _diverged(w: _Walk) -> None:
    """What a stored prefix of this model would have served, had the request not differed: of
    those the request leaves before their end, the one reaching furthest. Not a prefix it
    shares no meaningful part of the content with (`_Walk.shares_content`: only the template's
    header, or an opening word; its own content is not stored: `cold`), nor a learned chain it
    leaves where a message starts (a new turn: not learned yet)."""
    k = w.known
    candidates: list[tuple[Sequence[int] | bytes, str, int]] = (
        [(key, name, tk.count(key)) for key, name in k.pin_keys]
        if k.pin_keys
        else [(t, name, len(t)) for t, name in k.pins.items()]
    )
    _, stored, length = w.learned
    if stored is not None:
        at = w.agree(stored)
        if w.at_turn(at):  # a new turn after what the chain holds of this conversation
            if not w.only_header(at):
                k = w.known
                w.take(at, Reason.WRITE_BUDGET if k.write_budget else Reason.NOT_LEARNED_YET)
        else:
            candidates.append((stored, f"learned chain of {length} tokens", length))
    # end, at, entry, its tokens (or packed, as far as known), its stored length
    best: tuple[int, int, str, Sequence[int] | bytes, int] | None = None
    for tokens, name, length in candidates:
        at = w.agree(tokens)
        if at >= length or not w.shares_content(at):
            continue  # all of it agrees (served, or not for a reason below), or hardly any
        end = min(length, w.n)
        if at >= w.pos and end > w.pos and (best is None or end > best[0]):
            best = (end, at, name, tokens, length)
    if best is None:
        return
    end, at, name, tokens, length = best
    texts_: dict[str, str] = {}
    if w.decode is not None:
        stored_tokens = tk.unpack(tokens) if isinstance(tokens, bytes) else tokens
        texts_["stored_text"], texts_["request_text"] = texts(stored_tokens, w.prompt, at,
                                                              w.decode)  # fmt: skip
    w.take(end, Reason.DIVERGED, entry=name, position=at, stored_length=length, **texts_)


def _unavailable(w: _Walk) -> None:
    """Only when nothing could be read: a store read that tells anything (an entry or learned
    prefix of this path under any fingerprint, a tombstone, a corrupt record) says it instead."""
    k = w.known
    if k.unavailable and not _stored(k):
        w.take(w.n, Reason.UNAVAILABLE)


def _stored(k: Known) -> bool:
    """Whether anything stored is known (seen prompts apart: they are this process's)."""
    return bool(k.pins or k.pin_keys or k.learned or k.other_day or k.other_model
                or k.model_changed or k.tombstones or k.corrupt)  # fmt: skip


def _model_changed(w: _Walk) -> None:
    for tokens, what in w.known.other_model:
        if w.shares_content(at := w.agree(tokens)):
            w.take(at, Reason.MODEL_CHANGED, differs=what)
    if w.known.model_changed:
        w.take(w.n, Reason.MODEL_CHANGED, differs=w.known.model_changed)


def _other_date(w: _Walk) -> None:
    for tokens, name in w.known.other_day:
        at = w.agree(tokens)
        if at < len(tokens):  # what it holds past `at` is another day's
            w.take(min(len(tokens), w.n), Reason.OTHER_DATE, entry=name, position=at)


def _learned_whole(w: _Walk) -> None:
    """Stored as a learned prefix, whole: learned, whatever else it is."""
    w.take(w.learned[0], Reason.SUFFIX)


def _seen(w: _Walk) -> None:
    """A prefix of a recent prompt: the one sharing the most sits next to it in sorted order."""
    seen = w.known.seen
    i = bisect.bisect_left(seen, w.key)
    at = max((tk.common_prefix(w.key, s) for s in seen[max(0, i - 1) : i + 1]), default=0)
    if not w.shares_content(at):
        return  # another request of this template: nothing meaningful of this one's content seen
    w.take(at, Reason.WRITE_BUDGET if w.known.write_budget else Reason.NOT_LEARNED_YET)


def _rest(w: _Walk) -> None:
    """`cold` while nothing of the request's content was stored or seen (what was served, if
    anything, is the template's header or an opening word), else the request's own content:
    `suffix`."""
    cold = not w.spans and not w.shares_content(w.served)
    w.take(w.n, Reason.COLD if cold else Reason.SUFFIX)


# In order along the prompt, each from where the last one stopped: what a stored prefix the
# request holds whole tells (corrupt, evicted) comes before a divergence inside it.
RULES: tuple[Callable[[_Walk], None], ...] = (
    _corrupt, _evicted, _diverged, _unavailable, _model_changed, _other_date, _learned_whole,
    _seen, _rest,
)  # fmt: skip


def attribute(
    prompt: Sequence[int],
    served: int,
    known: Known,
    decode: Callable[[Sequence[int]], str] | None = None,
    *,
    key: bytes | None = None,
) -> list[SpanRecord]:
    """The prompt's prefilled tokens (`prompt[served:]`), in order, as reason spans (their
    records: [{"reason", "tokens", ...}]), adjacent spans of one reason merged; their tokens
    sum to `len(prompt) - served`. `key`: the prompt packed, when the caller has it."""
    w = _Walk(prompt, served, known, decode, packed(prompt) if key is None else key)
    for rule in RULES:
        rule(w)
    w.limit = w.n  # the last token: every request prefills it, stored or not (its logits give
    w.take(w.n, Reason.SUFFIX)  # the first output token): always `suffix`
    return [s.record() for s in w.spans]


IMAGE_IDS = 2**31  # images' ids in a packed prompt start here: past every vocabulary


def packed(prompt: Sequence[int]) -> bytes:
    """The prompt packed (kvstore.tokens) for comparing with others. A prompt with images as
    mlx_lm.server keys it (each image's patch tokens a negative id of that image) packs each
    image as an id past every vocabulary (IMAGE_IDS and 31 bits of its own): another image
    differs there, a resent one does not. Compared only, never stored."""
    try:
        return tk.pack(prompt)
    except ValueError:
        low = IMAGE_IDS - 1
        return tk.pack([t if 0 <= t < IMAGE_IDS else IMAGE_IDS | (t & low) for t in prompt])


def _text_only(decode: Callable[[Sequence[int]], str]) -> Callable[[Sequence[int]], str]:
    """`decode` of text ids only: an image's patches (negative ids) have no text, and a
    tokenizer given one may raise anything."""
    return lambda tokens: decode([t for t in tokens if t >= 0])


LEARNED_TIES = 64  # learned prefixes looked at on each side of the request's place in order


def _learned_divergence(
    key: bytes, learned: Sequence[bytes], ends: Mapping[bytes, int]
) -> tuple[int, bytes | None, int]:
    """(how far a learned prefix the request holds whole reaches, the learned prefix the
    request leaves inside before its end: packed as far as kept or None, its stored
    length). The prefixes sharing the most with the request sit next
    to it in sorted order; a learned prefix that ends right where the request leaves is where
    the requests that taught it differed too (a branch: the request's own content, `suffix`),
    and of the rest the shortest is the one whose tokens the difference cost."""
    if not learned:
        return 0, None, 0
    i = bisect.bisect_left(learned, key)
    at = max(tk.common_prefix(key, learned[j]) for j in (i - 1, i) if 0 <= j < len(learned))
    if at == 0:
        return 0, None, 0
    head = tk.cut(key, 0, at)
    tied: list[bytes] = []
    for step, j in ((-1, i - 1), (1, i)):
        while (
            0 <= j < len(learned)
            and len(tied) < 2 * LEARNED_TIES
            and tk.cut(learned[j], 0, at) == head
        ):
            tied.append(learned[j])
            j += step
    if any(ends.get(s, tk.count(s)) <= at or tk.count(s) <= at for s in tied):
        return at, None, 0  # it ends here, or agrees as far as it is kept
    length = min(ends.get(s, tk.count(s)) for s in tied)
    shortest = [s for s in tied if ends.get(s, tk.count(s)) == length]
    if len(shortest) > 1:  # the nearest below the request in token order, else above
        order, mine = tk.swapped, tk.swapped(key)  # big-endian bytes sort as their tokens do
        below = [s for s in shortest if order(s) < mine]
        shortest = [max(below, key=order) if below else min(shortest, key=order)]
    # the request holds the learned prefixes before the one it leaves (a shorter one at least)
    return 0, shortest[0], length


def texts(
    stored: Sequence[int], prompt: Sequence[int], at: int, decode: Callable[[Sequence[int]], str]
) -> tuple[str, str]:
    """Decoded text around token `at` of the stored prefix and of the request: the common part
    before it (its last CONTEXT_CHARS characters), then each one's own next characters."""
    lo = max(0, at - CONTEXT_CHARS)  # a token is at least one character (mostly)
    before = _safe(decode, prompt[lo:at])[-CONTEXT_CHARS:]
    s = _safe(decode, stored[at : at + CONTEXT_CHARS])[:CONTEXT_CHARS]
    r = _safe(decode, prompt[at : at + CONTEXT_CHARS])[:CONTEXT_CHARS]
    return before + s, before + r


def _safe(decode: Callable[[Sequence[int]], str], tokens: Sequence[int]) -> str:
    try:
        return str(decode(list(tokens)))
    except (ValueError, TypeError, IndexError, KeyError, OverflowError):  # ids it does not know
        return ""


def by_reason(spans: Iterable[SpanRecord]) -> dict[str, int]:
    """Tokens by reason, from span records."""
    out: dict[str, int] = {}
    for s in spans:
        out[s["reason"]] = out.get(s["reason"], 0) + int(s["tokens"])
    return out


def describe(spans: Sequence[SpanRecord]) -> str:
    """Span records for a log line: "suffix 12, diverged 300 (entry 'sys' at 14)"."""
    parts = []
    for s in spans:
        p = f"{s['reason']} {s['tokens']}"
        if s["reason"] == Reason.DIVERGED:
            p += f" ({s.get('entry')!s} at {s.get('position')})"
        elif s.get("by"):
            p += f" (by {s['by']})"
        elif s.get("differs"):
            p += f" ({s['differs']})"
        elif s["reason"] == Reason.CORRUPT and s.get("entry"):
            p += f" ({s['entry']})"
        parts.append(p)
    return ", ".join(parts)


def clean(spans: Any) -> list[SpanRecord] | None:
    """A ledger record's reasons as a client sent them, or None when they are not well-formed."""
    if not isinstance(spans, list) or len(spans) > MAX_SPANS:
        return None
    out = []
    for s in spans:
        if not isinstance(s, dict) or s.get("reason") not in REASONS:
            return None
        t = s.get("tokens")
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            return None
        keep: dict[str, Any] = {}
        for k, v in s.items():
            if isinstance(k, str) and isinstance(v, str):
                keep[k] = v[:MAX_TEXT]
            elif isinstance(k, str) and isinstance(v, (int, float)):
                keep[k] = v
        out.append(cast(SpanRecord, keep))  # a newer client's keys kept, as sent
    return out


def identity_diff(stored: Mapping[str, Any], running: Mapping[str, Any]) -> str:
    """What differs between a stored identity state and the running one, in words."""
    names = {
        "weights": "weights", "config": "effective config", "adapter": "adapter",
        "kv_bits": "KV quantization", "kv_group_size": "KV quantization",
        "quantized_kv_start": "KV quantization", "kv_quantization": "KV quantization",
        "mlx_lm": "mlx-lm code", "codec": "codec version",
    }  # fmt: skip
    found: list[str] = []
    for key in sorted(set(stored) | set(running)):
        if stored.get(key) != running.get(key):
            word = next((w for k, w in names.items() if k in key), key)
            if word not in found:
                found.append(word)
    if "KV quantization" in found and "mlx-lm code" in found:
        found.remove("mlx-lm code")  # the hashed code follows kv_bits: not told apart then
    return ", ".join(found) or "fingerprint"


# -- one process's attribution, request after request ----------------------------------------
RECENT_PROMPTS = 64
RECENT_TOKENS = 16384  # of each: a longer shared prefix than this reads as suffix past it
TOMBSTONES = 256
CORRUPT = 64  # prefixes whose entry or learned record failed its checks, remembered
LEARNED_PREFIXES = 512  # this model's learned prefixes kept (most recently used)
LEARNED_TOKENS = 4096  # of each: a divergence past this is not told
DECODED = 256  # token windows whose decoded text is kept (a divergence's texts)
LEARNED_REFRESH_S = 10.0  # seconds between re-reads of them (on a thread of their own)


class Attributor:
    """What one client process knows between its requests, and `attribute` of each request
    against it: the prompts it saw recently (a prefix seen but not stored is `not_learned_yet`),
    tombstones of evictions it was told of, this model's learned prefixes (read by the caller's
    `learned_from` reader, off the request path), whether the store could be read. Called on the
    request path: its state is behind one lock, and nothing here does I/O."""

    def __init__(self) -> None:
        self.recent: deque[bytes] = deque()  # packed, in arrival order, to drop the oldest
        self.sorted: list[bytes] = []  # the same, sorted (kvstore.reasons bisects)
        self.tombstones: deque[Tombstone] = deque(maxlen=TOMBSTONES)
        self.unavailable = False
        self.model_changed = ""
        self.other_model: list[tuple[tuple[int, ...], str]] = []  # (tokens, what differs)
        self.dated: dict[tuple[int, ...], str] = {}  # clock-bound stored pins: tokens -> ISO day
        self.write_budget = False
        # the chat template's message headers (Known.first_headers, Known.headers)
        self.first_headers: list[tuple[int, ...]] = []
        self.headers: list[tuple[int, ...]] = []
        self.learner: Any = None  # its `paused` (the daemon's last word) says the write budget
        self.corrupt: deque[tuple[tuple[int, ...], str]] = deque(maxlen=CORRUPT)
        self.learned: list[bytes] = []  # this model's learned prefixes, packed, sorted
        self.learned_ends: dict[bytes, int] = {}  # of those cut at LEARNED_TOKENS: their length
        self._read: Callable[[], tuple[list[bytes], dict[bytes, int]]] | None = None
        self._learned_at = 0.0
        self._refreshing = False
        # the pins last given, by identity, and their (packed, label): pins change rarely
        self._pins_seen: list[tuple[int, ...]] = []
        self._pin_keys: list[tuple[bytes, str]] = []
        self._decode: Any = None  # the decode last given, and texts it gave (kvstore.reasons)
        self._texts: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._lock = threading.Lock()

    def evicted(self, tokens: Sequence[int], by: str, ts: float, entry: str = "") -> None:
        with self._lock:
            self.tombstones.append(Tombstone.of(tokens, by, ts, entry))

    def _decoder(self, decode: Callable[[Sequence[int]], str]) -> Callable[[Sequence[int]], str]:
        """`decode`, remembering the texts of recent token windows: a divergence repeats (the
        same date all day), and decoding costs more than the rest of the attribution."""
        if self._decode is not decode:
            self._decode, self._texts = decode, OrderedDict()
        texts = self._texts

        def cached(tokens: Sequence[int]) -> str:
            t = tuple(tokens)
            text = texts.get(t)
            if text is None:
                text = texts[t] = decode(list(t))
                if len(texts) > DECODED:
                    texts.popitem(last=False)
            return text

        return cached

    def _keys_of(self, pins: Mapping[tuple[int, ...], str]) -> list[tuple[bytes, str]]:
        """The pins as (packed, label), kept while the same token tuples come (an identity
        check each: hashing a long tuple costs more than the attribution)."""
        seen = self._pins_seen
        if len(seen) != len(pins) or any(a is not b for a, b in zip(seen, pins, strict=False)):
            self._pins_seen = list(pins)
            self._pin_keys = [(tk.pack(t), str(name)) for t, name in pins.items()]
        return self._pin_keys

    def failed_checks(self, tokens: Sequence[int], what: str) -> None:
        """A stored entry or learned record of this prefix failed its checks (`corrupt`)."""
        with self._lock:
            self.corrupt.append((tuple(tokens), what))

    def learned_from(self, read: Callable[[], tuple[list[bytes], dict[bytes, int]]]) -> None:
        """Read this model's learned prefixes with `read` (the caller's I/O: sorted packed
        prefixes and the stored lengths of those cut at LEARNED_TOKENS) now, and again every
        LEARNED_REFRESH_S on a thread of its own, off the request path. A read that raises
        LookupError leaves what was known."""
        self._read = read
        self._read_learned()

    def _read_learned(self) -> None:
        try:
            if self._read is None:
                return
            try:
                keys, ends = self._read()
            except LookupError:
                return
            with self._lock:
                self.learned, self.learned_ends = keys, ends
        finally:
            self._learned_at = time.monotonic()
            self._refreshing = False

    def _refresh_learned(self) -> None:
        if self._read is None or self._refreshing:
            return
        if time.monotonic() - self._learned_at < LEARNED_REFRESH_S:
            return
        self._refreshing = True
        threading.Thread(target=self._read_learned, name="kvstore-learned-prefixes",
                         daemon=True).start()  # fmt: skip

    def __call__(
        self,
        prompt: Sequence[int],
        served: int,
        pins: Mapping[tuple[int, ...], str],
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> list[SpanRecord]:
        key = packed(prompt)  # a prompt with images too, as mlx_lm.server keys it
        if decode is not None:
            decode = _text_only(self._decoder(decode))
        other_day: list[tuple[tuple[int, ...], str]] = []
        if self.dated:  # a clock-bound pin of another day: other_date, not diverged
            today = _dt.date.today().isoformat()  # the local day, as a pin's date is
            stale = {t for t in pins if self.dated.get(t, today) != today}
            if stale:
                other_day = [(t, f"{pins[t]} ({self.dated[t]})") for t in stale]
                pins = {t: v for t, v in pins.items() if t not in stale}
        with self._lock:
            known = Known(
                pins=pins,
                pin_keys=self._keys_of(pins),
                other_day=other_day,
                seen=self.sorted,
                tombstones=list(self.tombstones),
                unavailable=self.unavailable,  # told only when nothing stored is known
                model_changed=self.model_changed,
                other_model=self.other_model,
                write_budget=self.write_budget or _learner_write_budget(self.learner),
                learned=self.learned,
                learned_ends=self.learned_ends,
                corrupt=[*self.corrupt, *_learner_corrupt(self.learner)],
                first_headers=self.first_headers,
                headers=self.headers,
            )
            spans = attribute(prompt, served, known, decode, key=key)
            t = tk.cut(key, 0, RECENT_TOKENS)  # 64 prompts stay small
            self.recent.append(t)
            bisect.insort(self.sorted, t)
            if len(self.recent) > RECENT_PROMPTS:
                old = self.recent.popleft()
                del self.sorted[bisect.bisect_left(self.sorted, old)]
        self._refresh_learned()
        return spans


def _learner_write_budget(learner: Any) -> bool:
    return getattr(learner, "paused_by", None) == "write_budget"


def _learner_corrupt(learner: Any) -> list[tuple[tuple[int, ...], str]]:
    """The prefixes the learner's cold tier found a corrupt record or entry in."""
    cold = getattr(learner, "cold", None)
    return list(getattr(cold, "corrupt", None) or ())
