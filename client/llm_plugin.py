"""The `llm` plugin: every model llm-mlx registers answers through kvstore's persistent cache.

Installed as the `kvstore` entry point of the `llm` group (pyproject.toml), so `llm` loads it
beside llm-mlx. `register_models` runs last (`trylast`) and puts a `KVStoreMlxModel` in place of
each llm-mlx `MlxModel`, under the same model id and aliases: `llm -m M ...`, `llm -c`, `llm chat`
and `llm logs` are unchanged, and faster.

What a call does, in its own process:
- `_load` loads the model with `kvstore.client.load` (mlx-lm's load, with the store's entries for
  the model hydrated while the weights load) into a `PersistentPromptCache` that learns recurring
  prefixes (`learn=True`, as `kvstore serve`) and persists each call's transcript
  (`persist_chains=True`): the next call with the same system prompt is served the prefix it
  shares with it, and a `-c` follow-up the whole first turn.
- `execute` builds the messages from llm's own conversation state (`prompt.messages`, the whole
  chain under llm >= 0.32, also across processes), renders them with the chat template as llm-mlx
  does, samples with llm-mlx's own defaults and generates through `kvstore.client.stream_generate`
  (only what the cache does not hold is prefilled). Usage goes to llm:
  `response.set_usage(input=, output=, details={"cached_tokens": n})`.
- No daemon holds the home: one is started for it, detached, as socket activation would
  (`start_daemon`, kvstore.client.writebehind); it stays for later calls. Writes are sent from the
  write-behind thread, flushed at exit.

Never a hard dependency: `KVSTORE_LLM=0` leaves llm-mlx's models as they are; another llm or
llm-mlx version than the ones tested (TESTED), or llm-mlx missing, is one warning line and plain
llm-mlx; a store, home or daemon fault is one warning line and the call answers as llm-mlx alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from importlib import metadata
from typing import Any

import llm

from kvstore.degrade import library_call

try:
    import llm_mlx
except ImportError:  # said once, at registration: nothing to wrap
    llm_mlx = None

log = logging.getLogger("kvstore.client")

TESTED = {"llm": "0.36", "llm-mlx": "0.4"}  # the versions this plugin is tested with: exactly
OFF_ENV = "KVSTORE_LLM"  # "0" (or off, false, no): llm-mlx's models are left as they are
LABEL = "llm"  # the label of each call's prefill stats (`kvstore stats`)
KEEP_CHAINS = 8  # a model's newest stored call transcripts kept: what each call's start hydrates

_said: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        log.warning("%s", text)


def refusal() -> str | None:
    """Why the plugin stays out of this `llm` (one line), "" when switched off, None when on."""
    if os.environ.get(OFF_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return ""
    found: dict[str, str | None] = {}
    for dist in TESTED:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    if found["llm-mlx"] is None or llm_mlx is None:
        return "kvstore: llm-mlx is not installed, so no MLX model to serve from the store"
    if found != TESTED:
        tested = " and ".join(f"{d} {v}" for d, v in TESTED.items())
        have = " and ".join(f"{d} {v}" for d, v in found.items())
        return (
            f"kvstore: the llm plugin is tested with {tested}, not {have}; answering with "
            f"llm-mlx alone ({OFF_ENV}=0 silences this)"
        )
    return None


@llm.hookimpl(trylast=True)
def register_models(register: Any, model_aliases: list) -> None:
    """Replace each model llm-mlx registered (it ran first: this hook is `trylast`) by a
    kvstore-backed one under the same id and aliases. llm resolves an id or alias to the last
    model registered under it; the replaced entry is taken out of the list so `llm models`
    lists each model once."""
    why = refusal()
    if why is not None:
        if why:
            _warn_once(why)
        return
    for entry in list(model_aliases):
        if type(entry.model) is llm_mlx.MlxModel:  # llm-mlx's own, not a subclass of another's
            register(KVStoreMlxModel(entry.model.model_path), aliases=entry.aliases)
            model_aliases.remove(entry)


_MlxModel: Any = llm_mlx.MlxModel if llm_mlx is not None else llm.Model


class KVStoreMlxModel(_MlxModel):
    """llm-mlx's `MlxModel` (same id, options and response fields) generating through a
    `PersistentPromptCache` of the model."""

    _model: Any  # llm-mlx's: the loaded model and tokenizer, None until `_load`
    _tokenizer: Any

    def __init__(self, model_path: str):
        super().__init__(model_path)
        self._cache: Any = None  # the PersistentPromptCache; None: plain mlx-lm (said once)

    def _load(self) -> tuple[Any, Any]:
        if self._model is None:
            from kvstore.client import load
            from kvstore.client.writebehind import spawn_daemon
            from kvstore.home.settings import home_problem, resolve_home

            home = resolve_home(None)
            if (problem := home_problem(home)) is not None:
                _warn_once(f"kvstore: not using the store: {problem}")
                return super()._load()
            # started now, it comes up while the weights load; the write-behind waits for it
            with library_call("kvstore: could not start the daemon"):
                spawn_daemon(home)
            # mlx-lm's own error, or kvstore's: said once below, after llm-mlx's load had its say
            with library_call("kvstore: load", level=logging.DEBUG) as failed:
                self._model, self._tokenizer, self._cache = load(
                    self.model_path, home=home, learn=True, persist_chains=True,
                    start_daemon=True, verbose=False, warm=False,
                )  # fmt: skip
            if failed.error is not None:
                self._model = self._cache = None
                model, tokenizer = super()._load()  # llm-mlx's load: its error, if it is one
                _warn_once(f"kvstore: not using the store for {self.model_path}: {failed.error}")
                return model, tokenizer
        return self._model, self._tokenizer

    def execute(self, prompt: Any, stream: bool, response: Any, conversation: Any) -> Iterator[str]:
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        model, tokenizer = self._load()
        ids = render(tokenizer, chat_messages(prompt))
        o = prompt.options
        sampler = make_sampler(
            llm_mlx.DEFAULT_TEMPERATURE if o.temperature is None else o.temperature,
            llm_mlx.DEFAULT_TOP_P if o.top_p is None else o.top_p,
            llm_mlx.DEFAULT_MIN_P if o.min_p is None else o.min_p,
            (
                llm_mlx.DEFAULT_MIN_TOKENS_TO_KEEP
                if o.min_tokens_to_keep is None
                else o.min_tokens_to_keep
            ),
        )
        if o.seed:
            mx.random.seed(o.seed)
        max_tokens = llm_mlx.DEFAULT_MAX_TOKENS if o.max_tokens is None else o.max_tokens
        if o.unlimited:
            max_tokens = -1
        chunk = None
        for chunk in self._generate(model, tokenizer, ids, sampler=sampler, max_tokens=max_tokens):
            yield chunk.text
        if chunk is None:
            return
        calls = self._cache.stats.calls if self._cache is not None and self._cache.stats else []
        cached = calls[-1].cached_tokens if calls else 0
        response.set_usage(
            input=len(ids), output=chunk.generation_tokens, details={"cached_tokens": cached}
        )
        self._keep_newest_chains()
        response.response_json = {  # llm-mlx's fields
            "prompt_tps": chunk.prompt_tps,
            "generation_tps": chunk.generation_tps,
            "peak_memory": chunk.peak_memory,
            "finish_reason": chunk.finish_reason,
        }

    def _keep_newest_chains(self) -> None:
        """After this call's transcript (queued before it), evict the model's older stored
        transcripts beyond KEEP_CHAINS through the daemon: each call hydrates them all at start."""
        from kvstore.client.writebehind import Job

        cache = self._cache
        if cache is None or cache.writer is None or cache.fingerprint is None:
            return
        home, fingerprint = cache.home, cache.fingerprint
        evict = Job("older transcripts", lambda c: evict_older_chains(c, home, fingerprint))
        cache.writer.submit(evict)

    def _generate(self, model: Any, tokenizer: Any, ids: list[int], **kwargs: Any) -> Iterator:
        """kvstore's stream_generate through the cache; mlx-lm's alone when kvstore fails before
        the first token (one warning line)."""
        import mlx_lm

        if self._cache is not None:
            from kvstore.client import stream_generate

            first = True
            # the cache must never take the call down before its first token
            with library_call("kvstore: generate", level=logging.DEBUG) as failed:
                for chunk in stream_generate(
                    self._cache, model, tokenizer, ids, label=LABEL, **kwargs
                ):
                    first = False
                    yield chunk
            if failed.error is None:
                return
            if not first:  # the answer was under way: its error is the call's
                raise failed.error
            _warn_once(
                f"kvstore: generating without the store for {self.model_path}: {failed.error}"
            )
            self._cache = None
        yield from mlx_lm.stream_generate(model, tokenizer, ids, **kwargs)


def evict_older_chains(client: Any, home: Any, fingerprint: bytes) -> int:
    """Evict the unpinned transcripts (`chain` entries) of the model with `fingerprint` but the
    KEEP_CHAINS most recently used, through the daemon's `evict`; how many. On the write-behind
    worker."""
    from kvstore.store.store import Store
    from kvstore.wire.messages import EvictRequest

    with Store(home, readonly=True) as store:
        chains = [m for m in store.metas(fingerprint, errors=[]) if m.label == "chain"]
    old = sorted((m for m in chains if not m.pinned), key=lambda m: m.last_used)[:-KEEP_CHAINS]
    if old:
        client.send(EvictRequest(keys=[m.key for m in old]))
    return len(old)


def chat_messages(prompt: Any) -> list[dict[str, str]]:
    """The chat-template messages of `prompt.messages`: llm's whole chain (system, earlier turns
    and this one), text parts only, as llm-mlx renders a conversation it holds in memory."""
    from llm.parts import TextPart

    messages = []
    for m in prompt.messages:
        if m.role in ("system", "user", "assistant"):
            text = "".join(p.text for p in m.parts if isinstance(p, TextPart))
            messages.append({"role": m.role, "content": text})
    return messages


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's token ids, rendered as llm-mlx renders them."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if isinstance(ids, Mapping):  # transformers 5 on a raw tokenizer: a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
