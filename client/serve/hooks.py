"""The `kvstore serve` hooks into mlx-lm's own OpenAI-compatible server (run by
kvstore.client.cli).

The server runs in-process, unchanged, with two of its module globals replaced for the duration
of `serve()` by thin subclasses:

- `mlx_lm.server.ModelProvider` -> hydrates the store's entries for a model right after
  `ModelProvider._load` loaded it, under the key the server uses (`ModelProvider.model_key`,
  the tuple (model_path, adapter_path, draft_model_path)).
- `mlx_lm.server.LRUPromptCache` -> the client's own cache (kvstore.client.persistent's
  PinnedPromptCache) built with serve's store tier: the instance `mlx_lm.server.run` builds is
  the one hydrated; stored pins are kept in it outside the LRU's eviction, --prompt-cache-size
  and --prompt-cache-bytes, and put back when a conversation extends one, so every request a pin
  prefixes is served it whatever the churn. Serve's differences are the tier's values: its
  `on_insert` (with --persist-system-prompts, `insert_cache(..., cache_type="system")` calls -
  the batched path snapshots the system-prompt segment under that type - are sent to the
  daemon) and its `quiet` (the warm-up requests).

With --persist-system-prompts, `mlx_lm.server.ResponseGenerator` is replaced too: its `_tokenize`
re-cuts the system segment at kvstore's stable boundary (kvstore.client.serve.persist), except
where a pin serves past both cuts (nothing of the system segment is prefilled or persisted).

Unless --no-learn, the store tier carries a Learner (kvstore.client.learn): prompts are
reported to the daemon, which learns the prefixes that recur, and a memory miss the store can
serve is restored from it. `_run_http_server` gets a handler subclass that answers `GET /metrics`
and keeps `/health` at 503 until the model is loaded, hydrated and warmed up (one throwaway
request per pin through the server itself, so the first request does not pay the fresh
process's first kernels, template render or store open).

Both generation paths then see the entries: the batched path and `_serve_single` both call
`prompt_cache.fetch_nearest_cache(model_provider.model_key, prompt)`, and `cached_tokens` is
`len(prompt) - len(rest)` of that call. `check_server_shape` verifies these assumptions up front.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from kvstore import mlxlm
from kvstore.client.callstats import StatsRecorder
from kvstore.client.hydrate import Prefetched, insert, prefetch
from kvstore.client.learn import LEARN_QUEUE, Learner
from kvstore.client.loader import fingerprint_files, tag_loaded
from kvstore.client.persistent import HIT_BATCH_S, PinnedPromptCache, StoreTier
from kvstore.client.serve.gauges import LearnedGauges
from kvstore.client.serve.persist import (
    StableSystemSegment,
    SystemPromptPersister,
    template_args_warning,
)
from kvstore.client.writebehind import WriteBehind
from kvstore.degrade import serve_hook
from kvstore.errors import KVStoreError, counted
from kvstore.identity.model import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_QUANTIZED_KV_START,
    ModelIdentity,
)
from kvstore.known import after_hydrate
from kvstore.learned.coldtier import LearnTarget

log = logging.getLogger("kvstore.serve")

STOP_GRACE_S = 30.0  # seconds a server told to stop may take (its drains: 2 x 10 s) before it exits
SERVE_CALLS = 64  # recent calls serve's StatsRecorder keeps (its ledger and /metrics count all)
IMAGE_PROMPTS = 16  # prompts with images whose cache key waits for their call's record
WARM_UP_HEADER = "X-KVStore-Warm-Up"
WARM_UP_TEXT = (
    "Warm-up request of kvstore serve: this turn is as long as a short user request, so the "
    "first real request after a start runs at the shapes this one ran at already."
)
WARM_UP_CONNECT_S = 60.0  # seconds the warm-up waits for the server's socket
WARM_UP_TIMEOUT_S = 300.0  # seconds one warm-up request may take (a long pin on a slow machine)


class ServeError(KVStoreError):
    """mlx_lm.server does not have the shape `kvstore serve` hooks into."""


def check_server_shape(server: Any) -> None:
    """Fail with one clear message when mlx_lm.server no longer looks like 0.31-0.32's."""
    problems = mlxlm.server_problems(server, PinnedPromptCache)
    if problems:
        import mlx_lm

        raise ServeError(
            f"kvstore serve does not support this mlx-lm ({mlx_lm.__version__}): "
            + "; ".join(problems)
            + ". Run plain `mlx_lm.server`, or install mlx-lm 0.31.3-0.32."
        )


