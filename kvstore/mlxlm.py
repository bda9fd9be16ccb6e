"""The one place kvstore reaches into mlx-lm beyond its public API.

kvstore relies on a few of mlx-lm's internals: LRUPromptCache's byte accounting, eviction order
and trie (pins live in the trie but outside the LRU's books), the server's model provider,
tokenizer step and HTTP server (the `kvstore serve` hooks), and cache state layouts (the codec's
one stored form). Every such access goes through a function here, and `REQUIRED` lists each
internal with why kvstore needs it; tests/codec/test_mlxlm_adapter.py checks every row against
the installed mlx-lm, so a release that renames one fails naming it.

mlx and mlx-lm are imported inside the functions, never at module level: the CLI's light
commands import no mlx.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

CACHE = "mlx_lm.models.cache"
SERVER = "mlx_lm.server"
GENERATE = "mlx_lm.generate"


class Internal(NamedTuple):
    """One internal kvstore relies on: `owner` is a module or `module:Class`; `attr` an attribute
    of it (on an instance: one its class's source assigns as `self.<attr>`)."""

    owner: str
    attr: str
    why: str

    def __str__(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.attr}"


REQUIRED: tuple[Internal, ...] = (
    Internal(f"{CACHE}:LRUPromptCache", "_lru", "pins stay out of the eviction order"),
    Internal(f"{CACHE}:LRUPromptCache", "_n_bytes", "pins stay out of the byte count"),
    Internal(f"{CACHE}:LRUPromptCache", "_n_bytes_by_type", "pins stay out of the byte count"),
    Internal(f"{CACHE}:LRUPromptCache", "_trie", "pins are found by mlx-lm's own search"),
    Internal(f"{CACHE}:LRUPromptCache", "CacheEntry", "a pin's entry in the trie"),
    Internal(f"{CACHE}:LRUPromptCache.CacheOrder", "remove", "an LRU entry becomes a pin"),
    Internal(f"{CACHE}:PromptTrie", "add", "pins are put back after a trimmable insert"),
    Internal(f"{CACHE}:PromptTrie", "pop", "serve lets go of another model's pins"),
    Internal(f"{CACHE}:PromptTrie", "search", "where a prefix's KV is (memory or store)"),
    Internal(f"{CACHE}:PromptTrie", "get", "the KV of a prefix found in memory"),
    Internal(f"{CACHE}:RotatingKVCache", "_idx", "the ring position, part of the stored state"),
    Internal(f"{CACHE}:RotatingKVCache", "_temporal_order", "import diffs a ring in order"),
    Internal(f"{CACHE}:_BaseCache", "from_state", "a cache object from a stored state"),
    Internal("mlx_lm.utils", "_get_classes", "the architecture of a config, without weights"),
    Internal("mlx_lm.tokenizer_utils:TokenizerWrapper", "_tokenizer", "offset mappings"),
    Internal(
        GENERATE, "generate_step", "attach routes calls that stream_generate makes through it"
    ),
    Internal(SERVER, "process_message_content", "tool-call turns as the server reads them"),
    Internal(SERVER, "_run_http_server", "serve's handler (GET /metrics, /health)"),
    Internal(f"{SERVER}:ModelProvider", "_load", "serve hydrates as a model loads"),
    Internal(f"{SERVER}:ModelProvider", "model_key", "the LRU's key of the loaded model"),
    Internal(f"{SERVER}:ModelProvider", "cli_args", "the server's options (host, port, ...)"),
    Internal(f"{SERVER}:ResponseGenerator", "_tokenize", "serve's warm-up and system segment"),
    Internal(f"{SERVER}:ResponseGenerator", "_generate", "serve stops when its thread dies"),
    Internal(f"{SERVER}:APIHandler", "do_GET", "serve answers GET /metrics and /health"),
    Internal(f"{SERVER}:APIHandler", "do_POST", "serve holds requests until it is ready"),
)

# what ModelProvider._load resets and sets (mlx-lm 0.31 has no processor): kept across a failed load
PROVIDER_STATE = ("model_key", "model", "tokenizer", "processor", "draft_model", "is_batchable")


def _owner(owner: str) -> Any:
    module, _, path = owner.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def present(i: Internal) -> bool:
    """Whether the installed mlx-lm has `i` (a class's instance attribute: its source sets it)."""
    try:
        obj = _owner(i.owner)
    except (ImportError, AttributeError):
        return False
    if hasattr(obj, i.attr):
        return True
    if not inspect.isclass(obj):
        return False
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError):
        return False
    return f"self.{i.attr} =" in src or f"self.{i.attr}:" in src


