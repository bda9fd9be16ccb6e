"""Who an entry belongs to: model fingerprint, template hash, and model path resolution.

The fingerprint changes whenever the KV of the same tokens would differ: weight contents, the
effective configuration (config.json with load-time overrides, kvstore.identity.modelconfig),
adapter
weights and config, KV quantization, the per-layer cache layout, the mlx-lm source that computes
the KV (kvstore.identity.codehash) and the codec version. Full-content hashes of large files are
cached by
file identity (device, inode, size, mtime, ctime) in the home, so a start after the first costs a
few stat calls and a touched-but-unchanged file re-hashes to the same value. The identities seen
are kept on the Fingerprint, so a caller can check nothing changed while it loaded the weights.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from kvstore.codec import CODEC_VERSION
from kvstore.degrade import UNREADABLE, foreign
from kvstore.errors import ModelError
from kvstore.home.settings import write_atomically
from kvstore.identity.codehash import kv_code_digest, kv_code_files
from kvstore.identity.model import ModelIdentity, ResolvedModel, model_name
from kvstore.identity.modelconfig import (
    TEMPLATE_FILES as TEMPLATE_FILES,  # where the daemon's watcher imports it from
)
from kvstore.identity.modelconfig import (
    check_overrides,
    config_identity,
    effective_config,
    model_args,
    template_digest,
)

# Files whose contents change the KV of given tokens. The model's own *.py files are not among them:
# mlx-lm runs none, except a config's `model_file` under trust_remote_code (hashed as code).
WEIGHT_GLOBS = ("config.json", "hf_quant_config.json", "*.safetensors")
ADAPTER_GLOBS = ("adapter_config.json", "*.safetensors")
_CHUNK = 16 * 2**20  # 16 MiB reads while hashing


@dataclass(frozen=True)
class Fingerprint:
    digest: bytes  # 16 bytes: the key prefix of every entry of this model
    layout: tuple  # per-layer cache classes and their shape-defining parameters
    identity: ModelIdentity  # what it was computed for (with the overrides as checked)
    files: tuple = ()  # (path, stat identity, digest) of every file hashed, as it was hashed
    parts: dict = field(default_factory=dict)  # a short hash per part: what `model_changed` names

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def changed_files(self) -> list[str]:
        """The hashed files whose identity changed since (or that are gone): a stat each."""
        out = []
        for path, ident, _ in self.files:
            try:
                now = FileHashCache.identity(Path(path).stat())
            except OSError:
                now = None
            if now != list(ident):
                out.append(path)
        return out

    def check_unchanged(self, what: str) -> None:
        """Raise ModelError naming the files that changed since the fingerprint was computed."""
        if changed := self.changed_files():
            raise ModelError(
                f"{', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} changed while "
                f"{what}: the loaded weights may not be the fingerprinted ones; not storing or "
                "hydrating KV for it (load again once the files settle)"
            )


_UNREADABLE_FILE: tuple[type[Exception], ...] = (OSError, *UNREADABLE)


class FileHashCache:
    """Full-content hashes keyed by file identity, kept in one msgpack file written atomically."""

    def __init__(self, path: Path | None):
        self.path = path
        self._data: dict[str, list] = {}
        self._dirty = False
        if path is not None and path.is_file():
            try:
                self._data = msgpack.unpackb(path.read_bytes(), raw=False)
                if not isinstance(self._data, dict):
                    self._data = {}
            except _UNREADABLE_FILE:  # a damaged cache only costs a re-hash
                self._data = {}

    @staticmethod
    def identity(st: os.stat_result) -> list:
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def digest(self, path: Path) -> bytes:
        return self.digest_and_identity(path)[0]

    def digest_and_identity(self, path: Path) -> tuple[bytes, list]:
        ident = self.identity(path.stat())
        hit = self._data.get(str(path))
        if hit and hit[:5] == ident:
            return bytes(hit[5]), ident
        digest = hash_file(path)
        if self.identity(path.stat()) != ident:  # written while we read it: not this content
            raise ModelError(f"{path}: changed while being hashed; try again once it settles")
        self._data[str(path)] = [*ident, digest]
        self._dirty = True
        return digest, ident

    def memo(self, key: str):
        """A value remembered with `remember`, while every file it was derived from keeps its
        identity; else None."""
        hit = self._data.get(key)
        if not (isinstance(hit, list) and len(hit) == 2 and isinstance(hit[0], list)):
            return None
        try:
            if all(self.identity(os.stat(p)) == list(ident) for p, ident in hit[0]):
                return hit[1]
        except (OSError, TypeError, ValueError):
            pass
        return None

    def remember(self, key: str, files: list[Path], value) -> None:
        self._data[key] = [[[str(p), self.identity(p.stat())] for p in files], value]
        self._dirty = True

    def save(self) -> None:
        if not (self._dirty and self.path and self.path.parent.is_dir()):
            return
        try:
            write_atomically(self.path, msgpack.packb(self._data, use_bin_type=True))
            self._dirty = False
        except OSError:  # read-only home: the cache is an optimization only
            pass


def hash_file(path: Path) -> bytes:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.digest()


def looks_local(model: str | Path) -> bool:
    """A path plainly meant as a local directory (it starts with `.`, `/` or `~`): never a hub
    id, so never looked up in the hub cache nor offered as an `hf download`."""
    return str(model).startswith((".", "/", "~"))


def resolve_model_path(model: str | Path) -> Path:
    """A local directory as given, or a hub id resolved from the local hub cache (no download)."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p.resolve()
    where = p.absolute()  # what was looked for: a relative path is the current directory's
    if p.exists():
        raise ModelError(f"model {str(model)!r}: {where} is a file, not a model directory")
    if not looks_local(model) and re.fullmatch(r"[\w.-]+/[\w.-]+", str(model)):
        try:
            from huggingface_hub import snapshot_download

            cache_dir = os.environ.get("HF_HUB_CACHE") or None  # read now, not at import
            return Path(snapshot_download(str(model), local_files_only=True, cache_dir=cache_dir))
        except (ImportError, OSError, ValueError) as e:  # not cached: OSError; a bad id: ValueError
            raise ModelError(
                f"model {model!r}: no directory {where} and not in the local hub cache "
                f"({type(e).__name__}); download it first (e.g. `hf download {model}`)"
            ) from None
    resolved = "" if str(where) == str(model) else f" {where}"  # named once when given whole
    raise ModelError(f"model {str(model)!r}: no such directory{resolved}")


