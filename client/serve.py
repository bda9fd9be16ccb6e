"""`kvstore serve`: mlx-lm's own OpenAI-compatible server, with the persistent prompt cache.

The server runs in-process, unchanged, with two of its module globals replaced for the duration
of `serve()` by thin subclasses:

- `mlx_lm.server.ModelProvider` -> hydrates the store's entries for a model right after
  `ModelProvider._load` loaded it, under the key the server uses (`ModelProvider.model_key`,
  the tuple (model_path, adapter_path, draft_model_path)).
- `mlx_lm.server.LRUPromptCache` -> the instance `mlx_lm.server.run` builds is the one hydrated;
  with --persist-system-prompts its `insert_cache(..., cache_type="system")` calls (the batched
  path snapshots the system-prompt segment under that type) are also sent to the daemon.

With --persist-system-prompts, `mlx_lm.server.ResponseGenerator` is replaced too: its `_tokenize`
re-cuts the system segment at kvstore's stable boundary (client.serve_boundary).

Both generation paths then see the entries: the batched path and `_serve_single` both call
`prompt_cache.fetch_nearest_cache(model_provider.model_key, prompt)`, and `cached_tokens` is
`len(prompt) - len(rest)` of that call. `check_server_shape` verifies these assumptions up front.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from client.hydrate import Prefetched, hydrate, prefetch
from client.loader import fingerprint_files, tag_loaded
from client.serve_boundary import StableSystemSegment, template_args_warning
from client.writebehind import Job, WriteBehind
from kvstore.cli import home_option
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.serve")

PERSIST_QUEUE = 8  # system prefixes waiting to be sent; more are dropped (never block a request)


class ServeError(KVStoreError):
    """mlx_lm.server does not have the shape `kvstore serve` hooks into."""


def check_server_shape(server: Any) -> None:
    """Fail with one clear message when mlx_lm.server no longer looks like 0.30-0.32's."""
    problems = []
    for name in ("main", "run", "ModelProvider", "LRUPromptCache", "ResponseGenerator"):
        if not hasattr(server, name):
            problems.append(f"mlx_lm.server.{name} is missing")
    provider = getattr(server, "ModelProvider", None)
    for name in ("_load", "load"):
        if provider is not None and not callable(getattr(provider, name, None)):
            problems.append(f"ModelProvider.{name} is missing")
    lru = getattr(server, "LRUPromptCache", None)
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
            + ". Run plain `mlx_lm.server`, or install mlx-lm 0.30-0.32."
        )


class SystemPromptPersister:
    """Sends new system-prompt caches to the daemon through the client's write-behind queue.

    The request path only evaluates and enqueues; encoding and the socket happen on its worker.
    With no daemon, one warning, then prefixes are dropped and serving goes on.
    """

    def __init__(self, home: Path):
        self.home = home
        self.writer = WriteBehind(home, maxsize=PERSIST_QUEUE)
        self.seen: set[tuple] = set()
        self.sent = 0

    def offer(
        self, target: dict[str, Any], tokens: Sequence[int], cache: list, extra: dict | None = None
    ) -> None:
        ident = (target["fingerprint"], tuple(tokens))
        if ident in self.seen:
            return
        self.seen.add(ident)
        import mlx.core as mx

        # Evaluate on the generation thread (its stream); the worker only reads finished arrays.
        mx.eval([c.state for c in cache])
        tokens = list(tokens)
        job = Job(
            f"system prefix ({len(tokens)} tokens)",
            lambda client: self._send(client, target, tokens, cache, extra or {}),
        )
        if not self.writer.submit(job):
            self.seen.discard(ident)  # offered again the next time the server inserts it

    def _send(
        self, client: Any, target: dict[str, Any], tokens: list[int], cache: list, extra: dict
    ) -> None:
        from kvstore import codec
        from kvstore.codehash import runtime_versions
        from kvstore.keys import entry_key, pack_tokens
        from kvstore.store import Store

        key = entry_key(target["fingerprint"], tokens)
        with contextlib.suppress(KVStoreError), Store(self.home, readonly=True) as store:
            meta = store.get_meta(key)
            if meta is not None and meta.tokens == pack_tokens(tokens):
                return  # hydrated or persisted before
        blob = codec.encode(cache, {"model": target["model"], "tokenizer_config": "{}"})
        fields = dict(
            tokens=pack_tokens(tokens),
            label="system",
            pinned=False,
            model=target["model"],
            template_hash=target["template_hash"],
            classes=codec.cache_classes(cache),
            extra={
                "adapter": target["adapter"],
                "kv_bits": target["kv_bits"],
                "kv_group_size": target["kv_group_size"],
                "quantized_kv_start": target["quantized_kv_start"],
                "model_config": target["model_config"],
                "source": "serve",
                "runtime": runtime_versions(),
                **extra,
            },
        )
        client.put(key, blob, fields)
        self.sent += 1
        log.info("kvstore: persisted a %d-token system prefix of %s", len(tokens), target["model"])


