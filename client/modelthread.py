"""One process-long thread for the model forward passes kvstore runs off the request path.

mlx 0.31 keeps `mx.compile`'s traces in a per-thread cache and frees them when the thread exits;
for a compiled function first traced on another thread it frees them without the GIL and the
process aborts ("PyThreadState_Get: the function must be called with the GIL held";
ml-explore/mlx#3619, fixed by #3628 after 0.31.2). Models with module-level compiled functions
(the Qwen3.5 layout's gated delta rule, for one) trace them on the app's thread, so any worker
that runs a forward and then exits - a write-behind closed by its cache, or at interpreter exit -
could take the app down. The forwards therefore run here: one daemon thread, started on first
use and never joined, so it ends with the process, where no thread-exit handler runs.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, TypeVar

from kvstore.degrade import settle

T = TypeVar("T")

NAME = "kvstore-model"

_lock = threading.Lock()
_jobs: queue.SimpleQueue | None = None


def call(fn: Callable[[], T]) -> T:
    """Run `fn` on the model thread (its own mlx stream); its result, or its error raised."""
    global _jobs
    with _lock:
        if _jobs is None:
            _jobs = queue.SimpleQueue()
            threading.Thread(target=_run, args=(_jobs,), name=NAME, daemon=True).start()
    done: Future = Future()
    _jobs.put((fn, done))
    return done.result()


def _run(jobs: queue.SimpleQueue) -> None:
    import mlx.core as mx

    stream = mx.new_stream(mx.default_device())  # mlx streams belong to the thread that made them

    def on_stream(fn: Callable[[], Any]) -> Any:
        with mx.stream(stream):
            return fn()

    while True:
        fn, done = jobs.get()
        settle(done, partial(on_stream, fn))  # handed to the caller, never the end of this thread