def _files(root: Path, globs: tuple[str, ...]) -> list[Path]:
    """The files directly in `root` matching any of `globs` (what `root.glob` gives for each,
    from one directory read: the fingerprint runs at every start)."""
    with os.scandir(root) as it:
        found = [e.name for e in it if any(fnmatchcase(e.name, g) for g in globs) and e.is_file()]
    return sorted(root / name for name in found)


def describe_cache(c) -> tuple:
    """A cache object's class and the parameters that shape its state (not its contents)."""
    name = type(c).__name__
    if name == "CacheList":
        return (name, tuple(describe_cache(x) for x in c.caches))
    params = {
        "RotatingKVCache": lambda: (c.max_size, c.keep),
        "ChunkedKVCache": lambda: (c.chunk_size,),
        "ArraysCache": lambda: (len(c.cache),),
        "QuantizedKVCache": lambda: (c.group_size, c.bits),
    }.get(name, lambda: ())()
    return (name, *params)


def build_architecture(config: dict, model_dir: Path):
    """The model object mlx-lm would build from `config`, without its weights: mlx arrays are lazy,
    so instantiating the architecture without evaluating it allocates nothing."""
    from kvstore import mlxlm

    if config.get("model_file") is not None:
        raise ModelError(
            f"{model_dir}: its config runs custom code (model_file); pass the loaded model "
            "(model=...) so its layout is read from it"
        )
    with foreign(lambda e: ModelError(f"{model_dir}: cannot build the model from its config: {e}")):
        model_class, args_class = mlxlm.model_classes(config)
        return model_class(args_class.from_dict(config))


