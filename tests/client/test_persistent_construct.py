"""PersistentPromptCache's constructor takes the values it holds and does no I/O; `open` does the
I/O (issue 35, item 6). An earlier checkout's call form fails at once, naming the new one."""

from __future__ import annotations

import sys
import threading

import pytest

from kvstore.client import PersistentPromptCache
from kvstore.client.persistent import CacheOptions
from kvstore.identity.model import ModelIdentity

# audit events of I/O: files, directories, sockets, processes, threads (sys.addaudithook)
IO_EVENTS = ("open", "os.", "socket.", "subprocess.", "_thread.start_new_thread", "shutil.")
_seen: list[str] | None = None  # recording when a list (an audit hook cannot be removed)


def _hook(event: str, args: tuple) -> None:
    if _seen is not None and event.startswith(IO_EVENTS):
        _seen.append(f"{event} {args!r:.120}")


sys.addaudithook(_hook)


def test_the_constructor_does_no_io(llama, llama_path, kv_home):
    global _seen
    model, tokenizer = llama
    identity = ModelIdentity(path=str(llama_path))
    PersistentPromptCache(model, tokenizer, identity, kv_home)  # its lazy imports, once
    threads = threading.active_count()
    _seen = []
    try:
        cache = PersistentPromptCache(
            model, tokenizer, identity, kv_home, CacheOptions(learn=True, persist_chains=True)
        )
    finally:
        seen, _seen = _seen, None
    assert seen == []
    assert threading.active_count() == threads
    assert not kv_home.exists() or not any(kv_home.iterdir())
    assert cache.home == kv_home and cache.identity is identity and cache.report.warning is None
    assert cache.stats is None and cache.learner is None and cache.fingerprint is None
    cache.close()  # nothing opened: nothing to close


@pytest.mark.parametrize(
    "form",
    [
        lambda m, t, p: PersistentPromptCache(m, t, p),
        lambda m, t, p: PersistentPromptCache(m, t, str(p), home=None),
        lambda m, t, p: PersistentPromptCache(m, t, ModelIdentity(path=str(p)), learn=True),
        lambda m, t, p: PersistentPromptCache(m, t, model_path=p),  # type: ignore[call-arg]
    ],
)
def test_the_old_call_form_names_the_new_one(llama, llama_path, form):
    model, tokenizer = llama
    threads = threading.active_count()
    with pytest.raises(TypeError, match=r"is now PersistentPromptCache\.open\(model, tokenizer"):
        form(model, tokenizer, llama_path)
    assert threading.active_count() == threads  # nothing half-built: no write-behind started


def test_open_returns_a_ready_cache(llama, llama_path, kv_home):
    model, tokenizer = llama
    with PersistentPromptCache.open(model, tokenizer, llama_path, home=kv_home) as cache:
        assert isinstance(cache, PersistentPromptCache)
        assert cache.fingerprint is not None and cache.stats is not None  # read and opened
        assert cache.home == kv_home and cache.identity.path == str(llama_path)