class _Hooks:
    """What the two subclasses share: the server's one prompt cache and the persist target."""

    def __init__(self, home: Path, persist: bool, model_config: dict | None = None):
        self.home = home
        self.model_config = model_config
        self.cache: Any = None
        self.persister = SystemPromptPersister(home) if persist else None
        self.boundary = StableSystemSegment() if persist else None
        self.targets: dict[Any, dict[str, Any]] = {}  # model_key -> what a persisted entry needs

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
        report = hydrate(
            self.cache,
            key,
            model_path,
            home=self.home,
            adapter_path=adapter,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start,
            model_config=self.model_config,
            model=provider.model,
            prefetched=prefetched,
        )
        if not (report.warning and not report.entries):  # hydrate already said why not
            log.info(
                "kvstore: hydrated %d entries (%d tokens) for %s in %.2fs%s",
                report.entries,
                report.tokens,
                model_path,
                report.seconds,
                f": {', '.join(report.labels)}" if report.labels else "",
            )
        if report.fingerprint:
            self._check_template_args(report.fingerprint, args)
        if self.persister is not None and report.fingerprint:
            from kvstore.identity import resolve_model_path, template_hash

            self.targets[key] = dict(
                fingerprint=bytes.fromhex(report.fingerprint),
                model=str(model_path),
                adapter=adapter,
                kv_bits=args.kv_bits,
                kv_group_size=args.kv_group_size,
                quantized_kv_start=args.quantized_kv_start,
                model_config=self.model_config,
                template_hash=template_hash(resolve_model_path(model_path)),
            )

    def _check_template_args(self, fingerprint: str, args: Any) -> None:
        from kvstore.store import Store

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
            # client.load does; why that is safe with mlx: client/load.py).
            read: dict[str, Any] = {}
            reader = before = None
            if draft_model_path is None and not getattr(self, "is_distributed", False):
                args = self.cli_args
                quant = dict(
                    kv_bits=args.kv_bits,
                    kv_group_size=args.kv_group_size,
                    quantized_kv_start=args.quantized_kv_start,
                )
                before = fingerprint_files(  # file identity before mlx-lm reads the files
                    model_path,
                    home=hooks.home,
                    adapter_path=adapter_path,
                    model_config=hooks.model_config,
                    **quant,
                )
                reader = threading.Thread(
                    target=lambda: read.update(
                        entries=prefetch(
                            model_path,
                            home=hooks.home,
                            adapter_path=adapter_path,
                            model_config=hooks.model_config,
                            **quant,
                        )
                    ),
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

    class PersistentServerCache(server.LRUPromptCache):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            hooks.cache = self

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
            hooks.on_insert(model, tokens, prompt_cache, cache_type)

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


def serve(
    model: str,
    *,
    home: Path,
    port: int | None = None,
    persist: bool = False,
    model_config: dict | None = None,
    server_args: Sequence[str] = (),
) -> None:
    """Run mlx_lm.server's main() with `--model model` and `server_args`, hydrated from `home`."""
    argv = ["mlx_lm.server", "--model", model]
    if port is not None:
        argv += ["--port", str(port)]
    argv += list(server_args)
    with patched_server(home, persist=persist, model_config=model_config) as server:
        saved_argv = sys.argv
        sys.argv = argv  # main() parses sys.argv: every mlx_lm.server option passes through
        try:
            server.main()
        finally:
            sys.argv = saved_argv


@click.command(
    name="serve",
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": ["-h", "--help"],
    },
)
@home_option
@click.option("--model", "-m", required=True, help="Model directory or hub id, as mlx_lm.server.")
@click.option("--port", type=int, default=None, help="HTTP port (mlx_lm.server's default: 8080).")
@click.option(
    "--persist-system-prompts",
    is_flag=True,
    help="Send new system-prompt prefixes to the daemon, so later starts hydrate them.",
)
@click.option(
    "--model-config",
    "model_config",
    default=None,
    metavar="JSON",
    help="config.json overrides for the model, as mlx_lm.load(model_config=...), e.g. "
    "'{\"rope_theta\": 1000000}'. Part of the entries' identity.",
)
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def serve_cmd(
    home: Path | None,
    model: str,
    port: int | None,
    persist_system_prompts: bool,
    model_config: str | None,
    server_args: tuple[str, ...],
) -> None:
    """Run mlx_lm.server with the persistent prompt cache.

    Stored entries of the model are hydrated into the server's prompt cache when it loads the
    model, so the first request after a start reports them in
    usage.prompt_tokens_details.cached_tokens. Other options go to mlx_lm.server as they are.

    \b
    kvstore serve --model ./Qwen3.5-9B-8bit --port 8080 --prompt-cache-size 20
    """
    import json

    from kvstore.settings import resolve_home

    overrides = None
    if model_config is not None:
        try:
            overrides = json.loads(model_config)
        except ValueError as e:
            raise click.BadParameter(f"not JSON: {e}", param_hint="--model-config") from None
        if not isinstance(overrides, dict):
            raise click.BadParameter("must be a JSON object", param_hint="--model-config")
    try:
        serve(
            model,
            home=resolve_home(home),
            port=port,
            persist=persist_system_prompts,
            model_config=overrides,
            server_args=server_args,
        )
    except KVStoreError as e:
        raise click.ClickException(str(e)) from None
