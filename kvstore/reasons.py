"""Why a token was prefilled: each request's prefilled tokens, in order along the prompt, get a
reason (the names are a contract: serve's log line, `kvstore_prefilled_tokens_total{reason}`,
the library's report, the ledger and `kvstore explain` use them).

Pure and cheap: prefix comparisons are slice compares (C speed, a binary search over the
length), so attributing a request against a few dozen candidates stays far under 0.1 ms.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REASONS = ("suffix", "diverged", "model_changed", "other_date", "evicted", "not_learned_yet",
           "write_budget", "corrupt", "unavailable", "cold")  # fmt: skip
CONTEXT_CHARS = 40  # decoded text on each side of a divergence


def common_prefix(a: Sequence[int] | bytes, b: Sequence[int] | bytes) -> int:
    """Length of the longest common prefix of two token sequences, or of two byte strings
    (binary search on slices: compares at C speed)."""
    if not (isinstance(a, bytes) and isinstance(b, bytes)):
        a, b = tuple(a), tuple(b)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def seen_key(tokens: Sequence[int], limit: int | None = None) -> bytes:
    """Tokens as big-endian uint32 bytes: 4 bytes a token, and sorted as the tokens sort."""
    a = array.array("I", tokens[:limit] if limit is not None else tokens)
    if sys.byteorder == "little":
        a.byteswap()
    return a.tobytes()


def prefix_hash(tokens: Sequence[int] | bytes) -> str:
    """A tombstone's hash of a prefix: of its `seen_key` bytes (or those bytes, given)."""
    key = tokens if isinstance(tokens, bytes) else seen_key(tokens)
    return hashlib.blake2b(key, digest_size=8).hexdigest()


@dataclass(frozen=True)
class Tombstone:
    """A recent eviction: which prefix (its length and hash), by what, when."""

    length: int
    digest: str
    by: str  # "byte budget", "learned budget", "kvstore evict"
    ts: float
    entry: str = ""
    tail: bytes = b""  # its last TAIL_TOKENS tokens as seen_key bytes: most misses end at them

    @classmethod
    def of(cls, tokens: Sequence[int], by: str, ts: float, entry: str = "") -> Tombstone:
        key = seen_key(tokens)
        return cls(len(tokens), prefix_hash(key), by, ts, entry, tail_of(key))

    def covers(self, prompt: Sequence[int] | bytes) -> bool:
        """Whether the prompt (its tokens, or its `seen_key`) starts with this prefix."""
        key = prompt if isinstance(prompt, bytes) else seen_key(prompt)
        n = 4 * self.length
        if len(key) < n or (self.tail and key[n - len(self.tail) : n] != self.tail):
            return False
        return prefix_hash(key[:n]) == self.digest


TAIL_TOKENS = 2


def tail_of(key: bytes) -> bytes:
    """The last TAIL_TOKENS tokens of a `seen_key` (a tombstone's cheap first check)."""
    return key[-4 * TAIL_TOKENS :] if key else b""


@dataclass
class Known:
    """What this process knows when a request comes (any part may be empty)."""

    pins: Mapping[tuple[int, ...], str] = field(default_factory=dict)  # stored, this model
    # the same pins as (seen_key, label), when the caller keeps their keys (taken over `pins`)
    pin_keys: Sequence[tuple[bytes, str]] = ()
    # learned prefixes stored for this model as `seen_key`s, sorted (bisect); a key holds at
    # most a cap of tokens: `learned_ends` gives the stored length of those it cuts
    learned: Sequence[bytes] = ()
    learned_ends: Mapping[bytes, int] = field(default_factory=dict)
    other_day: Sequence[tuple[Sequence[int], str]] = ()  # clock-bound pins of another day
    other_model: Sequence[tuple[Sequence[int], str]] = ()  # (tokens, what differs)
    model_changed: str = ""  # this path stored under another fingerprint: what differs
    tombstones: Sequence[Tombstone] = ()
    seen: Sequence[bytes] = ()  # recent prompts of this model as `seen_key`s, sorted (bisect)
    corrupt: Sequence[tuple[Sequence[int], str]] = ()  # failed their checks
    unavailable: bool = False  # the store cannot be read / the daemon is down, nothing stored
    write_budget: bool = False  # learning paused by the daily write budget