def missing() -> list[str]:
    """The internals in REQUIRED the installed mlx-lm lacks, as `owner.attr (why)`."""
    return [f"{i} ({i.why})" for i in REQUIRED if not present(i)]


def version() -> str:
    import mlx_lm

    return str(mlx_lm.__version__)


# -- caches: state layouts ---------------------------------------------------------------------


def has_meta_state() -> bool:
    """True with mlx-lm 0.31 (`meta_state`, `from_state(state, meta_state)`), False with 0.32."""
    from mlx_lm.models import cache as mlc

    return hasattr(mlc._BaseCache, "meta_state")


def new_cache(cls: Any, fields: Sequence[str], values: Sequence[Any]) -> Any:
    """A cache object made as mlx-lm's from_state makes it (no __init__), `fields` set directly
    (0.31's setters drop what its meta_state does not carry)."""
    obj = cls.__new__(cls)
    for f, v in zip(fields, values, strict=True):
        setattr(obj, f, v)
    return obj


def temporal_order(c: Any, v: Any) -> Any:
    """A RotatingKVCache's keys or values `v` in the order they were written."""
    return c._temporal_order(v)


def model_classes(config: dict) -> tuple[Any, Any]:
    """(model class, its args class) mlx-lm builds for `config`."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


# -- tokenizer and server helpers --------------------------------------------------------------


def tokenizer_backend(tokenizer: Any) -> Any:
    """The transformers tokenizer a TokenizerWrapper wraps (its own __call__ is not that one's)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def process_message_content(turns: list[dict]) -> None:
    """The server's own preparation of chat turns (in place)."""
    from mlx_lm.server import process_message_content as process

    process(turns)


# -- LRUPromptCache: byte accounting, eviction order, trie --------------------------------------


def lru_len(c: Any) -> int:
    """Entries in the LRU's eviction order."""
    return len(c._lru)


def lru_nbytes(c: Any) -> int:
    """Bytes the LRU counts against its budget."""
    return int(c._n_bytes)


def lru_count(c: Any, entry: Any, sign: int) -> None:
    """Add (`sign` 1) or take off (-1) `entry`'s bytes in the LRU's byte count."""
    c._n_bytes += sign * entry.nbytes
    c._n_bytes_by_type[entry.cache_type] += sign * entry.nbytes


def lru_forget(c: Any, model: Any, tokens: Sequence[int], entry: Any) -> None:
    """Take the LRU entry of `tokens` off the LRU's books (count and order); the trie keeps it."""
    lru_count(c, entry, -1)
    c._lru.remove(model, list(tokens))


def cache_entry(kv: list, nbytes: int, cache_type: str) -> Any:
    """An LRUPromptCache entry, as the trie holds them."""
    from mlx_lm.models.cache import LRUPromptCache

    return LRUPromptCache.CacheEntry(kv, nbytes, cache_type)


def trie_add(c: Any, model: Any, tokens: Sequence[int], entry: Any) -> Any:
    """Put `entry` in the trie under `tokens`; the entry it replaced, or None."""
    return c._trie.add(model, list(tokens), entry)


def trie_pop(c: Any, model: Any, tokens: Sequence[int]) -> Any:
    return c._trie.pop(model, list(tokens))


def trie_search(c: Any, model: Any, tokens: Sequence[int]) -> Any:
    return c._trie.search(model, list(tokens))


def trie_get(c: Any, model: Any, tokens: Sequence[int]) -> Any:
    return c._trie.get(model, list(tokens))


def leave_last_token(lru: Any, model: Any, tokens: list[int], cache: list) -> tuple[Any, list]:
    """(cache, rest) for a prompt an LRUPromptCache holds whole, where mlx-lm returns an empty
    remainder that its generators refuse: the model must still run the last token for the first
    output's logits. A trimmable cache steps back one token; a state cache cannot, so the nearest
    prefix `lru` holds that is shorter than the prompt serves it (or none: all prefilled)."""
    from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

    if can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, 1)
        return cache, list(tokens[-1:])
    shorter, rest = LRUPromptCache.fetch_nearest_cache(lru, model, list(tokens[:-1]))
    return shorter, [*rest, tokens[-1]]


