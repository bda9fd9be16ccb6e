"""The `kvstore serve` hooks into mlx-lm's own OpenAI-compatible server (run by
kvstore.client.serve.command).

The server runs in-process, unchanged, with two of its module globals replaced for the duration
of `serve()` by thin subclasses:

- `mlx_lm.server.ModelProvider` -> hydrates the store's entries for a model right after
  `ModelProvider._load` loaded it, under the key the server uses (`ModelProvider.model_key`,
  the tuple (model_path, adapter_path, draft_model_path)).
- `mlx_lm.server.LRUPromptCache` -> the instance `mlx_lm.server.run` builds is the one hydrated;
  stored pins are kept in it as kvstore.client.persistent keeps them (PinnedPromptCache): outside
  the
  LRU's eviction, --prompt-cache-size and --prompt-cache-bytes, and put back when a conversation
  extends one, so every request a pin prefixes is served it whatever the churn; with
  --persist-system-prompts its `insert_cache(..., cache_type="system")` calls (the batched
  path snapshots the system-prompt segment under that type) are also sent to the daemon.

With --persist-system-prompts, `mlx_lm.server.ResponseGenerator` is replaced too: its `_tokenize`
re-cuts the system segment at kvstore's stable boundary (kvstore.client.serve.boundary).

Both generation paths then see the entries: the batched path and `_serve_single` both call
`prompt_cache.fetch_nearest_cache(model_provider.model_key, prompt)`, and `cached_tokens` is
`len(prompt) - len(rest)` of that call. `check_server_shape` verifies these assumptions up front.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvstore.client.hydrate import Prefetched, insert, prefetch
from kvstore.client.loader import fingerprint_files, tag_loaded
from kvstore.client.persistent import PinnedPromptCache
from kvstore.client.serve.boundary import StableSystemSegment, template_args_warning
from kvstore.client.serve.persist import SystemPromptPersister
from kvstore.errors import KVStoreError, counted
from kvstore.identity.model import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_QUANTIZED_KV_START,
    ModelIdentity,
)

log = logging.getLogger("kvstore.serve")


class ServeError(KVStoreError):
    """mlx_lm.server does not have the shape `kvstore serve` hooks into."""


def check_server_shape(server: Any) -> None:
    """Fail with one clear message when mlx_lm.server no longer looks like 0.31-0.32's."""
    problems = []
    for name in ("main", "run", "ModelProvider", "LRUPromptCache", "ResponseGenerator"):
        if not hasattr(server, name):
            problems.append(f"mlx_lm.server.{name} is missing")
    provider = getattr(server, "ModelProvider", None)
    for name in ("_load", "load"):
        if provider is not None and not callable(getattr(provider, name, None)):
            problems.append(f"ModelProvider.{name} is missing")
    lru = getattr(server, "LRUPromptCache", None)
    if lru is not None and not issubclass(PinnedPromptCache, lru):
        problems.append("mlx_lm.server.LRUPromptCache is not mlx_lm.models.cache's")
    if lru is not None:
        params = inspect.signature(lru.insert_cache).parameters
        if "cache_type" not in params:
            problems.append("LRUPromptCache.insert_cache has no cache_type keyword")
    try:
        run_src = inspect.getsource(server.run)
        load_src = inspect.getsource(provider._load)
    except (AttributeError, OSError, TypeError):
        run_src = load_src = ""
    generator = getattr(server, "ResponseGenerator", None)
    if generator is not None and not callable(getattr(generator, "_tokenize", None)):
        problems.append("ResponseGenerator._tokenize is missing")
    if "ResponseGenerator(" not in run_src:
        problems.append("mlx_lm.server.run no longer builds its ResponseGenerator by that name")
    if "LRUPromptCache(" not in run_src:
        problems.append("mlx_lm.server.run no longer builds its LRUPromptCache by that name")
    if "self.model_key =" not in load_src:
        problems.append("ModelProvider._load no longer sets model_key")
    if problems:
        import mlx_lm

        raise ServeError(
            f"kvstore serve does not support this mlx-lm ({mlx_lm.__version__}): "
            + "; ".join(problems)
            + ". Run plain `mlx_lm.server`, or install mlx-lm 0.31.3-0.32."
        )