def cache_layout(model_dir: Path, model=None, *, model_config: dict | None = None) -> tuple:
    """The per-layer cache layout of a model; without a loaded model, built from config alone."""
    from mlx_lm.models.cache import make_prompt_cache

    if model is None:
        model = build_architecture(effective_config(model_dir, model_config), model_dir)
    return tuple(describe_cache(c) for c in make_prompt_cache(model))


def _architecture(
    config: dict,
    model_dir: Path,
    model_object: Any,
    *,
    adapter: bool,
    kv_bits: Any,
    cache: FileHashCache,
    name: str,
) -> tuple[tuple, bytes, bytes]:
    """(cache layout, model arguments' identity, mlx-lm code digest) of a config. Building the
    architecture and hashing mlx-lm's source are the costly part of a new process's fingerprint:
    what they give for this config is remembered while the source files keep their identity."""
    key = (
        None
        if model_object is not None or config.get("model_file")
        else _memo_key(config, adapter, kv_bits)
    )
    hit = cache.memo(key) if key else None
    if hit is not None:
        return _tuplify(hit[0]), bytes(hit[1]), bytes(hit[2])
    built = model_object if model_object is not None else build_architecture(config, model_dir)
    built_layout = cache_layout(model_dir, built)
    args_id = config_identity(model_args(built, config), config)
    try:
        code = kv_code_digest(config, model_dir, adapter=adapter, kv_bits=kv_bits)
        if key:
            sources = kv_code_files(config, adapter=adapter, kv_bits=kv_bits)
            cache.remember(key, sources, [built_layout, args_id, code])
    except (OSError, ValueError, SyntaxError) as e:
        raise ModelError(f"model {name!r}: cannot hash the mlx-lm code: {e}") from None
    return built_layout, args_id, code


def _hash_files(h: Any, files: list[tuple[str, Path]], cache: FileHashCache) -> list[tuple]:
    """Each file's name, size and content digest into `h` (config.json's effect is hashed by
    the caller, as the model reads it); returns (path, identity, digest) per file."""
    seen = []
    for name, path in files:
        if name == "model/config.json":
            digest, ident = b"", FileHashCache.identity(path.stat())
        else:
            digest, ident = cache.digest_and_identity(path)
            h.update(f"{name}\0{path.stat().st_size}\0".encode())
            h.update(digest)
        seen.append((str(path), tuple(ident), digest))
    return seen


def model_fingerprint(
    model: ResolvedModel | ModelIdentity | str | Path,
    *,
    layout: tuple | None = None,
    model_object=None,
    hash_cache: FileHashCache | None = None,
) -> Fingerprint:
    """Hash of everything that changes the KV of given tokens for this model as it would be run.

    `model` is a ModelIdentity, or a path for the model with no adapter, unquantized KV and no
    overrides, or a ResolvedModel (its directory and effective config read once, then taken from
    it; the fingerprint's identity is then named by its directory). Its `model_config` are the
    overrides given to `mlx_lm.load(path, model_config=...)`.
    The model's arguments and cache layout come from the loaded `model_object` when given (so
    overrides it was loaded with count even if not named here), else from the effective config.
    """
    located = model if isinstance(model, ResolvedModel) else None
    if located is not None:
        identity = replace(located.identity, path=str(located.directory))
    else:
        identity = model if isinstance(model, ModelIdentity) else ModelIdentity(str(model))
    # a kv_bits of "8" would otherwise be a fingerprint no entry is filed under, silently
    identity.check()
    model, adapter_path = identity.path, identity.adapter
    kv_bits = identity.kv_bits
    model_dir = located.directory if located is not None else resolve_model_path(model)
    model_config = check_overrides(identity.model_config)
    cache = hash_cache or FileHashCache(None)
    files = [(f"model/{p.relative_to(model_dir)}", p) for p in _files(model_dir, WEIGHT_GLOBS)]
    if not any(name.endswith(".safetensors") for name, _ in files):
        raise ModelError(f"model {str(model)!r}: no *.safetensors weights in {model_dir}")
    config = located.config if located is not None else effective_config(model_dir, model_config)
    if adapter_path is not None:
        adir = Path(adapter_path).expanduser()
        afiles = _files(adir, ADAPTER_GLOBS) if adir.is_dir() else []
        if not afiles:
            raise ModelError(f"adapter {str(adapter_path)!r}: no adapter files in that directory")
        files += [(f"adapter/{p.relative_to(adir)}", p) for p in afiles]
    adapter = adapter_path is not None
    built_layout, args_id, code = _architecture(
        config, model_dir, model_object, adapter=adapter, kv_bits=kv_bits, cache=cache, name=model
    )
    if layout is None:
        layout = built_layout
    h = xxhash.xxh3_128()
    seen = _hash_files(h, files, cache)
    h.update(b"config\0" + args_id)
    h.update(b"code\0" + code)
    quant = (kv_bits, identity.kv_group_size, identity.quantized_kv_start) if kv_bits else None
    h.update(repr((layout, quant, CODEC_VERSION)).encode())
    cache.save()
    checked = replace(identity, model_config=model_config)
    named = [(name, d) for (name, _), (_, _, d) in zip(files, seen, strict=True)]
    parts = _parts(named, args_id, code, quant, layout)
    return Fingerprint(h.digest(), layout, checked, tuple(seen), parts)


