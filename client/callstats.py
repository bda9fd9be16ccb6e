"""Prefill stats by default: what each call cost, and how much of its prompt the cache served.

`stream_generate` / `generate` wrap mlx-lm's own: fetch the nearest cached prefix, generate on the
rest, insert the transcript (mlx-lm's within-query chaining), and record one `CallStats`. The
record is logged on "kvstore.client", kept in memory and batched to the daemon's ledger off the
request path. A team once read its prefill cost as zero for months, so the per-call line is
printed to stderr unless logging already shows it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore import metrics, mlxlm
from kvstore.client.writebehind import WriteBehind
from kvstore.identity.model import model_name
from kvstore.reasons import Attributor, SpanRecord, by_reason, describe
from kvstore.tokens import TokenIds
from kvstore.wire.messages import RecordRequest

if TYPE_CHECKING:  # mlx-lm's own types, imported for the checker only (mlx_lm loads on a call)
    import mlx.nn as nn
    from mlx_lm.generate import GenerationResponse
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizer

log = logging.getLogger("kvstore.client")

BATCH_RECORDS = 32  # records per `record` request to the daemon
BATCH_SECONDS = 5.0  # oldest unsent record waits at most this long for the next call to send it
KEEP_CALLS = 1000  # `StatsRecorder.calls` keeps the most recent calls; `summary()` counts all


@dataclass(frozen=True)
class CallStats:
    model: str
    label: str
    prompt_tokens: int
    cached_tokens: int  # served from the prompt cache (hydrated from the store, or in memory)
    prefilled_tokens: int
    prefill_s: float
    decode_s: float
    generated_tokens: int = 0
    ts: float = 0.0
    reasons: tuple[SpanRecord, ...] = ()  # why the prefilled ones were (kvstore.reasons.Span)
    fleet_tokens: int = 0  # of the cached ones, read through from the fleet on this call

    def line(self) -> str:
        why = f" ({describe(self.reasons)})" if self.reasons else ""
        return (
            f"kvstore: {self.label}: {self.prompt_tokens} prompt tokens, {self.cached_tokens} "
            f"from cache{f' ({self.fleet_tokens} from the fleet)' if self.fleet_tokens else ''}, "
            f"{self.prefilled_tokens} prefilled{why} in {self.prefill_s:.3f} s; "
            f"{self.generated_tokens} generated in {self.decode_s:.3f} s"
        )

    def prefilled_by_reason(self) -> dict[str, int]:
        return by_reason(self.reasons)


@dataclass
class LabelSummary:
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefilled: dict[str, int] = field(default_factory=dict)  # reason -> tokens (kvstore.reasons)

    @property
    def saved_s(self) -> float:
        """Estimated prefill seconds the cache saved, at this label's own prefill rate."""
        if not self.prefilled_tokens:
            return 0.0
        return self.cached_tokens * self.prefill_s / self.prefilled_tokens