def attribute(
    prompt: Sequence[int],
    served: int,
    known: Known,
    decode: Callable[[Sequence[int]], str] | None = None,
    *,
    key: bytes | None = None,
) -> list[dict[str, Any]]:
    """The prompt's prefilled tokens (`prompt[served:]`), in order, as reason spans:
    [{"reason", "tokens", ...}], adjacent spans of one reason merged; their tokens sum to
    `len(prompt) - served`. `key`: the prompt's `seen_key`, when the caller has it."""
    n = len(prompt)
    key = seen_key(prompt) if key is None else key

    def agree(tokens: Sequence[int] | bytes) -> int:  # tokens the prompt shares with these
        return common_prefix(key, tokens if isinstance(tokens, bytes) else seen_key(tokens)) // 4

    pos = max(0, min(served, n))
    out: list[dict[str, Any]] = []

    def take(end: int, reason: str, **extra: Any) -> None:
        nonlocal pos
        end = min(end, n)
        if end <= pos:
            return
        if out and out[-1]["reason"] == reason and not extra and len(out[-1]) == 2:
            out[-1]["tokens"] += end - pos
        else:
            out.append({"reason": reason, "tokens": end - pos, **extra})
        pos = end

    # a stored prefix the request holds whole that could not serve it: its tokens are lost to
    # that (and a divergence before its end is not why: the request is the other prefix's)
    for tokens, what in known.corrupt:
        if agree(tokens) == len(tokens):
            take(len(tokens), "corrupt", entry=what)
    hashed: dict[int, str] = {}  # prefix length -> its hash: each length hashed once
    for t in sorted(known.tombstones, key=lambda t: -t.length):
        if pos < t.length <= n:
            end = 4 * t.length
            if t.tail and key[end - len(t.tail) : end] != t.tail:
                continue
            if t.length not in hashed:
                hashed[t.length] = prefix_hash(key[: 4 * t.length])
            if hashed[t.length] == t.digest:
                take(t.length, "evicted", by=t.by, ts=t.ts, entry=t.entry)

    # what a stored prefix of this model would have served, had the request not differed
    # end, at, entry, its tokens or seen_key (as far as known), its stored length
    best: tuple[int, int, str, Sequence[int] | bytes, int] | None = None
    candidates: list[tuple[Sequence[int] | bytes, str, int]] = (
        [(k, name, len(k) // 4) for k, name in known.pin_keys]
        if known.pin_keys
        else [(t, name, len(t)) for t, name in known.pins.items()]
    )
    held, stored, length = _learned_divergence(key, known.learned, known.learned_ends)
    if stored is not None:
        candidates.append((stored, f"learned chain of {length} tokens", length))
    for tokens, name, length in candidates:
        at = agree(tokens)
        if at >= length:
            continue  # all of it agrees: served (or not served for a reason below)
        end = min(length, n)
        if at >= pos and end > pos and (best is None or end > best[0]):
            best = (end, at, name, tokens, length)
    if best is not None:
        end, at, name, tokens, length = best
        extra: dict[str, Any] = {"entry": name, "position": at, "stored_length": length}
        if decode is not None:
            stored_tokens = tokens_of(tokens) if isinstance(tokens, bytes) else tokens
            extra["stored_text"], extra["request_text"] = texts(stored_tokens, prompt, at, decode)
        take(end, "diverged", **extra)

    if known.unavailable:
        take(n, "unavailable")
    for tokens, what in known.other_model:
        take(agree(tokens), "model_changed", differs=what)
    if known.model_changed:
        take(n, "model_changed", differs=known.model_changed)
    for tokens, name in known.other_day:
        at = agree(tokens)
        if at < len(tokens):  # what it holds past `at` is another day's
            take(min(len(tokens), n), "other_date", entry=name, position=at)
    # the seen prompt sharing the longest prefix sits next to the prompt in sorted order
    i = bisect.bisect_left(known.seen, key)
    near = known.seen[max(0, i - 1) : i + 1]
    seen_at = max((common_prefix(key, s) // 4 for s in near), default=0)
    take(held, "suffix")  # stored as a learned prefix, whole: learned, whatever else it is
    take(seen_at, "write_budget" if known.write_budget else "not_learned_yet")
    nothing = not (known.pins or known.pin_keys or known.learned or known.seen or known.other_day
                   or known.other_model or known.tombstones or known.corrupt)  # fmt: skip
    take(n, "cold" if nothing and served == 0 else "suffix")
    return out


LEARNED_TIES = 64  # learned prefixes looked at on each side of the request's place in order


def _learned_divergence(
    key: bytes, learned: Sequence[bytes], ends: Mapping[bytes, int]
) -> tuple[int, bytes | None, int]:
    """(how far a learned prefix the request holds whole reaches, the learned prefix the
    request leaves inside before its end: its seen_key as far as kept or None, its stored
    length). The prefixes sharing the most with the request sit next
    to it in sorted order; a learned prefix that ends right where the request leaves is where
    the requests that taught it differed too (a branch: the request's own content, `suffix`),
    and of the rest the shortest is the one whose tokens the difference cost."""
    if not learned:
        return 0, None, 0
    i = bisect.bisect_left(learned, key)
    at = max(common_prefix(key, learned[j]) // 4 for j in (i - 1, i) if 0 <= j < len(learned))
    if at == 0:
        return 0, None, 0
    head = key[: 4 * at]
    tied: list[bytes] = []
    for step, j in ((-1, i - 1), (1, i)):
        while (
            0 <= j < len(learned) and len(tied) < 2 * LEARNED_TIES and learned[j][: 4 * at] == head
        ):
            tied.append(learned[j])
            j += step
    if any(ends.get(s, len(s) // 4) <= at or len(s) // 4 <= at for s in tied):
        return at, None, 0  # it ends here, or agrees as far as it is kept
    s = min(tied, key=lambda s: ends.get(s, len(s) // 4))
    # the request holds the learned prefixes before the one it leaves (a shorter one at least)
    return 0, s, ends.get(s, len(s) // 4)


def tokens_of(key: bytes) -> list[int]:
    """`seen_key`'s tokens back."""
    a = array.array("I")
    a.frombytes(key)
    if sys.byteorder == "little":
        a.byteswap()
    return a.tolist()


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
    except Exception:
        return ""


def by_reason(spans: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in spans:
        out[s["reason"]] = out.get(s["reason"], 0) + int(s["tokens"])
    return out


def describe(spans: Sequence[Mapping[str, Any]]) -> str:
    """For a log line: "suffix 12, diverged 300 (entry 'sys' at 14)"."""
    parts = []
    for s in spans:
        p = f"{s['reason']} {s['tokens']}"
        if s["reason"] == "diverged":
            p += f" ({s.get('entry')!s} at {s.get('position')})"
        elif s.get("by"):
            p += f" (by {s['by']})"
        elif s.get("differs"):
            p += f" ({s['differs']})"
        elif s["reason"] == "corrupt" and s.get("entry"):
            p += f" ({s['entry']})"
        parts.append(p)
    return ", ".join(parts)


def clean(spans: Any) -> list[dict[str, Any]] | None:
    """A ledger record's reasons as a client sent them, or None when they are not well-formed."""
    if not isinstance(spans, list) or len(spans) > 64:
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
                keep[k] = v[: 4 * CONTEXT_CHARS]
            elif isinstance(k, str) and isinstance(v, (int, float)):
                keep[k] = v
        out.append(keep)
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
