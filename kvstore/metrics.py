"""Prometheus metrics of one process: the registry `kvstore serve` answers `GET /metrics` from
and the daemon serves on `--metrics-port`. Counters for events, gauges the daemon sets from its
store's numbers. Names and labels are part of the contract (docs/learned.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

REGISTRY = CollectorRegistry()  # one per process; nothing goes to prometheus_client's global one

PROMPT_TOKENS = Counter(
    "kvstore_prompt_tokens",
    "Prompt tokens of served requests by where their KV came from: store (read from the store, "
    "at start or on a miss), memory (computed by this process for an earlier request), prefill "
    "(this request's own)",
    ["source"],
    registry=REGISTRY,
)
STORE_WRITTEN_BYTES = Counter(
    "kvstore_store_written_bytes",
    "Bytes written to the store, by kind (pin or learned)",
    ["kind"],
    registry=REGISTRY,
)
EVICTIONS = Counter(
    "kvstore_evictions", "Entries or records evicted, by reason", ["reason"], registry=REGISTRY
)
RESTORE_BYTES = Counter(
    "kvstore_restore_bytes", "KV bytes restored from the store on a memory miss", registry=REGISTRY
)
RESTORE_SECONDS = Counter(
    "kvstore_restore_seconds",
    "Seconds spent restoring from the store (restore bytes/s = restore_bytes / this)",
    registry=REGISTRY,
)
LEARN_REPORTS = Counter(
    "kvstore_learn_reports", "Prompts reported to the daemon for learning", registry=REGISTRY
)
LEARN_DROPPED = Counter(
    "kvstore_learn_dropped",
    "Learn jobs dropped, by reason (queue full, no daemon, abandoned at exit)",
    ["reason"],
    registry=REGISTRY,
)
LEARNED_RECORDS = Gauge("kvstore_learned_records", "Learned block records stored", registry=REGISTRY)
LEARNED_BYTES = Gauge("kvstore_learned_bytes", "Bytes of learned data stored", registry=REGISTRY)
LEARNED_BUDGET_BYTES = Gauge(
    "kvstore_learned_budget_bytes", "learned_max_bytes: learned data's budget", registry=REGISTRY
)
LEARN_WRITTEN_TODAY_BYTES = Gauge(
    "kvstore_learn_written_today_bytes", "Learned bytes written today", registry=REGISTRY
)
LEARN_PAUSED = Gauge(
    "kvstore_learn_paused", "1 while learning is paused by a budget", registry=REGISTRY
)

for _source in ("memory", "store", "prefill"):  # shown at 0 before the first request
    PROMPT_TOKENS.labels(source=_source)
for _kind in ("pin", "learned"):
    STORE_WRITTEN_BYTES.labels(kind=_kind)


def exposition() -> tuple[bytes, str]:
    """(body, content type) of the registry in Prometheus text format."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