def _parts(named: list, args_id: bytes, code: bytes, quant: Any, layout: Any) -> dict[str, str]:
    """A short hash of each part of the fingerprint, kept in entries' meta: when the
    fingerprint changes, which part did (kvstore.reasons' `model_changed`)."""

    def short(*parts: Any) -> str:
        return xxhash.xxh3_64_hexdigest(repr(parts).encode())

    return {
        "weights": short([d for n, d in named if n.startswith("model/") and d]),
        "adapter": short([d for n, d in named if n.startswith("adapter/")]),
        "config": short(args_id),
        "kv_quantization": short(quant),
        "mlx_lm": short(code),
        "codec": short(CODEC_VERSION, layout),
    }


def _memo_key(config: dict, adapter: bool, kv_bits: int | None) -> str:
    import mlx_lm

    # the install's location too: two venvs sharing a home run different mlx-lm files
    where = [mlx_lm.__file__, CODEC_VERSION]
    text = json.dumps([config, adapter, bool(kv_bits), where], sort_keys=True, default=repr)
    return "derived:" + xxhash.xxh3_128_hexdigest(text.encode())


def _tuplify(value):
    """msgpack gives lists back: the layout is compared as nested tuples."""
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value


def template_hash(model: str | Path) -> bytes:
    """Hash of the chat template, tokenizer files and special tokens (16 bytes)."""
    return template_digest(resolve_model_path(model))


def resolve_model(identity: ModelIdentity) -> ResolvedModel:
    """`identity` located here: its directory resolved now (a hub id from the local hub cache);
    its effective config and template hash are read on first use, once."""
    return ResolvedModel(identity, resolve_model_path(identity.path))


# -- where the model resolved: recorded on each entry at put time ---------------------------
def model_location(model: str, adapter: str | None = None) -> dict[str, str]:
    """Where `model` and `adapter` resolve in this process, as absolute directories (a hub id:
    its snapshot directory): recorded in each entry's extra at put time as `model_dir` and
    `adapter_dir`, so a process with another cwd or HF_HOME (the daemon under launchd) can still
    judge the entry stale or current. What does not resolve here is left out."""
    out: dict[str, str] = {}
    if model:
        try:
            out["model_dir"] = str(resolve_model_path(model))
        except (ModelError, OSError):
            pass
    if adapter:
        adir = Path(adapter).expanduser()
        if adir.is_dir():
            out["adapter_dir"] = str(adir.resolve())
    return out


def with_model_location(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with the model named by `model_name` (a relative path as its absolute folder)
    and `model_dir`/`adapter_dir` added to extra where not given (see model_location)."""
    extra = fields.get("extra") or {}
    model, adapter = fields.get("model"), extra.get("adapter") if isinstance(extra, dict) else None
    if not isinstance(model, str) or not (adapter is None or isinstance(adapter, str)):
        return fields  # put's type check names the field
    fields = {**fields, "model": model_name(model)} if model else fields
    if not isinstance(extra, dict) or isinstance(extra.get("model_dir"), str):
        return fields  # a bad extra: put's type check names it
    return {**fields, "extra": {**model_location(model, adapter), **extra}}