class StatsRecorder:
    """Per-call stats for one model: `.calls`, `.summary()`, and batches to the daemon.

    `.calls` holds the most recent `keep_calls` calls (KEEP_CALLS by default; a server records
    one per request for as long as it runs), oldest first; `.summary()` counts every call
    recorded, from running totals.

    `verbose`: True prints each call's line to stderr, False only logs it at INFO, None (default)
    prints unless INFO records of "kvstore.client" already reach a handler.
    """

    def __init__(
        self,
        model: str,
        *,
        writer: WriteBehind | None = None,
        home: str | Path | None = None,
        send: bool = True,
        verbose: bool | None = None,
        keep_calls: int = KEEP_CALLS,
    ):
        self.model = model_name(model)  # what the ledger records: the model's one name
        self.verbose = verbose
        self.calls: list[CallStats] = []  # the most recent `keep_calls`
        self.keep_calls = max(0, keep_calls)
        self._totals: dict[str, LabelSummary] = {}  # every call's, by label
        self._own_writer = writer is None and send
        self._writer = WriteBehind(home) if self._own_writer else writer
        self._unsent: list[dict[str, Any]] = []
        self._last_send = 0.0
        self.attribute = Attributor()  # why prefilled tokens were (kvstore.reasons)

    def record(
        self,
        *,
        label: str,
        prompt_tokens: int,
        cached_tokens: int,
        prefill_s: float,
        decode_s: float,
        generated_tokens: int = 0,
        prompt: Sequence[int] | None = None,
        pins: Mapping[tuple[int, ...], str] | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        fleet_tokens: int = 0,
        verbose: bool | None = None,
    ) -> CallStats:
        """One call: its line, its ledger record, /metrics' reasons. `prompt`: the ids the
        prompt cache keys it by (what its prefilled tokens are attributed by; with images,
        mlx_lm.server's key, one negative id per image); `fleet_tokens`: of the cached ones,
        read through from the fleet on this call (its fetch's record); `verbose`: this call's
        own, else the recorder's."""
        reasons: tuple[SpanRecord, ...] = ()
        if prompt is not None:
            reasons = tuple(self.attribute(prompt, cached_tokens, pins or {}, decode))
            for s in reasons:
                metrics.PREFILLED_TOKENS.labels(reason=s["reason"]).inc(s["tokens"])
        call = CallStats(
            model=self.model,
            label=label,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            prefilled_tokens=prompt_tokens - cached_tokens,
            prefill_s=prefill_s,
            decode_s=decode_s,
            generated_tokens=generated_tokens,
            ts=time.time(),
            reasons=reasons,
            fleet_tokens=fleet_tokens,
        )
        self._keep(call)
        say(call.line(), self.verbose if verbose is None else verbose)
        if self._writer is not None:
            rec = asdict(call)
            rec["reasons"] = list(rec["reasons"])
            self._unsent.append(rec)
            self._send()
        return call

    def summary(self) -> dict[str, LabelSummary]:
        """Every recorded call's totals by label (not only those `.calls` still holds)."""
        return {label: replace(s, prefilled=dict(s.prefilled)) for label, s in self._totals.items()}

    def _keep(self, c: CallStats) -> None:
        self.calls.append(c)
        if len(self.calls) > self.keep_calls:
            del self.calls[: len(self.calls) - self.keep_calls]
        s = self._totals.setdefault(c.label, LabelSummary())
        s.calls += 1
        s.prompt_tokens += c.prompt_tokens
        s.cached_tokens += c.cached_tokens
        s.prefilled_tokens += c.prefilled_tokens
        s.prefill_s += c.prefill_s
        s.decode_s += c.decode_s
        for reason, n in c.prefilled_by_reason().items():
            s.prefilled[reason] = s.prefilled.get(reason, 0) + n

    def send(self) -> None:
        """Hand every unsent record to the write-behind now (a timer's work); no wait."""
        self._send(force=True)

    def flush(self, timeout: float = 10.0) -> bool:
        """Send every unsent record now and wait for the daemon to take them."""
        self._send(force=True)
        return self._writer.flush(timeout) if self._writer is not None else True

    def close(self, timeout: float = 10.0) -> None:
        self._send(force=True)
        if self._own_writer and self._writer is not None:
            self._writer.close(timeout)

    def _send(self, force: bool = False) -> None:
        if not self._unsent or self._writer is None:
            return
        due = time.monotonic() - self._last_send >= BATCH_SECONDS
        if not (force or due or len(self._unsent) >= BATCH_RECORDS):
            return
        batch, self._unsent = self._unsent, []
        self._last_send = time.monotonic()
        self._writer.send(f"{len(batch)} prefill stats records", RecordRequest(batch))


def say(line: str, verbose: bool | None = None) -> None:
    """`line` logged on "kvstore.client" at INFO, and printed to stderr if `verbose`; None (the
    default): unless INFO records of "kvstore.client" already reach a handler."""
    log.info("%s", line)
    if verbose is None:
        verbose = not (log.isEnabledFor(logging.INFO) and log.hasHandlers())
    if verbose:
        print(line, file=sys.stderr)


