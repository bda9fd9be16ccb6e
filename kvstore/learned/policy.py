"""What the daemon learns: which prefix of a reported prompt recurs, which records to ask for,
and when learning pauses. Pure (no store, no mlx); the daemon's `learn` command feeds it.

A prefix is learned when at least `min_requests` distinct requests share it (the exact longest
common prefix, found per chain node: counts of requests through each full block and the first
tokens that followed it) and it is at least `min_lcp` tokens long; or when a prompt extends an
earlier request's whole prompt (a conversation's next turn: the whole prompt is learned). Counts
live in memory, bounded (LRU); they are hints, so a restart only delays learning.

Across the fleet (`sighting`): the chain nodes a request passes that this box never counted are
its first sightings here; another box's earlier request through one of them (a seen-marker in the
bucket, kvstore.fleet.sightings) makes the prefix up to that node recurring, block-granular. The
policy only says which nodes the fleet may answer for; the daemon asks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvstore import tokens as tk
from kvstore.learned.chain import cuts, position_hash

MIN_LCP = 64  # tokens: a shorter common prefix is not worth a record
INFLIGHT_S = 30.0  # seconds a want handed to one client is withheld from the others
MAX_NODES = 20_000  # chain nodes counted (each keeps <= MAX_CONTS next blocks: <= ~80 MiB)
MAX_CONTS = 4
MAX_ENDS = 4096  # recent prompt ends remembered for the "extends" rule
READ_BPS = float(2**30)  # bytes/s a restore is assumed to read at until measured
RESTORE_FIXED_S = 0.005  # seconds of fixed cost per restore (transaction, walk, arrays)


def worth_storing(
    nbytes: float | None, ntokens: int, prefill_tps: float | None, read_bps: float = READ_BPS
) -> bool:
    """The cost rule: reloading must beat prefilling by 2x (bytes/read + 5 ms < tokens/tps / 2).
    Unknown sizes or rates count as worth it."""
    if not nbytes or not prefill_tps or prefill_tps <= 0:
        return True
    return nbytes / read_bps + RESTORE_FIXED_S < ntokens / prefill_tps / 2


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass(frozen=True)
class Sighting:
    """One request counted: the prefix learned on this box's counts (`end`, 0: none), and the
    chain nodes [lo, hi] (block indices) this box saw first now, past `end` and at least MIN_LCP
    deep, that an earlier request on another box would make recurring (`fleet`; None: none, or
    `min_requests` is not 2: a marker stands for one earlier request)."""

    end: int
    fleet: tuple[int, int] | None = None


class LearnPolicy:
    """Request counts per chain node, prompt ends, and the wants handed out recently."""

    def __init__(
        self,
        *,
        min_requests: int = 2,
        block: int = 256,
        max_nodes: int = MAX_NODES,
        max_ends: int = MAX_ENDS,
        inflight_s: float = INFLIGHT_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.min_requests = max(1, min_requests)
        self.block = block
        self.max_nodes = max_nodes
        self.max_ends = max_ends
        self.inflight_s = inflight_s
        self.clock = clock
        # fingerprint + h_k -> [requests through it, next-block token bytes of up to MAX_CONTS]
        self.nodes: OrderedDict[bytes, list] = OrderedDict()
        # fingerprint + h_{L//B} -> {L: H(L)} of recent prompt ends
        self.ends: OrderedDict[bytes, dict[int, bytes]] = OrderedDict()
        self.inflight: dict[bytes, float] = {}  # record key -> when the want expires
        self._said: set[tuple[str, str]] = set()

    # -- counting -----------------------------------------------------------------------------

    def sighting(self, fp: bytes, data: bytes, hashes: list[bytes]) -> Sighting:
        """`learned_end`, and the nodes the fleet may make recurring (see Sighting)."""
        unseen = next((i for i, h in enumerate(hashes) if fp + h not in self.nodes), None)
        end = self.learned_end(fp, data, hashes)
        if unseen is None or self.min_requests != 2:
            return Sighting(end)
        lo = max(unseen, -(-MIN_LCP // self.block), 1, end // self.block + 1)
        hi = tk.count(data) // self.block
        return Sighting(end, (lo, hi) if lo <= hi else None)

    def learned_end(self, fp: bytes, data: bytes, hashes: list[bytes]) -> int:
        """The end of the prefix of this prompt (packed `data`, chain `hashes`) that is learned
        now (0: none); then counts this request."""
        depth = self._recurring_end(fp, data, hashes)
        if depth < MIN_LCP:
            depth = 0
        if self._extends(fp, data, hashes):
            depth = tk.count(data)
        self._count(fp, data, hashes)
        return depth

    def _recurring_end(self, fp: bytes, data: bytes, hashes: list[bytes]) -> int:
        need = self.min_requests - 1  # earlier requests that must share it
        if need == 0:
            return tk.count(data)
        b, k = self.block, -1
        for i, h in enumerate(hashes):
            node = self.nodes.get(fp + h)
            if node is None or node[0] < need:
                break
            k = i
        if k < 0:
            return 0
        conts = self.nodes[fp + hashes[k]][1]
        mine = tk.cut(data, k * b, (k + 1) * b)
        shared = sorted((tk.common_prefix(c, mine) for c in conts), reverse=True)
        return k * b + (shared[need - 1] if len(shared) >= need else 0)

    def _extends(self, fp: bytes, data: bytes, hashes: list[bytes]) -> bool:
        n = tk.count(data)
        for h in hashes:
            for end, hend in self.ends.get(fp + h, {}).items():
                if end < n and position_hash(fp, data, end, self.block, hashes) == hend:
                    return True
        return False

    def _count(self, fp: bytes, data: bytes, hashes: list[bytes]) -> None:
        b, n = self.block, tk.count(data)
        for k, h in enumerate(hashes):
            key = fp + h
            node = self.nodes.pop(key, None) or [0, []]
            node[0] += 1
            cont = tk.cut(data, k * b, (k + 1) * b)
            if cont:  # duplicates count: each is one request
                node[1] = (node[1] + [cont])[-MAX_CONTS:]
            self.nodes[key] = node
        while len(self.nodes) > self.max_nodes:
            self.nodes.popitem(last=False)
        if n:
            key = fp + hashes[n // b]
            ends = self.ends.pop(key, {})
            ends[n] = position_hash(fp, data, n, b, hashes)
            self.ends[key] = ends
            while len(self.ends) > self.max_ends:
                self.ends.popitem(last=False)

    # -- wants --------------------------------------------------------------------------------

    def wants(
        self, fp: bytes, data: bytes, hashes: list[bytes], stored: int, end: int
    ) -> list[tuple[int, int]]:
        """Records [stored, end) cut at blocks, less those another client was asked for in the
        last `inflight_s` seconds; what is returned is in flight from now on."""
        now = self.clock()
        self.inflight = {k: t for k, t in self.inflight.items() if t > now}
        out = []
        for s, e in cuts(stored, end, self.block):
            key = fp + position_hash(fp, data, e, self.block, hashes)
            if key in self.inflight:
                continue
            self.inflight[key] = now + self.inflight_s
            out.append((s, e))
        return out

    def landed(self, keys: list[bytes]) -> None:
        """Records stored: no longer in flight (stored_end covers them now)."""
        for k in keys:
            self.inflight.pop(k, None)

    # -- budgets ------------------------------------------------------------------------------

    def paused(
        self,
        *,
        written_today: int,
        write_budget: int,
        want_bytes: int | None = None,
        learned_budget: int | None = None,
    ) -> str | None:
        """Why learning is paused now, or None."""
        if written_today >= write_budget:
            return (
                f"learning paused: {gib(written_today)} written today "
                f"(learn_write_bytes_per_day={write_budget}); resumes at midnight"
            )
        if learned_budget is not None and want_bytes and want_bytes > learned_budget:
            return (
                f"learning paused: a learned prefix of {gib(want_bytes)} is over the learned "
                f"budget (learned_max_bytes={learned_budget})"
            )
        return None

    def first_time(self, message: str, day: str) -> bool:
        """True once per message kind and day (the daemon logs a pause once a day)."""
        kind = message.split(":", 1)[1].split("(")[-1].split("=")[0] if ":" in message else message
        if (day, kind) in self._said:
            return False
        self._said.add((day, kind))
        return True