def pin_served(pins: Iterable[tuple[int, ...]], prompt: list[int], cached: int) -> tuple | None:
    """The pin a request was served from: the longest one it starts with and the cache served,
    or one it equals or is a prefix of when the cache served all of the prompt but its last
    token (which mlx-lm always prefills, to have logits to sample from)."""

    def served(t: tuple[int, ...]) -> bool:
        n = min(len(t), len(prompt))
        return tuple(prompt[:n]) == t[:n] and cached >= (n - 1 if n == len(prompt) else n)

    return max((t for t in pins if served(t)), key=lambda t: (min(len(t), len(prompt)), -len(t)),
               default=None)  # fmt: skip


class CallRecords:
    """The calls part: each request's record when its last token is out (its prefill stats to the
    ledger and /metrics through kvstore.client.callstats' StatsRecorder, as the library's calls),
    with the pin that served it and, for a prompt with images, the key mlx-lm's cache holds it by;
    the warm-up requests make none."""

    def __init__(self, tier: StoreTier, warm_up: WarmUp):
        self.tier = tier
        self.warm_up = warm_up
        self.stats: StatsRecorder | None = None  # per-request prefill stats, once a model loaded
        self.lock = threading.Lock()  # around `stats`: the generation thread and the flusher
        self.labels: dict[tuple[int, ...], str] = {}  # stored entries' tokens -> label
        self.decode: Any = None  # the loaded tokenizer's decode (kvstore.reasons' texts)
        # prompts with images: id of the prompt list `_tokenize` gave (a context's prompt) ->
        # (that list, the key mlx-lm's cache holds it by), until its call's record takes it
        self._image_keys: OrderedDict[int, tuple[Any, list[int]]] = OrderedDict()
        self._image_lock = threading.Lock()

    def recorded(self, ctx: Any, responses: Iterator[Any]) -> Iterator[Any]:
        """`responses` (a request's tokens, as mlx_lm.server's handler reads them), recording the
        request's prefill stats in the ledger when it ends (kvstore.client.callstats, as the
        library's calls are): its prompt, the tokens the cache served, prefill and decode
        seconds."""
        t0 = time.perf_counter()
        first = None
        n = 0
        try:
            for r in responses:
                if first is None:
                    first = time.perf_counter()
                n += 1
                yield r
        finally:
            end = time.perf_counter()
            first = end if first is None else first
            self.record_call(ctx, first - t0, end - first, n)

    def record_call(self, ctx: Any, prefill_s: float, decode_s: float, generated: int) -> None:
        if self.warm_up.take_context(ctx):
            return  # a warm-up request: not a call
        given = getattr(ctx, "prompt", None) or []
        prompt = list(given)
        key = self.image_key_of(given, len(prompt)) or prompt  # what the cache keys it by
        took = self.tier.fetch_record(key)
        split = took.split  # a learned split's: prefill, not cache
        cached = max(0, int(getattr(ctx, "prompt_cache_count", 0) or 0) - split)
        if split:  # read for usage.prompt_tokens_details.cached_tokens after this
            ctx.prompt_cache_count = cached
        if self.stats is None or not prompt:
            return
        label = pin_served(self.labels, prompt, cached)
        with self.lock:
            self.stats.record(
                label=f"serve:{self.labels[label]}" if label is not None else "serve",
                prompt_tokens=len(prompt),
                cached_tokens=min(cached, len(prompt)),
                prefill_s=prefill_s,
                decode_s=decode_s,
                generated_tokens=generated,
                prompt=key,  # attributed by the cache's key: another image is new content
                pins=dict(self.labels),
                decode=self.decode,
                fleet_tokens=took.fleet,
            )

    def tokenized(self, out: tuple) -> None:
        """A request's `_tokenize` result: for a prompt with images, the key mlx-lm's cache
        fetches and inserts it under (kvstore.mlxlm.image_cache_key) is kept for its call's
        record, found by the prompt list the request's context holds."""
        key = mlxlm.image_cache_key(out)
        if key is None:
            return
        with self._image_lock:
            self._image_keys[id(out[0])] = (out[0], key)
            while len(self._image_keys) > IMAGE_PROMPTS:
                self._image_keys.popitem(last=False)

    def image_key_of(self, prompt: Any, n: int) -> list[int] | None:
        """The cache key `tokenized` kept for this prompt list (the very object, taken once),
        or None: a prompt without images, or a key that is not one of its `n` tokens."""
        if not self._image_keys:
            return None
        with self._image_lock:
            kept = self._image_keys.pop(id(prompt), None)
        if kept is None or kept[0] is not prompt or len(kept[1]) != n:
            return None
        return kept[1]

    def send(self) -> None:
        """The held-back stats records, to the daemon (batched as the library batches them)."""
        with self.lock:
            if self.stats is not None:
                self.stats.send()


