"""Prometheus metrics of this process (prometheus-client): one registry, `REGISTRY`, that
`kvstore serve` answers on GET /metrics and the daemon on --metrics-port. Metric definitions and
the small functions that set them; what moves them lives with the code that does the work."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvstore.reasons import REASONS

REGISTRY = CollectorRegistry(auto_describe=True)

PROMPT_TOKENS = Counter(
    "kvstore_prompt_tokens",
    "Prompt tokens served, by where their KV came from (memory, store, prefill)",
    ["source"],
    registry=REGISTRY,
)
WRITTEN_BYTES = Counter(
    "kvstore_store_written_bytes",
    "Bytes written to the store, by kind (pin: entries; learned: records and snapshots)",
    ["kind"],
    registry=REGISTRY,
)
LEARNED_RECORDS = Gauge("kvstore_learned_records", "Learned block records stored",
                        registry=REGISTRY)  # fmt: skip
LEARNED_BYTES = Gauge("kvstore_learned_bytes", "Bytes of learned data stored (records and "
                      "snapshots)", registry=REGISTRY)  # fmt: skip
LEARNED_BUDGET = Gauge("kvstore_learned_budget_bytes", "learned_max_bytes: the learned budget",
                       registry=REGISTRY)  # fmt: skip
WRITTEN_TODAY = Gauge("kvstore_learn_written_today_bytes", "Learned bytes written today (local)",
                      registry=REGISTRY)  # fmt: skip
LEARN_PAUSED = Gauge("kvstore_learn_paused", "1 while learning is paused by a budget",
                     registry=REGISTRY)  # fmt: skip
EVICTIONS = Counter("kvstore_evictions", "Entries and records evicted, by reason", ["reason"],
                    registry=REGISTRY)  # fmt: skip
RESTORE_BYTES = Counter("kvstore_restore_bytes", "Bytes restored from the store",
                        registry=REGISTRY)  # fmt: skip
RESTORE_SECONDS = Counter("kvstore_restore_seconds", "Seconds spent restoring from the store",
                          registry=REGISTRY)  # fmt: skip
LEARN_REPORTS = Counter("kvstore_learn_reports", "Prompts reported to the daemon to learn",
                        registry=REGISTRY)  # fmt: skip

LEARN_DROPPED = Counter(
    "kvstore_learn_dropped",
    "Learn jobs dropped, by reason (queue_full: the write-behind queue; abandoned: at exit)",
    ["reason"],
    registry=REGISTRY,
)
FLEET_REFUSED = Counter(
    "kvstore_fleet_refused",
    "Objects pulled from the fleet tier and refused, by reason (unauthentic: MAC missing or "
    "wrong; mismatch: its KV is not what this box's model computes)",
    ["reason"],
    registry=REGISTRY,
)
FLEET_READS = Counter(
    "kvstore_fleet_reads",
    "Read-through asks of the fleet on a request's miss, by outcome (fetched, miss, slower: "
    "prefilling was expected to be faster, abandoned: past its deadline, refused, error)",
    ["outcome"],
    registry=REGISTRY,
)
FLEET_FETCH_BYTES = Counter(
    "kvstore_fleet_fetch_bytes",
    "Bytes of learned records fetched from the fleet on a request's miss",
    registry=REGISTRY,
)
FLEET_ROUND_TRIPS = Counter(
    "kvstore_fleet_round_trips",
    "Requests to the fleet's bucket made on a request's miss (lookups and fetches)",
    registry=REGISTRY,
)
FLEET_ABANDONED = Counter(
    "kvstore_fleet_abandoned_fetches",
    "Read-through fetches abandoned at their deadline (the request prefilled)",
    registry=REGISTRY,
)
FLEET_BREAKER = Gauge(
    "kvstore_fleet_breaker_open",
    "1 while the read-through's circuit breaker is open (the endpoint failed: requests prefill)",
    registry=REGISTRY,
)
FLEET_SAVED_SECONDS = Counter(
    "kvstore_fleet_saved_seconds",
    "Prefill seconds read-through saved: the expected prefill minus the fetch",
    registry=REGISTRY,
)
PREFILLED_TOKENS = Counter(
    "kvstore_prefilled_tokens",
    "Prefilled prompt tokens, by why they were not served (kvstore.reasons; suffix included)",
    ["reason"],
    registry=REGISTRY,
)

for _source in ("memory", "store", "fleet", "prefill"):  # shown at 0 before the first request
    PROMPT_TOKENS.labels(source=_source)
for _kind in ("pin", "learned"):
    WRITTEN_BYTES.labels(kind=_kind)
for _reason in REASONS:
    PREFILLED_TOKENS.labels(reason=_reason)


def set_learned(summary: dict[str, Any]) -> None:
    """The learned gauges from a learned summary (`BlockStore.summary`)."""
    LEARNED_RECORDS.set(summary.get("records", 0))
    LEARNED_BYTES.set(summary.get("bytes", 0) + summary.get("snapshot_bytes", 0))
    LEARNED_BUDGET.set(summary.get("budget", 0))
    WRITTEN_TODAY.set(summary.get("written_today", 0))
    LEARN_PAUSED.set(1 if summary.get("paused") else 0)


def exposition() -> tuple[bytes, str]:
    """The registry in Prometheus text format, and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def reply_metrics(handler) -> None:
    """Answer a `GET /metrics` on an `http.server` handler with the registry (what serve's handler
    and the soak's plain `mlx_lm.server` both answer)."""
    body, content_type = exposition()
    handler.send_response(200)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