class _Hooks:
    """What the two subclasses share: the server's one prompt cache and the persist target."""

    def __init__(self, home: Path, persist: bool, model_config: dict | None = None):
        self.home = home
        self.model_config = model_config
        self.cache: Any = None
        self.persister = SystemPromptPersister(home) if persist else None
        self.boundary = StableSystemSegment() if persist else None
        self.targets: dict[Any, dict[str, Any]] = {}  # model_key -> what a persisted entry needs

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
        report = insert(self.cache, key, prefetched)
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
        if self.persister is not None and report.fingerprint:
            from kvstore.identity.fingerprint import resolve_model_path, template_hash

            self.targets[key] = dict(
                fingerprint=bytes.fromhex(report.fingerprint),
                identity=identity,
                template_hash=template_hash(resolve_model_path(model_path)),
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

    def on_insert(self, model_key: Any, tokens: Sequence[int], cache: list, cache_type: str):
        target = self.targets.get(model_key)
        if self.persister is not None and cache_type == "system" and target is not None:
            try:
                extra = self.boundary.extra_for(tokens) if self.boundary is not None else {}
                self.persister.offer(target, tokens, cache, extra)
            except Exception as e:  # never fail the insert the server asked for
                log.warning("kvstore: not persisting a system prefix: %s", e)


def _subclasses(server: Any, hooks: _Hooks) -> tuple[type, type, type]:
    class PersistentModelProvider(server.ModelProvider):
        def _load(self, model_path, adapter_path=None, draft_model_path=None, **kw: Any) -> None:
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
            plain = server.load
            if hooks.model_config:  # mlx_lm.server has no model_config option: give it to this load

                def load(path, *a, **kw2):
                    if path == model_path:
                        kw2["model_config"] = {**(kw2.get("model_config") or {}),
                                               **hooks.model_config}  # fmt: skip
                    return plain(path, *a, **kw2)

                server.load = load
            try:
                super()._load(model_path, adapter_path, draft_model_path, **kw)
            finally:
                server.load = plain
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

    class PersistentServerCache(PinnedPromptCache):
        """The server's prompt cache; stored pins of the loaded model are kept as pins."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._to_pin: dict[tuple[Any, tuple[int, ...]], str] = {}  # -> label
            hooks.cache = self

        def keep_pins(self, model: Any, metas: Sequence[Any]) -> None:
            """The next inserts of these entries' tokens become pins. Pins of other models are
            let go: the server holds one model, and loading one again hydrates them again."""
            for m, tokens in [k for k in self._pins if k[0] != model]:
                self._trie.pop(m, list(tokens))
                del self._pins[(m, tokens)]
            self._to_pin = {(model, tuple(meta.token_ids())): meta.label for meta in metas}

        def pins_of(self, model: Any) -> dict[tuple[int, ...], int]:
            """This model's pins: tokens -> bytes of KV."""
            return {t: entry.nbytes for (m, t), (_, entry) in self._pins.items() if m == model}

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant") -> bool:
            label = self._to_pin.pop((model, tuple(tokens)), None)
            if label is not None:
                self.attach_pin(model, tokens, prompt_cache, label)
                return True
            if not super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type):
                return False
            hooks.on_insert(model, tokens, prompt_cache, cache_type)
            return True

        def stats_by_type(self) -> dict[str, dict[str, int]]:
            # what mlx_lm.server logs per request: pins are not in any of the LRU's types
            stats = super().stats_by_type()
            stats["pinned"] = {"n_sequences": len(self._pins), "n_bytes": self.pinned_nbytes}
            return stats

    class StableSegmentGenerator(server.ResponseGenerator):
        def _tokenize(self, tokenizer, request, args):
            out = super()._tokenize(tokenizer, request, args)
            if hooks.boundary is None:
                return out
            try:
                cli_args = self.model_provider.cli_args
                return hooks.boundary.resegment(tokenizer, request, args, cli_args, out)
            except Exception as e:  # never fail the request: mlx-lm's own segment then
                log.warning("kvstore: keeping mlx-lm's system segment: %s", e)
                return out

    return PersistentModelProvider, PersistentServerCache, StableSegmentGenerator


@contextlib.contextmanager
def patched_server(
    home: Path, *, persist: bool = False, model_config: dict | None = None
) -> Iterator[Any]:
    """mlx_lm.server with the kvstore hooks installed; restored on exit. `model_config` overrides
    are given to mlx_lm.load for the served model (mlx_lm.server has no option for them)."""
    from mlx_lm import server

    check_server_shape(server)
    if model_config and not callable(getattr(server, "load", None)):
        raise ServeError("mlx_lm.server no longer calls load(); --model-config cannot apply")
    hooks = _Hooks(home, persist, model_config)
    provider_cls, cache_cls, generator_cls = _subclasses(server, hooks)
    saved = server.ModelProvider, server.LRUPromptCache, server.ResponseGenerator
    server.ModelProvider, server.LRUPromptCache = provider_cls, cache_cls
    if persist:
        server.ResponseGenerator = generator_cls
    try:
        yield server
    finally:
        server.ModelProvider, server.LRUPromptCache, server.ResponseGenerator = saved