class WarmUp:
    """The warm-up part: one throwaway request per pin of the loaded model, sent through the
    server itself (HTTP handler, chat template, fetch from the pin and the cold tier, prefill and
    first token), so a restarted server's first request per stage costs what a later one does.
    They leave nothing behind: the store tier keeps nothing of their prompts (its `quiet`), and
    their calls are not recorded. Which requests, contexts and prompts are its own."""

    def __init__(self) -> None:
        # the warm-up requests' prompts: the store tier serves them as requests, but counts,
        # reports, hits and keeps nothing of them
        self.prompts: list[tuple[int, ...]] = []
        self.warming = False  # the throwaway warm-up requests are in flight
        self.started = False  # their thread was started
        self.secret = secrets.token_hex(8)  # marks this server's own warm-up requests
        self.tokens: list[list[int] | None] = []  # each warm-up request's pin
        # mlx-lm's request and context objects of the warm-up requests in flight (by id: they
        # are neither hashable nor ours to mark): request -> its index; contexts
        self.requests: dict[int, int] = {}
        self.contexts: set[int] = set()

    def send(
        self, cli_args: Any, pins: Sequence[tuple[int, ...]], stopped: Callable[[], bool]
    ) -> None:
        """One request per pin (one plain request when there is none), in turn, until `stopped`;
        a failure is logged, never raised (an optimisation never keeps the server down)."""
        t0 = time.perf_counter()
        self.tokens = [list(t) for t in pins] or [None]
        done = 0
        self.warming = True
        n = len(self.tokens)
        try:
            with serve_hook(lambda: f"kvstore: warm-up request failed ({done} of {n} done)"):
                for i in range(n):
                    if stopped():
                        return
                    self._send_one(cli_args, i)
                    done += 1
                log.info("kvstore: %s through the server in %.3f s",
                         counted(done, "warm-up request"), time.perf_counter() - t0)  # fmt: skip
        finally:
            self.warming = False
            self.prompts.clear()
            self.requests.clear()
            self.contexts.clear()

    def _send_one(self, cli_args: Any, i: int) -> None:
        import http.client

        host = getattr(cli_args, "host", None) or "127.0.0.1"
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        port = int(getattr(cli_args, "port", 8080))
        body = json.dumps({
            "messages": [{"role": "system", "content": WARM_UP_TEXT},
                         {"role": "user", "content": WARM_UP_TEXT}],
            "max_tokens": 2,
            "temperature": 0.0,
        }).encode()  # fmt: skip
        deadline = time.monotonic() + WARM_UP_CONNECT_S
        while True:  # the main thread may still be binding the server's socket
            conn = http.client.HTTPConnection(host, port, timeout=WARM_UP_TIMEOUT_S)
            try:
                conn.request(
                    "POST",
                    "/v1/chat/completions",
                    body=body,
                    headers={
                        "Content-Type": "application/json",
                        WARM_UP_HEADER: f"{self.secret}:{i}",
                    },
                )
                reply = conn.getresponse()
                data = reply.read()
                if reply.status != 200:
                    raise ServeError(f"HTTP {reply.status}: {data[:200]!r}")
                return
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            finally:
                conn.close()

    def index(self, headers: Any) -> int | None:
        """The warm-up request's index when these HTTP headers mark one of this server's."""
        mark = headers.get(WARM_UP_HEADER) if headers is not None else None
        if not mark or not self.warming:
            return None
        secret, _, i = str(mark).partition(":")
        return int(i) if secret == self.secret and i.isdigit() else None

    def mark(self, request: Any, i: int) -> None:
        """mlx-lm's request object of warm-up request `i` (its handler made it)."""
        self.requests[id(request)] = i

    def of(self, request: Any) -> int | None:
        """The warm-up index of mlx-lm's request object, or None for a real request."""
        return self.requests.get(id(request)) if self.warming else None

    def take(self, request: Any) -> int | None:
        """`of`, forgetting the request (its tokenizing is its last use: an id may be reused by a
        later object)."""
        return self.requests.pop(id(request), None) if self.warming else None

    def mark_context(self, ctx: Any) -> None:
        self.contexts.add(id(ctx))

    def take_context(self, ctx: Any) -> bool:
        """Whether `ctx` is a warm-up request's context (forgotten: its call ends here)."""
        if id(ctx) not in self.contexts:
            return False
        self.contexts.discard(id(ctx))
        return True

    def tokenize(self, out: tuple, i: int) -> tuple:
        """The warm-up request `i`'s prompt: pin i's tokens, then the rendered user turn."""
        prompt, segments, types, *rest = out
        pin = self.tokens[i] if i < len(self.tokens) else None
        if pin is not None:
            tail = list(segments[-1]) if types and types[-1] != "system" else list(prompt[-16:])
            out = (pin + tail, [pin, tail], ["system", "user"], *rest)
        self.prompts.append(tuple(out[0]))
        return out