def eval_cache(cache: list) -> None:
    """Evaluate a prompt cache's arrays on this thread (a lazy graph, as the batched path's
    extracted caches are), whatever mlx-lm built it: an empty layer holds nothing to evaluate
    (mlx-lm 0.31's `KVCache.state` of an empty layer raises)."""
    import mlx.core as mx

    arrays: list = []

    def visit(c: Any) -> None:
        if type(c).__name__ == "CacheList":
            for x in c.caches:
                visit(x)
        elif getattr(c, "keys", True) is not None:
            arrays.append(c.state)

    for c in cache:
        visit(c)
    mx.eval(arrays)


def cache_offsets(cache: list) -> set[int]:
    """The offsets a prompt cache's offset-keeping layers hold (CacheList: its members'); an
    ArraysCache (linear attention / SSM state) keeps none."""
    offsets: set[int] = set()

    def visit(c: Any) -> None:
        if type(c).__name__ == "CacheList":
            for x in c.caches:
                visit(x)
        elif isinstance(getattr(c, "offset", None), int):
            offsets.add(c.offset)

    for c in cache:
        visit(c)
    return offsets


def generated_transcript(cache: list, transcript: list[int]) -> list[int] | None:
    """The part of a generation's `transcript` (prompt + generated tokens) its `cache` holds:
    mlx-lm runs one token ahead, so the last generated token is not in it. The offset every
    offset-keeping layer agrees on (a pure state-space model's layers keep none: the whole
    transcript); None when they disagree or hold more (nothing to file it under)."""
    offsets = cache_offsets(cache)
    if not offsets:
        return transcript
    held = offsets.pop() if len(offsets) == 1 else None
    return transcript[:held] if held is not None and held <= len(transcript) else None


# -- mlx_lm.server ------------------------------------------------------------------------------


def server_problems(server: Any, cache_cls: type) -> list[str]:
    """What `server` (mlx_lm.server) lacks of the shape `kvstore serve` hooks into; `cache_cls`
    is serve's cache, which must subclass the server's LRUPromptCache."""
    problems = []
    for name in ("main", "run", "ModelProvider", "LRUPromptCache", "ResponseGenerator"):
        if not hasattr(server, name):
            problems.append(f"mlx_lm.server.{name} is missing")
    provider: Any = getattr(server, "ModelProvider", None)
    for name in ("_load", "load"):
        if provider is not None and not callable(getattr(provider, name, None)):
            problems.append(f"ModelProvider.{name} is missing")
    lru = getattr(server, "LRUPromptCache", None)
    if lru is not None and not issubclass(cache_cls, lru):
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
    http = getattr(server, "_run_http_server", None)
    if http is None or "handler_class" not in inspect.signature(http).parameters:
        problems.append("mlx_lm.server._run_http_server has no handler_class parameter")
    if not callable(getattr(getattr(server, "APIHandler", None), "do_GET", None)):
        problems.append("mlx_lm.server.APIHandler.do_GET is missing")
    return problems


@contextlib.contextmanager
def installed(
    server: Any, provider: type, cache: type, generator: type, handler: type
) -> Iterator[Any]:
    """`server` (mlx_lm.server) building these classes and serving with `handler`; restored on
    exit."""
    saved = server.ModelProvider, server.LRUPromptCache, server.ResponseGenerator
    saved_http = server._run_http_server
    server.ModelProvider, server.LRUPromptCache = provider, cache
    server._run_http_server = functools.partial(saved_http, handler_class=handler)
    server.ResponseGenerator = generator
    try:
        yield server
    finally:
        server.ModelProvider, server.LRUPromptCache, server.ResponseGenerator = saved
        server._run_http_server = saved_http


def overriding(base: type, **private: Callable[..., Any]) -> type:
    """A subclass of `base` (an mlx_lm.server class, or kvstore's subclass of one) whose private
    methods of mlx-lm named in `private` (rows of REQUIRED) are those functions; one calls
    mlx-lm's own as `plain(self, name)`. Installed as they are, no frame of this module sits
    between mlx-lm and them."""
    return type(base.__name__, (base,), dict(private))


def plain(obj: Any, name: str) -> Callable[..., Any]:
    """mlx-lm's own method `name` of `obj`, whose class replaced it (`overriding`)."""
    owner = next(c for c in type(obj).__mro__ if name in vars(c))
    return getattr(super(owner, obj), name)


