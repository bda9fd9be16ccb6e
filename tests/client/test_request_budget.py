"""The request path's budget (issue 35 item 3): on a pin hit, one request through `kvstore serve`
enters at most 8 kvstore modules on each thread it runs on and a library `generate` at most 5,
never calls back into a kvstore module already up its stack, and reads no settings and no block
store when memory served it. Measured with `sys.setprofile` on each thread the request runs on,
so it cannot creep back unseen."""

from __future__ import annotations

import argparse
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from helpers import CLASSIFY, TWO_PINS, manifest_for
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache

from kvstore.ops.warm import warm
from kvstore.pins.manifest import load_manifest
from kvstore.store.store import Store

SERVE_MODULES = 8  # kvstore modules one served request enters on each of its threads, at most
LIBRARY_MODULES = 5  # kvstore modules one library `generate` enters, at most
NEVER_WHEN_MEMORY_SERVED = (
    "kvstore.home.settings",
    "kvstore.learned.blockstore",
    "kvstore.store.store",
)


@dataclass
class ThreadTrace:
    """The kvstore modules one thread entered, the calls between two of them, and re-entries
    (a call into a module that is already up the stack below another kvstore module)."""

    modules: set[str] = field(default_factory=set)
    transitions: int = 0
    reentries: list[str] = field(default_factory=list)


@dataclass
class RequestTrace:
    threads: dict[str, ThreadTrace] = field(default_factory=dict)

    @property
    def modules(self) -> set[str]:
        return set().union(*(t.modules for t in self.threads.values()))

    @property
    def transitions(self) -> int:
        return sum(t.transitions for t in self.threads.values())

    @property
    def reentries(self) -> list[str]:
        return [r for t in self.threads.values() for r in t.reentries]

    def run(self, thread: str, work: Callable[[], Any]) -> Any:
        """Run `work` on this thread with the profiler on, recorded under `thread`."""
        trace = self.threads.setdefault(thread, ThreadTrace())
        stack: list[str | None] = []  # each Python frame's kvstore module (None: not kvstore)

        def nearest() -> str | None:
            return next((m for m in reversed(stack) if m is not None), None)

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                name = frame.f_globals.get("__name__", "")
                module = name if name == "kvstore" or name.startswith("kvstore.") else None
                if module is not None:
                    caller = nearest()
                    if caller is not None and caller != module:
                        trace.transitions += 1
                        if module in stack:
                            trace.reentries.append(f"{caller} -> {module}.{frame.f_code.co_name}")
                    trace.modules.add(module)
                stack.append(module)
            elif event == "return" and stack:
                stack.pop()

        sys.setprofile(profile)
        try:
            return work()
        finally:
            sys.setprofile(None)

    def check(self, limit: int) -> None:
        assert not self.reentries, self.reentries
        for name, thread in self.threads.items():
            assert len(thread.modules) <= limit, (name, sorted(thread.modules))
        assert not self.modules & set(NEVER_WHEN_MEMORY_SERVED), sorted(self.modules)