class _Hooks:
    """One server's hooks, composed of named parts, each its own object: the store tier the
    server's prompt cache asks (`tier`; the cache itself once the server built it, `cache`), the
    learning part (`learner`, a Learner; None with --no-learn), the persist part (`persister`,
    with --persist-system-prompts: the system segment's stable cut and its puts), the record of
    each call (`calls`), the warm-up requests (`warm_up`), /metrics' learned gauges (`gauges`),
    and the one write-behind queue to the daemon they share (`writer`). What is left here: the
    model's load and hydrate, the flush timer, and stopping the server."""

    def __init__(
        self, home: Path, persist: bool, model_config: dict | None = None, learn: bool = True
    ):
        self.home = home
        self.model_config = model_config
        # one queue and one connection to the daemon: hits, prefill stats, learned prefixes and
        # system prompts (the library's write-behind path, kvstore.client.writebehind)
        self.writer = WriteBehind(home, maxsize=LEARN_QUEUE)
        self.learner = Learner(home, writer=self.writer) if learn else None
        boundary = StableSystemSegment() if persist else None
        self.persister = SystemPromptPersister(home, self.writer, boundary) if persist else None
        self.warm_up = WarmUp()
        # what the server's prompt cache asks of the store (restore, count, learn, hits, offer)
        self.tier = StoreTier(
            learner=self.learner,
            writer=self.writer,
            # --persist-system-prompts
            on_insert=self.persister.on_insert if self.persister is not None else None,
            quiet=self.warm_up.prompts,
        )
        self.cache: PinnedPromptCache | None = None  # the one mlx_lm.server builds
        self.calls = CallRecords(self.tier, self.warm_up)
        self.gauges = LearnedGauges(home)  # /metrics' learned gauges, read from the store
        self.ready = False  # /health answers 503 until the model is loaded, hydrated and warm
        self.fatal: str | None = None  # why the server stops (its model cannot load)
        self._stopped = threading.Event()
        # held-back hits and stats records leave within HIT_BATCH_S even when no request follows
        self._flusher = threading.Thread(target=self._flush_every, name="kvstore-serve-flush",
                                         daemon=True)  # fmt: skip
        self._flusher.start()

    @property
    def boundary(self) -> StableSystemSegment | None:
        """The persist part's stable cut of the system segment (None without it)."""
        return self.persister.boundary if self.persister is not None else None

    def _flush_every(self) -> None:
        while not self._stopped.wait(HIT_BATCH_S):
            # never let the timer die silently; never stop the server
            with serve_hook("kvstore: flushing hits and stats", level=logging.DEBUG):
                self.flush()
                self.tier.refresh()  # so that a request memory serves reads nothing of the store

    def close(self, timeout: float) -> None:
        """Stop the timer, send what is held back, and wait for the write-behind (at most
        `timeout`)."""
        self._stopped.set()
        self.flush()
        self.writer.close(timeout)
        self.gauges.close()

    def flush(self) -> None:
        """Send the held-back hits and stats records (batched as the library batches them)."""
        self.tier.send_hits()
        self.calls.send()

    def stop_with(self, why: str) -> None:
        """Stop the server (the main thread's serve_forever, as Ctrl-C does): `why` is the one
        line `kvstore serve` exits with."""
        import _thread

        self.fatal = why
        threading.Thread(target=self._exit_if_stuck, args=(why,), name="kvstore-stop-watchdog",
                         daemon=True).start()  # fmt: skip
        _thread.interrupt_main()

    @staticmethod
    def _exit_if_stuck(why: str) -> None:
        """The failsafe of `stop_with`: a server that has not exited STOP_GRACE_S after it was
        told to stop (its main thread stuck, or a thread mlx-lm joins) leaves with the same one
        line and exit status, so a supervisor restarts it."""
        time.sleep(STOP_GRACE_S)
        sys.stderr.write(f"Error: kvstore serve: {why} (still running {STOP_GRACE_S:.0f} s after "
                         "it was told to stop: exiting)\n")  # fmt: skip
        sys.stderr.flush()
        os._exit(1)

    def identity(self, model_path: Any, adapter: Any, args: Any) -> ModelIdentity:
        """The served model as its entries are keyed: the server's KV quantization options
        (mlx-lm 0.31's server has none: its KV is never quantized, so generate's defaults) and
        the overrides `kvstore serve` loads it with."""
        return ModelIdentity(
            str(model_path),
            adapter,
            kv_bits=getattr(args, "kv_bits", None),
            kv_group_size=getattr(args, "kv_group_size", DEFAULT_KV_GROUP_SIZE),
            quantized_kv_start=getattr(args, "quantized_kv_start", DEFAULT_QUANTIZED_KV_START),
            model_config=self.model_config,
        )

    def on_load(self, provider: Any, prefetched: Prefetched | None = None) -> None:
        try:
            self._on_load(provider, prefetched)
        finally:
            # No in-process forward pass first: the warm-up requests run the first kernels at the
            # shapes a request has, so a pass before them would only add its own time to the start.
            if not self.ready and not self.warm_up.started:
                # the requests go through the server itself: a thread of their own (this is the
                # generation thread, which serves them), /health at 503 until they are answered
                self.warm_up.started = True
                threading.Thread(target=self.send_warm_ups, args=(provider,),
                                 name="kvstore-warm-up", daemon=True).start()  # fmt: skip

    def send_warm_ups(self, provider: Any) -> None:
        """The warm-up requests of the loaded model's pins (kvstore.client.serve.warmup); then
        /health answers 200."""
        pins = sorted(self.cache.pins_of(provider.model_key)) if self.cache is not None else []
        try:
            self.warm_up.send(provider.cli_args, pins, lambda: self.fatal is not None)
        finally:
            self.gauges.refresh(force=True)
            self.ready = True
            log.info("kvstore: ready (%s)", provider.model_key[0])

    def _on_load(self, provider: Any, prefetched: Prefetched | None = None) -> None:
        key = provider.model_key
        model_path, adapter, draft = key
        if self.cache is None:
            log.error(
                "kvstore: mlx_lm.server built no LRUPromptCache that kvstore could see; "
                "serving without stored prefixes"
            )
            return
        if draft is not None or getattr(provider, "is_distributed", False):
            # A draft model's cache is appended to the model's; stored entries hold only the latter.
            log.warning(
                "kvstore: not hydrating %s: draft models and distributed serving are "
                "not supported; prefilling as usual",
                model_path,
            )
            return
        args = provider.cli_args
        identity = self.identity(model_path, adapter, args)
        if prefetched is None:
            prefetched = prefetch(identity, home=self.home, model=provider.model)
        self.cache.keep_pins(key, [meta for meta, _ in prefetched.entries if meta.pinned])
        labels = {tuple(meta.token_ids()): meta.label for meta, _ in prefetched.entries}
        dated = {tuple(m.token_ids()): m.valid_date for m, _ in prefetched.entries if m.valid_date}
        fingerprint = prefetched.report.fingerprint
        self.tier.serving(key, bytes.fromhex(fingerprint) if fingerprint else None)
        report = insert(
            self.cache, key, prefetched, model=provider.model, size_option="--prompt-cache-size"
        )
        calls = self.calls
        calls.labels = labels
        with calls.lock:
            if calls.stats is not None:
                calls.stats.close()  # the last model's unsent records
            stats = StatsRecorder(str(model_path), writer=self.writer, keep_calls=SERVE_CALLS)
            calls.stats = stats
            parts = prefetched.fingerprint.parts if prefetched.fingerprint is not None else None
            after_hydrate(stats.attribute, report, self.home, str(model_path), dated, parts,
                          provider.tokenizer)  # fmt: skip
            stats.attribute.learner = self.learner
        pins = self.cache.pins_of(key)
        if pins:
            log.info(
                "kvstore: %s (%s, %.1f MiB of KV) of %s kept resident, outside "
                "--prompt-cache-size and --prompt-cache-bytes",
                counted(len(pins), "pin"),
                counted(sum(len(t) for t in pins), "token"),
                sum(pins.values()) / 2**20,
                model_path,
            )
        if not (report.warning and not report.entries):  # hydrate already said why not
            log.info(
                "kvstore: hydrated %s (%s) for %s in %.2fs%s",
                counted(report.entries, "entry"),
                counted(report.tokens, "token"),
                model_path,
                report.seconds,
                f": {', '.join(report.labels)}" if report.labels else "",
            )
        if report.fingerprint:
            self._check_template_args(report.fingerprint, args)
        if report.fingerprint and (self.learner is not None or self.persister is not None):
            target = self._target(provider, identity, bytes.fromhex(report.fingerprint))
            if prefetched.fingerprint is not None:  # what a later `model_changed` names
                target.extra["fingerprint_parts"] = dict(prefetched.fingerprint.parts)
            if self.learner is not None:
                self.learner.add_target(key, target)
                t0 = time.perf_counter()
                if preloaded := self.learner.preload_chains(key):
                    for tokens, kv in preloaded:
                        self.cache.insert_stored(key, tokens, kv)
                    dt = time.perf_counter() - t0
                    log.info("kvstore: %s read into memory in %.3f s",
                             counted(len(preloaded), "learned chain"), dt)  # fmt: skip
            if self.persister is not None:
                self.persister.targets[key] = target

    def _target(self, provider: Any, identity: ModelIdentity, fingerprint: bytes) -> LearnTarget:
        """The loaded model as learning and --persist-system-prompts file its entries."""
        from kvstore.identity.codehash import runtime_versions
        from kvstore.identity.fingerprint import resolve_model_path, template_hash

        model_path, args = provider.model_key[0], provider.cli_args
        persisting = self.persister is not None
        return LearnTarget(
            fingerprint=fingerprint,
            model=str(model_path),
            model_obj=provider.model,
            extra={**identity.state, "owners": ["serve"], "runtime": runtime_versions()},
            kv_bits=identity.kv_bits,
            prefill_step=getattr(args, "prefill_step_size", 2048) or 2048,
            # persisted entries need it now; learning computes it on its worker when first needed
            template_hash=template_hash(resolve_model_path(model_path)) if persisting else None,
            identity=identity,
        )

    def _check_template_args(self, fingerprint: str, args: Any) -> None:
        from kvstore.store.store import Store

        try:
            with Store(self.home, readonly=True) as store:
                metas = store.metas(bytes.fromhex(fingerprint), errors=[])
        except KVStoreError:
            return  # hydrate has said why already
        warning = template_args_warning(metas, getattr(args, "chat_template_args", None))
        if warning:
            log.warning("%s", warning)


