"""The request path's budget (issue 35 item 3, issue 42 item 5): on a pin hit, one request through
`kvstore serve`'s real HTTP handler (learning on, as serve's default, and once with
--persist-system-prompts) enters at most 8 kvstore modules on each of its threads (the handler's
and mlx-lm's generation thread), what learning hands to other threads is counted apart, and no
thread calls back into a kvstore module already up its stack; a library `generate` enters at most
5. Neither reads settings or a block store when memory served it. Measured with the profiler on
every thread the request runs on, so it cannot creep back unseen."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers import CLASSIFY, SERVE_START_TIMEOUT, TWO_PINS, Proc, manifest_for, serving, wait_for
from helpers import _free_port as free_port

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
    """Each thread's kvstore modules while `recording`; the stack is followed from the thread's
    start (or `run`'s), so a call back into a module entered before recording counts too."""

    threads: dict[str, ThreadTrace] = field(default_factory=dict)
    recording: bool = True
    local: threading.local = field(default_factory=threading.local)

    @property
    def modules(self) -> set[str]:
        return set().union(*(t.modules for t in self.threads.values()))

    @property
    def transitions(self) -> int:
        return sum(t.transitions for t in self.threads.values())

    @property
    def reentries(self) -> list[str]:
        return [r for t in self.threads.values() for r in t.reentries]

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        local = self.local
        if not hasattr(local, "stack"):  # a thread started under threading.setprofile
            local.stack, local.name = [], threading.current_thread().name
        stack: list[str | None] = local.stack  # each frame's kvstore module (None: not kvstore)
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            module = name if name == "kvstore" or name.startswith("kvstore.") else None
            if module is not None and self.recording:
                trace = self.threads.setdefault(local.name, ThreadTrace())
                caller = next((m for m in reversed(stack) if m is not None), None)
                if caller is not None and caller != module:
                    trace.transitions += 1
                    if module in stack:
                        trace.reentries.append(f"{caller} -> {module}.{frame.f_code.co_name}")
                trace.modules.add(module)
            stack.append(module)
        elif event == "return" and stack:
            stack.pop()

    def run(self, thread: str, work: Callable[[], Any]) -> Any:
        """Run `work` on this thread with the profiler on, recorded under `thread`."""
        self.local.stack, self.local.name = [], thread
        sys.setprofile(self.profile)
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


def role(thread: str) -> str:
    """A thread of `kvstore serve` by what it runs: mlx_lm.server's HTTP handler of a request
    (ThreadingHTTPServer's), its generation thread, or another (learning's, the write-behind's)."""
    if "process_request_thread" in thread:
        return "request"
    return "generation" if "generate" in thread else "other"  # 0.32: _run_generate; 0.31: ours


@contextlib.contextmanager
def served(home: Path, model: Path, trace: RequestTrace, *options: str) -> Iterator[str]:
    """`kvstore serve`'s server (mlx_lm.server's main as patched_server hooks it, learning on
    unless told) on a thread of this process, every thread it starts profiled by `trace`; the
    URL once /health says ready. Stopped (server and generation thread) on exit."""
    from kvstore.client.serve.hooks import patched_server

    port, got, running = free_port(), [], []
    threading.setprofile(trace.profile)  # before the hooks start their threads
    try:
        with patched_server(
            home, persist="--persist-system-prompts" in options, hooks_out=got
        ) as server:
            plain = server._run_http_server  # serve's own (its handler): given a server we can stop

            def http(host: str, port: int, generator: Any, **kw: Any) -> None:
                running.append(generator)
                plain(host, port, generator, server_class=Stoppable, **kw)

            server._run_http_server = http
            argv, sys.argv = sys.argv, ["mlx_lm.server", "--model", str(model), "--port", str(port)]
            main = threading.Thread(target=server.main, name="serve-main")
            try:
                main.start()
                url = f"http://127.0.0.1:{port}"
                wait_for(lambda: health(url), SERVE_START_TIMEOUT, lambda: "serve never got ready")
                sys.argv = argv
                yield url
            finally:
                sys.argv = argv
                for httpd in Stoppable.made:
                    httpd.shutdown()
                Stoppable.made.clear()
                for generator in running:
                    generator.stop_and_join()
                main.join(30)
                for hooks in got:
                    hooks.close(2.0)
                    if hooks.learner is not None:
                        hooks.learner.close(2.0)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]


class Stoppable(ThreadingHTTPServer):
    """mlx_lm.server's HTTP server, kept where the test can shut it down."""

    made: list[ThreadingHTTPServer] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Stoppable.made.append(self)


def health(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def chat(url: str, user: str) -> int:
    """One chat request after the `classify` pin over HTTP; the tokens the cache served."""
    turns = [{"role": "system", "content": CLASSIFY}, {"role": "user", "content": user}]
    body = {"messages": turns, "max_tokens": 2, "temperature": 0.0}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["usage"]["prompt_tokens_details"]["cached_tokens"]


class OverBudget(AssertionError):
    """A thread of the request entered more kvstore modules than SERVE_MODULES."""


# With --persist-system-prompts a pin hit enters one more module than learning alone: the store
# tier offers the request's insert to the persister (client.serve.persist, which takes only a
# system segment). The system segment's re-cut (persist, under degrade's guard) is skipped once an
# earlier request with the same segment gave its cut and a pin covers both: 8 modules.
PERSIST = pytest.param(("--persist-system-prompts",), id="persist")


@pytest.mark.parametrize("options", [pytest.param((), id="learn"), PERSIST])
def test_a_served_request_on_a_pin_hit_stays_within_its_budget(llama_path, warmed, tmp_path,
                                                               options):  # fmt: skip
    """Through the real HTTP handler with serve's default options (learning on), and once with
    --persist-system-prompts: the request's own threads enter at most SERVE_MODULES kvstore
    modules each; what learning hands to other threads is counted apart; no thread calls back
    into a module up its stack."""
    trace = RequestTrace(recording=False)
    with serving(Proc(warmed, log=tmp_path / "daemon.log"), warm=False), \
            served(warmed, llama_path, trace, *options) as url:  # fmt: skip
        assert chat(url, "My invoice 2291 was charged twice.") > 0  # the first call
        time.sleep(1.0)  # what the first call handed to other threads is done
        trace.recording = True
        assert chat(url, "Where is my parcel?") > 0  # the pin served it
        time.sleep(0.5)  # the generation thread's insert after the reply
        trace.recording = False
    for name, t in trace.threads.items():
        print(f"\nserve {name} ({role(name)}): {len(t.modules)} modules, {t.transitions} "
              f"transitions: {sorted(t.modules)}; re-entries {t.reentries}")  # fmt: skip
    roles = {role(name) for name in trace.threads}
    assert {"request", "generation"} <= roles, sorted(trace.threads)
    assert not trace.reentries, trace.reentries
    own = {name: t for name, t in trace.threads.items() if role(name) != "other"}
    for name, t in own.items():
        assert not t.modules & set(NEVER_WHEN_MEMORY_SERVED), (name, sorted(t.modules))
    for name, t in sorted(own.items(), key=lambda item: role(item[0]) != "request"):
        if len(t.modules) > SERVE_MODULES:
            raise OverBudget(name, sorted(t.modules))


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