def prompt_after_pin(tokenizer, user: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": CLASSIFY}, {"role": "user", "content": user}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def warmed(llama_path, kv_home, tmp_path):
    """A store holding the `classify` and `synthesize` pins of the tiny llama."""
    with Store(kv_home) as store:
        assert warm(load_manifest(manifest_for(tmp_path, llama_path, TWO_PINS)), store,
                    home=kv_home)  # fmt: skip
    return kv_home


def test_a_library_generate_on_a_pin_hit_stays_within_its_budget(llama, llama_path, warmed):
    from kvstore.client import PersistentPromptCache, generate

    model, tokenizer = llama
    prompt = prompt_after_pin(tokenizer, "My invoice 2291 was charged twice.")
    with PersistentPromptCache.open(model, tokenizer, llama_path, verbose=False) as cache:
        assert cache.report.entries == 2
        pin = cache.pin("classify", messages=[{"role": "system", "content": CLASSIFY}])
        assert pin.source == "memory" and prompt[: len(pin.tokens)] == list(pin.tokens)
        generate(cache, model, tokenizer, prompt, label="classify", max_tokens=2)  # first call
        again = prompt_after_pin(tokenizer, "Where is my parcel?")
        trace = RequestTrace()
        trace.run("caller", lambda: generate(cache, model, tokenizer, again, label="classify",
                                             max_tokens=2))  # fmt: skip
        assert cache.stats.calls[-1].cached_tokens > 0  # the pin served it
    print(f"\nlibrary generate: {len(trace.modules)} modules, {trace.transitions} transitions: "
          f"{sorted(trace.modules)}")  # fmt: skip
    trace.check(LIBRARY_MODULES)


def serve_request(model, tokenizer, cache, key, hooks, prompt: list[int]) -> RequestTrace:
    """One request as mlx_lm.server runs it: the handler thread reads the headers, the
    generation thread fetches, generates and inserts, the handler's response iterator records
    the call when it ends."""
    trace = RequestTrace()
    trace.run("handler", lambda: hooks.warm_up_index({}))
    ctx = types.SimpleNamespace(prompt=prompt, prompt_cache_count=0)
    out: list[int] = []

    def generation() -> None:
        kv, rest = cache.fetch_nearest_cache(key, prompt)
        ctx.prompt_cache_count = len(prompt) - len(rest)
        kv = kv if kv is not None else make_prompt_cache(model)
        for r in stream_generate(model, tokenizer, rest, max_tokens=2, prompt_cache=kv):
            out.append(r.token)
        cache.insert_cache(key, prompt + out, kv)

    worker = threading.Thread(target=lambda: trace.run("generation", generation))
    worker.start()
    worker.join()
    trace.run("handler", lambda: list(hooks.recorded(ctx, iter(out))))
    assert ctx.prompt_cache_count > 0  # the pin served it
    return trace


def test_a_served_request_on_a_pin_hit_stays_within_its_budget(llama, llama_path, warmed):
    from kvstore.client.serve.hooks import patched_server

    model, tokenizer = llama
    key = (str(llama_path), None, None)
    args = argparse.Namespace(host="127.0.0.1", port=0, prefill_step_size=2048)
    provider = types.SimpleNamespace(model_key=key, model=model, tokenizer=tokenizer, cli_args=args)
    got: list = []
    with patched_server(warmed, hooks_out=got) as server:
        (hooks,) = got
        hooks.warm_thread_started = hooks.ready = True  # no warm-up requests over HTTP here
        cache = server.LRUPromptCache(10)
        try:
            hooks.on_load(provider)
            assert len(cache.pins_of(key)) == 2  # the stored pins, kept as pins
            first = prompt_after_pin(tokenizer, "My invoice 2291 was charged twice.")
            serve_request(model, tokenizer, cache, key, hooks, first)
            again = prompt_after_pin(tokenizer, "Where is my parcel?")
            trace = serve_request(model, tokenizer, cache, key, hooks, again)
        finally:
            hooks.close(2.0)
            if hooks.learner is not None:
                hooks.learner.close(2.0)
    for name, t in trace.threads.items():
        print(f"\nserve {name}: {len(t.modules)} modules, {t.transitions} transitions: "
              f"{sorted(t.modules)}; re-entries {t.reentries}")  # fmt: skip
    print(f"serve: {len(trace.modules)} modules, {trace.transitions} transitions")
    trace.check(SERVE_MODULES)


def test_a_restore_from_the_store_never_calls_back_up_the_stack(llama, kv_home):
    """A miss the store serves (learned block records): the cache asks its tier, the tier its
    learner, and what is restored comes back as a value for the cache to keep; no module is
    called back while it is up the stack (the restore used to insert through the cache)."""
    from helpers import mlx_lm_prefill

    from kvstore.client.learn import Learner
    from kvstore.client.persistent import PinnedPromptCache
    from kvstore.learned.blockstore import BlockStore
    from kvstore.learned.chain import cuts
    from kvstore.learned.coldtier import LearnTarget
    from kvstore.learned.records import slice_record

    model, _ = llama
    fp = bytes(range(16))
    tokens = [(7 * i + 3) % 200 + 1 for i in range(400)]
    full = mlx_lm_prefill(model, tokens)
    with Store(kv_home) as store:
        records = [(s, e, slice_record(full, s, e)) for s, e in cuts(0, 400)]
        BlockStore(store).put_records(fp, tokens, records, label="learned")
    learner = Learner(kv_home, learn=False)
    learner.add_target("tiny", LearnTarget(fingerprint=fp, model="tiny", model_obj=model,
                                           extra={}))  # fmt: skip
    lru = PinnedPromptCache(max_size=2)
    lru.learner = learner
    try:
        trace = RequestTrace()
        _, rest = trace.run("generation", lambda: lru.fetch_nearest_cache("tiny", tokens + [7]))
        assert rest == [7]  # restored, not prefilled
        _, rest = lru.fetch_nearest_cache("tiny", tokens + [8])
        assert rest == [8]  # kept in memory by the cache
    finally:
        learner.close(timeout=2.0)
    assert not trace.reentries, trace.reentries