def _cause(e: BaseException, model_path: Any = None) -> str:
    """Why a model did not load, in one line: a local path that is not a directory says so (not
    the hub's complaint about a repo id); else the exception's first line, named by its type."""
    p = Path(str(model_path)).expanduser() if model_path is not None else None
    if p is not None and str(model_path).startswith((".", "/", "~")) and not p.is_dir():
        return f"no such directory ({p.resolve()})"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _subclasses(server: Any, hooks: _Hooks) -> tuple[type, type, type, type]:
    """The classes serve installs in `server`: model provider, prompt cache, response generator
    and HTTP handler. Each is mlx-lm's class with the methods below (module functions; mlx-lm's
    private ones through kvstore.mlxlm.overriding) and `hooks` as its class attribute."""
    provider = mlxlm.overriding(server.ModelProvider, _load=_provider_load)
    generator = mlxlm.overriding(
        server.ResponseGenerator, _generate=_generate_loop, _tokenize=_tokenize
    )
    return (
        _with_hooks(provider, hooks),
        _with_hooks(PinnedPromptCache, hooks, "PersistentServerCache", __init__=_cache_init),
        _with_hooks(generator, hooks, generate=_generate),
        _with_hooks(
            server.APIHandler,
            hooks,
            "KVStoreHandler",
            __doc__=_HANDLER_DOC,
            handle_chat_completions=_handle_chat_completions,
            do_GET=_do_get,
            do_POST=_do_post,
            _starting=_starting,
        ),
    )


