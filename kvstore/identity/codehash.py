"""The mlx-lm code that computes a model's KV, hashed by content; mlx versions as provenance.

The architecture module is the one `mlx_lm.utils._get_classes` picks (model_type remapped as it
remaps it); with it go the mlx_lm.models modules it imports, found by reading its imports (AST),
and the cache module our prefill builds caches with. An mlx-lm release that leaves these files
alone keeps every fingerprint; one that edits them moves the model's entries to a new one.
Compiled mlx kernels have no source here to hash: their version is provenance, checked by the
upgrade canary (kvstore.warm.canary).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
from pathlib import Path

import xxhash

ARCH_PACKAGE = "mlx_lm.models"
CACHE_MODULE = "mlx_lm.models.cache"  # make_prompt_cache and the cache classes prefill fills
ADAPTER_MODULE = "mlx_lm.tuner.utils"  # load_adapters: which layers get LoRA / DoRA
ADAPTER_PACKAGES = ("mlx_lm.tuner", "mlx_lm.models")


def arch_module_name(config: dict) -> str:
    """`mlx_lm.models.<type>` as mlx_lm.utils._get_classes resolves config's model_type."""
    from mlx_lm import utils

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError("config.json has no model_type")
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    by_arch = getattr(utils, "MODEL_ARCHITECTURE_REMAPPING", {})
    for architecture in architectures:
        remapped = by_arch.get((model_type, architecture))
        if remapped is not None:
            return f"{ARCH_PACKAGE}.{remapped}"
    return f"{ARCH_PACKAGE}.{getattr(utils, 'MODEL_REMAPPING', {}).get(model_type, model_type)}"


def _module_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None) if spec else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _import_statements(source: str) -> list[ast.stmt]:
    """Every import statement of a module, at any depth (a function's lazy import too), parsed
    one statement at a time: walking the whole tree of cache.py costs ten times more."""
    out: list[ast.stmt] = []
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        text = lines[i].strip()
        i += 1
        if not (text.startswith("from ") or text.startswith("import ")):
            continue
        while (text.count("(") > text.count(")") or text.endswith("\\")) and i < len(lines):
            text = text.rstrip("\\") + " " + lines[i].strip()
            i += 1
        try:
            out.extend(ast.parse(text.split(";")[0].split("#")[0]).body)
        except SyntaxError:  # "from x import" in a docstring: not an import
            continue
    return out


def imported_modules(source: str, module: str, packages: tuple[str, ...]) -> set[str]:
    """The modules under `packages` that `source` (the text of `module`) imports."""
    out: set[str] = set()
    parent = module.rsplit(".", 1)[0]
    for node in _import_statements(source):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = parent.rsplit(".", node.level - 1)[0] if node.level > 1 else parent
                base = f"{anchor}.{base}" if base else anchor
            names = [base] + [f"{base}.{a.name}" for a in node.names]  # `from . import x`
        for name in names:
            if any(name == p or name.startswith(p + ".") for p in packages):
                if _module_file(name) is not None:
                    out.add(name)
    return out


def _closure(roots: tuple[str, ...], packages: tuple[str, ...]) -> dict[str, bytes]:
    """Module name -> source bytes of the roots and everything under `packages` they import."""
    seen: dict[str, bytes] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            raise ValueError(f"no source for {name}: this mlx-lm does not support the model")
        seen[name] = path.read_bytes()
        todo.extend(imported_modules(seen[name].decode("utf-8"), name, packages) - set(seen))
    return seen


@functools.lru_cache(maxsize=64)
def module_closure_digest(roots: tuple[str, ...], packages: tuple[str, ...]) -> tuple[bytes, tuple]:
    """Digest of the sources of a module closure, and the module names in it. Cached per process:
    the code a process runs is the code it imported, so an upgrade under it must not move its
    fingerprints (the daemon restarts into the new code: kvstore.daemon.canary)."""
    sources = _closure(roots, packages)
    h = xxhash.xxh3_128()
    for name in sorted(sources):
        h.update(f"{name}\0{len(sources[name])}\0".encode())
        h.update(sources[name])
    return h.digest(), tuple(sorted(sources))


def custom_module_digest(path: Path) -> bytes:
    """A model's own `model_file` (run by mlx-lm only with trust_remote_code) and the mlx_lm.models
    modules it imports. Read on every call: it is a model file, and may change like one."""
    source = path.read_bytes()
    deps = imported_modules(source.decode("utf-8"), "custom_model", (ARCH_PACKAGE,))
    h = xxhash.xxh3_128(source)
    h.update(module_closure_digest(tuple(sorted(deps)), (ARCH_PACKAGE,))[0] if deps else b"")
    return h.digest()


@functools.lru_cache(maxsize=1)
def _quantize_source() -> bytes:
    from mlx_lm.generate import maybe_quantize_kv_cache

    return inspect.getsource(maybe_quantize_kv_cache).encode()


def kv_code_digest(
    config: dict, model_dir: Path, *, adapter: bool = False, kv_bits: int | None = None
) -> bytes:
    """Hash of the code that computes this model's KV as kvstore prefills it (16 bytes)."""
    h = xxhash.xxh3_128()
    model_file = config.get("model_file")
    if isinstance(model_file, str):  # trust_remote_code: mlx-lm executes this file
        h.update(b"custom\0" + custom_module_digest(model_dir / model_file))
        h.update(module_closure_digest((CACHE_MODULE,), (ARCH_PACKAGE,))[0])
    else:
        roots = (arch_module_name(config), CACHE_MODULE)
        h.update(module_closure_digest(roots, (ARCH_PACKAGE,))[0])
    if adapter:
        h.update(b"adapter\0" + module_closure_digest((ADAPTER_MODULE,), ADAPTER_PACKAGES)[0])
    if kv_bits:
        h.update(b"quantize\0" + _quantize_source())
    return h.digest()


def kv_code_files(config: dict, *, adapter: bool = False, kv_bits: int | None = None) -> list[Path]:
    """The source files kv_code_digest reads for a config without a model_file, and the module
    whose remapping tables pick the architecture: what a remembered digest is valid for."""
    generate = importlib.import_module("mlx_lm.generate")  # the package's `generate` is a function
    utils = importlib.import_module("mlx_lm.utils")
    names = set(module_closure_digest((arch_module_name(config), CACHE_MODULE), (ARCH_PACKAGE,))[1])
    if adapter:
        names |= set(module_closure_digest((ADAPTER_MODULE,), ADAPTER_PACKAGES)[1])
    files = [f for f in map(_module_file, sorted(names)) if f is not None]
    extra = [utils.__file__] + ([generate.__file__] if kv_bits else [])
    return files + [Path(f) for f in extra if f is not None]


def runtime_versions() -> dict[str, str]:
    """The mlx and mlx-lm versions this process runs (imported), for each entry's provenance."""
    import mlx.core as mx
    import mlx_lm

    return {"mlx": str(mx.__version__), "mlx_lm": str(mlx_lm.__version__)}


def installed_versions() -> dict[str, str]:
    """The versions installed on disk now, read fresh from the dist metadata: an upgrade under a
    running process changes these, not runtime_versions()."""
    from importlib import metadata

    out = {}
    for key, dist in (("mlx", "mlx"), ("mlx_lm", "mlx-lm")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = "absent"
    return out