@contextlib.contextmanager
def load_with_config(server: Any, model_path: Any, model_config: dict | None) -> Iterator[None]:
    """While inside, the server's `load` of `model_path` gets `model_config` (mlx_lm.server has no
    option for it); other paths load as they would."""
    plain: Callable[..., Any] = server.load
    if model_config:

        def load(path: Any, *a: Any, **kw: Any) -> Any:
            if path == model_path:
                kw["model_config"] = {**(kw.get("model_config") or {}), **model_config}
            return plain(path, *a, **kw)

        server.load = load
    try:
        yield
    finally:
        server.load = plain


def provider_state(provider: Any) -> dict[str, Any]:
    """What ModelProvider._load resets and sets, to put back after a failed load."""
    return {n: getattr(provider, n) for n in PROVIDER_STATE if hasattr(provider, n)}


def image_cache_key(tokenized: Sequence[Any]) -> list[int] | None:
    """The key mlx_lm.server (0.32) fetches and inserts a prompt with images under: the
    `cache_key` of `ResponseGenerator._tokenize`'s fifth value (a `Vision`), the prompt with each
    image's patch tokens replaced by a negative id of that image (two images of one size have the
    same token ids). A copy: mlx-lm appends the output to its own. None for a prompt without
    images, and with mlx-lm 0.31 (no images)."""
    vision = tokenized[4] if len(tokenized) > 4 else None
    key = getattr(vision, "cache_key", None)
    return list(key) if isinstance(key, list) else None


# -- mlx_lm.generate: the route `kvstore.client.attach` puts generation calls through ------------

# route(plain, prompt, model, *args, **kwargs) -> the token generator generate_step would return
StepRoute = Callable[..., Iterator[Any]]

_route_lock = threading.Lock()


def route_generate_step(route: StepRoute) -> Callable[[], None]:
    """Make `mlx_lm.generate.generate_step` call `route(plain, prompt, model, *args, **kwargs)`,
    `plain` being the generate_step it replaced; the undo is returned.

    `mlx_lm.stream_generate` and `mlx_lm.generate` look generate_step up as a global of
    mlx_lm.generate on every call, so every framework that ends in them (smolagents, LangChain,
    Outlines, llama-index) goes through `route`; modules that bound the name at import
    (`from mlx_lm.generate import generate_step`) keep mlx-lm's own. The undo puts `plain` back
    only if the global is still this route (code that replaced it since keeps its own)."""
    gen: Any = importlib.import_module(GENERATE)  # (`import mlx_lm.generate`: the function)
    with _route_lock:
        plain = gen.generate_step

        @functools.wraps(plain)
        def generate_step(prompt: Any, model: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            return route(plain, prompt, model, *args, **kwargs)

        gen.generate_step = generate_step

    def undo() -> None:
        with _route_lock:
            if gen.generate_step is generate_step:
                gen.generate_step = plain

    return undo


def binds(plain: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Whether `plain` (generate_step) takes these arguments: a call it refuses is left to it, to
    fail as it fails without kvstore."""
    try:
        inspect.signature(plain).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def whole_history(plain: Callable[..., Any], processors: Sequence[Any] | None, head: Any) -> Any:
    """`processors` (generate_step's `logits_processors`) given the token history they get when
    `plain` (generate_step) runs the whole prompt, when it is given only the rest after `head`
    (an mx.array, the prompt's cached start, sliced from it so the dtype is the same).

    mlx-lm 0.32 passes a processor the whole prompt plus the tokens generated: `head` goes in
    front. 0.31 passes only the prompt's last token plus those generated (its prefill does not
    add the chunks it runs to the history), which the rest ends with too: unchanged."""
    if not processors or not head.size or not _processors_see_prefill(plain):
        return processors
    import mlx.core as mx

    def seeing_all(processor: Any) -> Callable[[Any, Any], Any]:
        def process(tokens: Any, logits: Any) -> Any:
            return processor(mx.concatenate([head, tokens]), logits)

        return process

    return [seeing_all(p) for p in processors]


@functools.lru_cache(maxsize=4)
def _processors_see_prefill(plain: Callable[..., Any]) -> bool:
    """Whether generate_step adds the prompt chunks it prefills to its processors' history
    (mlx-lm 0.32: `tokens = mx.concat([tokens, processed])` in the prefill loop; 0.31: no)."""
    try:
        return "[tokens, processed]" in inspect.getsource(plain)
    except (OSError, TypeError):
        return True