def _with_hooks(base: type, hooks: _Hooks, name: str = "", **methods: Any) -> type:
    """`base` subclassed with `methods` and `hooks` (what its methods reach as `self.hooks`)."""
    return type(name or base.__name__, (base,), {"hooks": hooks, **methods})


def _cache_init(self: Any, max_size: int = 10, max_bytes: int = 1 << 63) -> None:
    """The class mlx_lm.server builds its prompt cache from (`LRUPromptCache(max_size[,
    max_bytes])`): the client's PinnedPromptCache given serve's store tier. It overrides nothing
    else; the instance is the one the hooks hydrate."""
    PinnedPromptCache.__init__(self, max_size, max_bytes, tier=self.hooks.tier)
    self.hooks.cache = self


def _generate(self: Any, request: Any, generation_args: Any, *a: Any, **kw: Any) -> Any:
    """mlx-lm's ResponseGenerator.generate, its responses recorded as a call when they end."""
    hooks = self.hooks
    warm = hooks.warm_up.of(request)  # before: tokenizing it (in there) forgets it
    ctx, responses = mlxlm.plain(self, "generate")(request, generation_args, *a, **kw)
    if warm is not None:
        hooks.warm_up.mark_context(ctx)
    return ctx, hooks.calls.recorded(ctx, responses)