class CachedCall:
    """One generation through a prompt cache, what `stream_generate` and `kvstore.client.attach`
    share: `open` fetches the nearest cached prefix (`cache` to generate with, `rest` still to
    prefill); `close` records the call's stats and inserts its transcript (mlx-lm's chaining).

    State lives on the object, one per call: two threads (or two interleaved generators) each
    have their own. `prompt_cache` is a PersistentPromptCache, an LRUPromptCache with
    `model_key`, or None (a fresh cache, nothing inserted)."""

    def __init__(
        self,
        prompt_cache: Any,
        model_key: Any,
        tokens: list[int],
        cache: list,
        rest: list[int],
        *,
        label: str,
        stats: StatsRecorder | None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ):
        self.prompt_cache, self.model_key, self.label = prompt_cache, model_key, label
        self.tokens, self.cache, self.rest = tokens, cache, rest
        self.stats, self.decode = stats, decode
        # what the fetch prefilled itself (a learned split) is prefill, not cache
        self.split, self.split_s, self.fleet = _fetch_record(prompt_cache, tokens)

    @classmethod
    def open(
        cls,
        prompt_cache: Any,
        model: Any,
        tokens: list[int],
        *,
        label: str = "default",
        model_key: Any = None,
        stats: StatsRecorder | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> CachedCall:
        """The call of `tokens` (the prompt's ids): the nearest prefix `prompt_cache` holds
        fetched (its model_key and stats unless given)."""
        if model_key is None:
            model_key = getattr(prompt_cache, "model_key", None)
        if stats is None:
            stats = getattr(prompt_cache, "stats", None)
        cache, rest = _cache_for(prompt_cache, model_key, model, tokens)
        return cls(
            prompt_cache, model_key, tokens, cache, rest, label=label, stats=stats, decode=decode
        )

    @property
    def served(self) -> int:
        """The prompt's tokens the fetch put in `cache` (generation starts after them)."""
        return len(self.tokens) - len(self.rest)

    def close(
        self,
        generated: Sequence[int],
        prefill_s: float,
        elapsed_s: float,
        *,
        verbose: bool | None = None,
    ) -> None:
        """The call is over (also when the caller stopped early: it cost what it cost): record
        its stats (`prefill_s` mlx-lm's, `elapsed_s` from the first token in to the last out;
        `verbose` as StatsRecorder.record's) and insert the transcript the cache holds. A call
        that failed before answering (mlx-lm refused its arguments) generated nothing: no call,
        nothing recorded or inserted."""
        if not generated:
            return
        prefill_s += self.split_s
        if self.stats is not None:
            self.stats.record(
                label=self.label,
                prompt_tokens=len(self.tokens),
                cached_tokens=self.served - self.split,
                prefill_s=prefill_s,
                decode_s=max(0.0, elapsed_s - prefill_s),
                generated_tokens=len(generated),
                prompt=self.tokens,
                pins=_pins_of(self.prompt_cache, self.model_key),
                decode=self.decode,
                fleet_tokens=self.fleet,
                verbose=verbose,
            )
        if self.prompt_cache is not None:
            # mlx-lm runs one token ahead: key the entry by what the cache really holds.
            transcript = mlxlm.generated_transcript(self.cache, self.tokens + list(generated))
            if transcript is not None:
                self.prompt_cache.insert_cache(self.model_key, transcript, self.cache)


def stream_generate(
    prompt_cache: LRUPromptCache | None,
    model: nn.Module,
    tokenizer: PreTrainedTokenizer | TokenizerWrapper,
    prompt: str | TokenIds,
    *,
    label: str = "default",
    model_key: Any = None,
    stats: StatsRecorder | None = None,
    verbose: bool | None = None,
    **kwargs: Any,
) -> Iterator[GenerationResponse]:
    """mlx_lm.stream_generate through an LRUPromptCache, recording the call's prefill stats.

    `prompt_cache` is a PersistentPromptCache (its model_key and stats are used), an mlx-lm
    LRUPromptCache (pass `model_key`, and `stats` to record), or None. `prompt`: text, or token
    ids (a sequence of ints, a numpy or an mx array). `verbose`: True prints this call's stats
    line to stderr, False only logs it, None leaves it to `stats` (StatsRecorder's `verbose`).
    The other keyword arguments are mlx_lm.stream_generate's. Yields mlx-lm's
    GenerationResponse objects; the transcript is inserted back into the cache at the end. A
    call that fails before its first response (a keyword mlx-lm does not take) is neither
    recorded nor inserted.
    """
    import mlx_lm

    tokens = _prompt_ids(model, tokenizer, prompt, _vocab_of(prompt_cache, model))
    identity = getattr(prompt_cache, "identity", None)
    if identity is not None and identity.kv_bits is not None:  # as the stored pins are
        for name in ("kv_bits", "kv_group_size", "quantized_kv_start"):
            kwargs.setdefault(name, getattr(identity, name))

    call = CachedCall.open(
        prompt_cache, model, tokens, label=label, model_key=model_key, stats=stats,
        decode=getattr(tokenizer, "decode", None),
    )  # fmt: skip
    both = call.cache  # what mlx-lm runs on: with a draft model, its cache follows the model's
    if kwargs.get("draft_model") is not None:
        both = call.cache + _draft_cache(kwargs["draft_model"], tokens[: call.served])
    generated: list[int] = []
    prefill_s = 0.0
    t0 = time.perf_counter()
    try:
        for resp in mlx_lm.stream_generate(
            model, tokenizer, call.rest, prompt_cache=both, **kwargs
        ):
            if not generated:
                prefill_s = resp.prompt_tokens / resp.prompt_tps if resp.prompt_tps else 0.0
            generated.append(resp.token)
            yield resp
    finally:
        call.close(generated, prefill_s, time.perf_counter() - t0, verbose=verbose)


def _fetch_record(prompt_cache: Any, tokens: list[int]) -> tuple[int, float, int]:
    """(tokens, seconds) kvstore's cache prefilled inside its fetch (a learned split), and the
    tokens it read through from the fleet: the fetch's record, taken once."""
    took = getattr(prompt_cache, "fetch_record", None)  # client/persistent.py's caches
    if took is None:
        return 0, 0.0, 0
    record = took(tokens)
    return record.split, record.split_s, record.fleet


def _pins_of(prompt_cache: Any, model_key: Any) -> dict[tuple[int, ...], str]:
    """The cache's pins of this model: tokens -> label (what a `diverged` reason names)."""
    labels = getattr(prompt_cache, "pin_labels", None)  # kvstore's caches (client/persistent.py)
    return dict(labels(model_key)) if labels is not None else {}


def _vocab_of(prompt_cache: Any, model: Any) -> int | None:
    """The model's vocabulary size as its PersistentPromptCache read it once, or None."""
    if prompt_cache is not None and getattr(prompt_cache, "model", None) is model:
        return getattr(prompt_cache, "vocab_size", None)
    return None


def _prompt_ids(
    model: Any, tokenizer: Any, prompt: str | TokenIds, vocab: int | None = None
) -> list[int]:
    """The prompt's token ids: a string encoded as mlx_lm.stream_generate encodes it, the app's
    own ids checked against the model's vocabulary (`vocab`, when known already)."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)  # as mlx_lm.stream_generate encodes it
        special = bos is None or not prompt.startswith(bos)
        return list(tokenizer.encode(prompt, add_special_tokens=special))
    if (
        isinstance(prompt, (list, tuple))
        and vocab is not None
        and all(type(t) is int and 0 <= t < vocab for t in prompt)
    ):
        return list(prompt)
    # the app's own ids (an array too): one past the embedding would crash the process in mlx
    from kvstore.kvcheck.prefill import check_token_ids, model_vocab_size

    if vocab is None:
        vocab = model_vocab_size(model)
    return list(check_token_ids(prompt, vocab, what="prompt"))


def _cache_for(
    prompt_cache: Any, model_key: Any, model: Any, tokens: list[int]
) -> tuple[list, list[int]]:
    """(the cache to generate with, the tokens it still has to prefill): the nearest one
    `prompt_cache` holds, else a fresh one."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore import mlxlm

    cache, rest = None, tokens
    if prompt_cache is not None:
        if model_key is None:
            raise ValueError("stream_generate: pass model_key for a plain LRUPromptCache")
        cache, rest = prompt_cache.fetch_nearest_cache(model_key, tokens)
    if cache is not None and tokens and not rest:  # a plain LRUPromptCache's exact hit
        cache, rest = mlxlm.leave_last_token(prompt_cache, model_key, tokens, cache)
    if cache is None:
        cache = make_prompt_cache(model)
    return cache, rest


def _draft_cache(draft_model: Any, prefix: list[int]) -> list:
    """A draft model's cache holding `prefix`, the tokens the model's own cache holds:
    speculative decoding runs both on the same tokens, and the store keeps the model's only."""
    if not prefix:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(draft_model)
    from kvstore.kvcheck.prefill import prefill

    return prefill(draft_model, prefix)


def generate(
    prompt_cache: LRUPromptCache | None,
    model: nn.Module,
    tokenizer: PreTrainedTokenizer | TokenizerWrapper,
    prompt: str | TokenIds,
    *,
    label: str = "default",
    model_key: Any = None,
    stats: StatsRecorder | None = None,
    verbose: bool | None = None,
    **kwargs: Any,
) -> str:
    """`stream_generate`, returning the whole text, as mlx_lm.generate: `verbose=True` also
    prints the text as it is generated and the timings (mlx_lm.generate's), False prints
    neither nor the stats line."""
    responses = stream_generate(
        prompt_cache,
        model,
        tokenizer,
        prompt,
        label=label,
        model_key=model_key,
        stats=stats,
        verbose=verbose,
        **kwargs,
    )
    if not verbose:
        return "".join(r.text for r in responses)
    print("=" * 10)
    text, last = "", None
    for last in responses:
        print(last.text, end="", flush=True)
        text += last.text
    print()
    print("=" * 10)
    if not text or last is None:
        print("No text generated for this prompt")
        return text
    print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
    print(f"Peak memory: {last.peak_memory:.3f} GB")
    return text