def _generate_loop(self: Any) -> None:
    # mlx-lm's generation thread: when it dies the server answers nothing and /health
    # says 503 forever, which no supervisor restarts. Stop with one line instead.
    what = "mlx_lm.server's generation thread died"
    with serve_hook(f"kvstore: {what}", level=logging.DEBUG) as failed:
        mlxlm.plain(self, "_generate")()
    if (e := failed.error) is not None:
        self.hooks.stop_with(f"{what}: {type(e).__name__}: {e}")


def _tokenize(self: Any, tokenizer: Any, request: Any, args: Any) -> Any:
    hooks = self.hooks
    out = mlxlm.plain(self, "_tokenize")(tokenizer, request, args)
    hooks.calls.decode = getattr(tokenizer, "decode", None)  # a diverged reason's text
    hooks.calls.tokenized(out)  # with images: the key its cache entry has (its reasons')
    warm = hooks.warm_up.take(request)
    if warm is not None:
        return hooks.warm_up.tokenize(out, warm)
    if hooks.boundary is None or _pinned_past_cut(hooks, self.model_provider.model_key, out):
        return out
    with serve_hook("kvstore: keeping mlx-lm's system segment"):  # never fail the request
        cli_args = self.model_provider.cli_args
        return hooks.boundary.resegment(tokenizer, request, args, cli_args, out)
    return out


def _pinned_past_cut(hooks: _Hooks, model_key: Any, out: tuple) -> bool:
    """Whether re-cutting this request's system segment changes nothing: it has none, or a pin it
    starts with covers mlx-lm's segment, which holds kvstore's cut of it (the boundary's `cuts`,
    from an earlier request with this segment). The cache then serves past both: no system segment
    is prefilled, inserted or persisted, cut or not (a pin hit enters no persist code). A segment
    short of kvstore's cut (a template whose empty user turn branches early) is always re-cut."""
    prompt, segments, types = out[0], out[1], out[2]
    if not types or types[0] != "system":
        return True  # resegment keeps it as it is
    n = len(segments[0])
    cut = hooks.boundary.cuts.get(tuple(segments[0])) if hooks.boundary is not None else None
    if cut is None or cut > n or hooks.cache is None:
        return False
    return any(n <= len(p) < len(prompt) and tuple(prompt[: len(p)]) == p
               for p in hooks.cache.pins_of(model_key))  # fmt: skip


_HANDLER_DOC = """mlx-lm's handler, plus `GET /metrics`; until serve is ready (hydrated, warm-up
requests and fleet checks done) `/health`, `/v1/models` and every request answer 503 with
Retry-After."""


def _handle_chat_completions(self: Any) -> Any:
    request = mlxlm.plain(self, "handle_chat_completions")()
    warm = self.hooks.warm_up.index(self.headers)
    if warm is not None:
        self.hooks.warm_up.mark(request, warm)  # this server's own (WarmUp.send)
    return request


def _do_get(self: Any) -> None:
    hooks = self.hooks
    if self.path == "/metrics":
        from kvstore.metrics import reply_metrics

        hooks.gauges.refresh()  # at most every few seconds, never a scan per scrape
        reply_metrics(self)
        return
    if not hooks.ready and (self.path == "/health" or self.path.startswith("/v1/models")):
        self._starting()  # what clients and load balancers poll: ready means ready
        return
    mlxlm.plain(self, "do_GET")()


def _do_post(self: Any) -> None:
    # A request before the warm-up requests and fleet checks are done would run beside them at
    # several times a steady request's cost: told to come back instead. The warm-up requests
    # themselves carry this server's header.
    hooks = self.hooks
    if not hooks.ready and hooks.warm_up.index(self.headers) is None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(min(length, 1 << 26))  # the body, so the connection stays sound
        self._starting()
        return
    mlxlm.plain(self, "do_POST")()


def _starting(self: Any) -> None:
    body = json.dumps({"status": "starting"}).encode()
    self.send_response(503)
    self.send_header("Content-Type", "application/json")
    self.send_header("Retry-After", "1")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)


def _provider_load(
    self: Any,
    model_path: Any,
    adapter_path: Any = None,
    draft_model_path: Any = None,
    **kw: Any,
) -> None:
    """mlx-lm's ModelProvider._load, hydrating as it loads (the class's `hooks`)."""
    hooks = self.hooks
    # The store's entries are read on a second thread while the weights load (as
    # kvstore.client.load does; why that is safe with mlx: client/load.py).
    read: dict[str, Any] = {}
    reader = before = None
    if draft_model_path is None and not getattr(self, "is_distributed", False):
        identity = hooks.identity(model_path, adapter_path, self.cli_args)
        # file identity before mlx-lm reads the files
        before = fingerprint_files(identity, home=hooks.home)
        reader = threading.Thread(
            target=lambda: read.update(entries=prefetch(identity, home=hooks.home)),
            name="kvstore-prefetch",
            daemon=True,
        )
        reader.start()
    held = mlxlm.provider_state(self)
    last = held.get("model_key")
    # mlx_lm.server has no model_config option: give it to this load
    from mlx_lm import server

    config = mlxlm.load_with_config(server, model_path, hooks.model_config)
    try:
        with serve_hook("kvstore: model load failed", level=logging.DEBUG) as failed:
            with config:
                mlxlm.plain(self, "_load")(model_path, adapter_path, draft_model_path, **kw)
        if failed.error is not None:
            why = f"cannot load model {model_path}: {_cause(failed.error, model_path)}"
            if last is None and model_path == getattr(self.cli_args, "model", None):
                if hooks.fatal is None:  # the server's own model: nothing to serve, stop
                    hooks.stop_with(why)
                    return  # not raised: mlx-lm would log a traceback
            # a model asked for by one request: that request's error; the last model stays
            for n, v in held.items():
                setattr(self, n, v)
            log.warning("kvstore: %s (a request asked for it)", why)
            raise ServeError(
                why + (f"; still serving {last[0]}" if last is not None else "")
            ) from None
    finally:
        if reader is not None:
            reader.join()
    entries = read.get("entries")
    if reader is not None and not (
        tag_loaded(self.model, before, model_path)
        and entries is not None
        and before is not None
        and entries.report.fingerprint == before.hex
    ):
        entries = None  # read under other files: hydrate re-reads (and refuses) with it
    hooks.on_load(self, entries)


@contextlib.contextmanager
def patched_server(
    home: Path,
    *,
    persist: bool = False,
    model_config: dict | None = None,
    learn: bool = True,
    hooks_out: list | None = None,
) -> Iterator[ModuleType]:
    """mlx_lm.server with the kvstore hooks installed; restored on exit. `model_config` overrides
    are given to mlx_lm.load for the served model (mlx_lm.server has no option for them);
    `learn` reports prompts to the daemon and restores from the store on a memory miss.
    `hooks_out`, if given, receives the hooks (their learner, for the caller's shutdown)."""
    from mlx_lm import server

    check_server_shape(server)
    if model_config and not callable(getattr(server, "load", None)):
        raise ServeError("mlx_lm.server no longer calls load(); --model-config cannot apply")
    hooks = _Hooks(home, persist, model_config, learn=learn)
    if hooks_out is not None:
        hooks_out.append(hooks)
    # the generator: per-request stats and --persist-system-prompts' cut
    with mlxlm.installed(server, *_subclasses(server, hooks)):
        yield server
