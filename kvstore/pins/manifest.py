"""The manifest: a TOML recipe naming the models and the prefixes to pin for each.

The recipe travels with an app; the KV bytes are recomputed from it on the device. Loading
validates everything up front (unknown keys included) so a typo fails loudly instead of
silently pinning nothing.
"""

from __future__ import annotations

import json
import sys
import unicodedata
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvstore.errors import ManifestError, got
from kvstore.identity.model import (
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_QUANTIZED_KV_START,
    ModelIdentity,
    kv_quantization_problem,
    model_name,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

ROLES = ("system", "developer", "user", "assistant", "tool")

_TOP_KEYS = ("model",)
_MODEL_KEYS = (
    "path", "adapter", "kv_bits", "kv_group_size", "quantized_kv_start", "model_config",
    "chat_template_kwargs", "prefix",
)  # fmt: skip
_PREFIX_KEYS = ("name", "messages", "text", "file", "tools", "chat_template_kwargs")
# Arguments kvstore itself passes to apply_chat_template: a manifest may not override them.
_RESERVED_TEMPLATE_KWARGS = (
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
)  # fmt: skip
_MESSAGE_KEYS = ("role", "content")
# No tokenizer averages more bytes a token than this over a prompt's text (English about 4, code
# and JSON 3, CJK 2 to 3; only long runs of one character merge further): content longer than
# max_pin_tokens times this cannot fit, and is refused before it is tokenized (`oversized`).
MAX_BYTES_PER_TOKEN = 16


@dataclass(frozen=True)
class PrefixSpec:
    """One pin: chat messages (optionally with tools) or raw text."""

    name: str
    messages: tuple[dict, ...] | None
    text: str | None
    file: Path | None
    tools: Path | None
    tools_data: tuple | None
    # As mlx_lm.server --chat-template-args or the app passes them (enable_thinking, ...).
    chat_template_kwargs: dict | None = None


@dataclass(frozen=True)
class ModelSpec:
    """A model as it is run (path, adapter, KV quantization, overrides) and its pins."""

    identity: ModelIdentity
    prefixes: tuple[PrefixSpec, ...]
    chat_template_kwargs: dict | None = None  # every prefix's default
    line: int = 0  # where its [[model]] table starts in the manifest (1-based), for errors

    @property
    def path(self) -> str:
        """The model as the manifest names it (what messages and the entries' meta call it)."""
        return self.identity.path


@dataclass(frozen=True)
class Manifest:
    path: Path
    models: tuple[ModelSpec, ...]


class _Where:
    """Builds error messages that name the manifest, model, prefix and field at fault."""

    def __init__(self, manifest: Path, model: str = "", prefix: str = ""):
        self.manifest, self.model, self.prefix = manifest, model, prefix

    def at(self, *, model: str | None = None, prefix: str | None = None) -> _Where:
        return _Where(self.manifest, self.model if model is None else model, prefix or "")

    def error(self, field: str | None, problem: str) -> ManifestError:
        parts = [str(self.manifest)]
        if self.model:
            parts.append(self.model)
        if self.prefix:
            parts.append(self.prefix)
        if field:
            parts.append(f"field '{field}'")
        return ManifestError(": ".join(parts) + f": {problem}")


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest; every problem raises ManifestError naming where it is."""
    path = Path(path).expanduser().resolve()  # one name per file: symlinks too
    where = _Where(path)
    if path.exists() and not path.is_file():
        raise where.error(None, "not a regular file; pass --manifest a TOML file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise where.error(None, "manifest file not found; create it or pass --manifest") from None
    except OSError as e:
        raise where.error(None, f"cannot read manifest ({e.strerror})") from None
    try:
        data = tomllib.loads(raw.decode("utf-8-sig"))  # a leading byte-order mark dropped
    except UnicodeDecodeError as e:
        raise where.error(None, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        # tomllib's message carries "(at line N, column M)".
        raise where.error(None, f"TOML syntax error: {e}") from None
    _check_keys(data, _TOP_KEYS, where, "top level")
    models = data.get("model")
    if models is None:
        raise where.error("model", "no [[model]] table; add one with path = '<model dir>'")
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise where.error(
            "model", f"must be an array of tables written as [[model]], got {got(models)}"
        )
    if not models:
        raise where.error("model", "no [[model]] table; add one with path = '<model dir>'")
    lines = _model_lines(raw.decode("utf-8"))
    specs = [_load_model(m, i, where, path.parent) for i, m in enumerate(models)]
    specs = [replace(s, line=lines[i] if i < len(lines) else 0) for i, s in enumerate(specs)]
    return Manifest(path=path, models=_merge_models(specs, where))


def _model_lines(text: str) -> list[int]:
    """1-based line of each top-level [[model]] header, in order."""
    return [
        n for n, line in enumerate(text.splitlines(), 1) if line.strip().startswith("[[model]]")
    ]


def _merge_models(specs: list[ModelSpec], where: _Where) -> tuple[ModelSpec, ...]:
    """Tables naming the same model, run the same way, are one model: their pins merge. A pin
    name in two of them is ambiguous: an error naming both tables."""
    merged: dict[tuple, ModelSpec] = {}
    owner: dict[tuple, dict[str, ModelSpec]] = {}
    for spec in specs:
        key = spec.identity.same_model()
        first = merged.get(key)
        if first is None:
            merged[key] = spec
            owner[key] = {p.name: spec for p in spec.prefixes}
            continue
        for p in spec.prefixes:
            if p.name in owner[key]:
                other = owner[key][p.name]
                raise where.at(model=f"model {spec.path!r}", prefix=f"prefix {p.name!r}").error(
                    "name",
                    f"defined in two [[model]] tables of the same model (line {other.line} and "
                    f"line {spec.line}); rename one, or keep it in one table",
                )
            owner[key][p.name] = spec
        merged[key] = replace(first, prefixes=first.prefixes + spec.prefixes)
    return tuple(merged.values())


def manifest_files(manifest: Manifest) -> list[Path]:
    """The manifest and every file it references: what a watcher must watch."""
    files = [manifest.path]
    for model in manifest.models:
        for prefix in model.prefixes:
            files.extend(p for p in (prefix.file, prefix.tools) if p is not None)
    return list(dict.fromkeys(files))


def _check_keys(table: dict, allowed: tuple[str, ...], where: _Where, what: str) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise where.error(
            unknown[0],
            f"unknown key in {what}; allowed keys are {', '.join(allowed)} (check the spelling)",
        )


def _resolve_local(value: str, base: Path) -> str:
    """Relative paths that exist next to the manifest win, and so does one plainly local
    (`./x`, `../x`: never a hub id), present or not; anything else may be a hub id."""
    expanded = Path(value).expanduser()
    if expanded.is_absolute():
        return str(expanded)
    candidate = base / expanded
    return str(candidate.resolve()) if candidate.exists() or value.startswith(".") else value


def _load_model(table: dict, index: int, where: _Where, base: Path) -> ModelSpec:
    path = table.get("path")
    where = where.at(model=f"model #{index}" + (f" ({path!r})" if isinstance(path, str) else ""))
    _check_keys(table, _MODEL_KEYS, where, "[[model]]")
    if path is None:
        raise where.error("path", "missing; set path to a local model directory or a hub id")
    if not isinstance(path, str) or not path.strip():
        raise where.error(
            "path", f"must be a non-empty string (a model directory or hub id), got {got(path)}"
        )
    adapter = table.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter.strip()):
        raise where.error(
            "adapter", f"must be a non-empty string (an adapter directory), got {got(adapter)}"
        )
    kv_bits = table.get("kv_bits")
    group = table.get("kv_group_size", DEFAULT_KV_GROUP_SIZE)
    qstart = table.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START)
    check_kv_quantization(kv_bits, group, qstart, where)
    model_config = table.get("model_config")
    if model_config is not None:
        if not isinstance(model_config, dict):
            raise where.error(
                "model_config",
                "must be a table of config.json keys, e.g. model_config = { rope_theta = 1e6 }, "
                f"got {got(model_config)}",
            )
        try:
            model_config = json.loads(json.dumps(model_config))
        except (TypeError, ValueError) as e:  # a TOML date, say: not a config.json value
            raise where.error("model_config", f"must hold JSON values only ({e})") from None
    template_kwargs = check_template_kwargs(table.get("chat_template_kwargs"), where)
    prefixes = table.get("prefix", [])
    if not isinstance(prefixes, list) or not all(isinstance(p, dict) for p in prefixes):
        raise where.error(
            "prefix", f"must be an array of tables written as [[model.prefix]], got {got(prefixes)}"
        )
    specs: list[PrefixSpec] = []
    seen: set[str] = set()
    for i, prefix in enumerate(prefixes):
        spec = _load_prefix(prefix, i, where, base, template_kwargs)
        if spec.name in seen:
            raise where.at(prefix=f"prefix {spec.name!r}").error(
                "name", "duplicate prefix name in this model; give each prefix a unique name"
            )
        seen.add(spec.name)
        specs.append(spec)
    local = _resolve_local(path, base)
    identity = ModelIdentity(
        # a directory by its one name (symlinks followed), as an app's pins are stored under it
        path=model_name(local) if Path(local).is_absolute() else local,
        adapter=_resolve_local(adapter, base) if adapter is not None else None,
        kv_bits=kv_bits,
        kv_group_size=group,
        quantized_kv_start=qstart,
        model_config=model_config or None,
    )
    return ModelSpec(identity, tuple(specs), chat_template_kwargs=template_kwargs)


def check_kv_quantization(
    kv_bits: Any, kv_group_size: Any, quantized_kv_start: Any, where: _Where
) -> None:
    """KV quantization as generate() takes it (kvstore.identity.model's one rule), as an error
    naming the manifest, the model and the setting."""
    if problem := kv_quantization_problem(kv_bits, kv_group_size, quantized_kv_start):
        raise where.error(*problem)


def check_template_kwargs(value: Any, where: _Where | None = None) -> dict | None:
    """A chat_template_kwargs table: string keys, none that kvstore passes itself."""
    if value is None:
        return None

    def bad(problem: str) -> Exception:
        if where is None:
            return ManifestError(f"chat_template_kwargs: {problem}")
        return where.error("chat_template_kwargs", problem)

    if not isinstance(value, dict):
        raise bad(f"must be a table, e.g. {{ enable_thinking = false }}, got {got(value)}")
    for key in value:
        if not isinstance(key, str):
            raise bad(f"keys must be strings, got {key!r}")
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise bad(f"{key!r} is set by kvstore as mlx_lm.server sets it; remove it")
    return dict(value)


def _load_prefix(
    table: dict, index: int, where: _Where, base: Path, template_kwargs: dict | None = None
) -> PrefixSpec:
    name = table.get("name")
    where = where.at(prefix=f"prefix {name!r}" if isinstance(name, str) else f"prefix #{index}")
    _check_keys(table, _PREFIX_KEYS, where, "[[model.prefix]]")
    if name is None:
        raise where.error("name", "missing; every prefix needs a name (its label in the store)")
    if problem := pin_name_problem(name):
        raise where.error("name", problem)
    messages, text = table.get("messages"), table.get("text")
    file_value, tools_value = table.get("file"), table.get("tools")
    if text is not None and (messages is not None or file_value is not None):
        raise where.error("text", "give either text or messages/file, not both")
    if text is None and messages is None and file_value is None:
        raise where.error("messages", "missing; give messages (or file) for a chat pin, or text")
    file = _file_path(file_value, "file", where, base)
    tools = _file_path(tools_value, "tools", where, base)
    if text is not None:
        if not isinstance(text, str) or not text:
            raise where.error("text", f"must be a non-empty string, got {got(text)}")
        if tools is not None:
            raise where.error(
                "tools", "tools apply to chat messages only; remove them or use messages"
            )
        if table.get("chat_template_kwargs") is not None:
            raise where.error("chat_template_kwargs", "applies to chat messages only; remove it")
        return PrefixSpec(name, None, text, None, None, None)
    file_text = _read_text(file, "file", where) if file is not None else None
    msgs = _check_messages(messages, file_text, where)
    tools_data = _read_tools(tools, where) if tools is not None else None
    own = check_template_kwargs(table.get("chat_template_kwargs"), where)
    merged = {**(template_kwargs or {}), **(own or {})} if (template_kwargs or own) else None
    return PrefixSpec(name, msgs, None, file, tools, tools_data, merged)


def oversized(prefix: PrefixSpec, max_tokens: int) -> str | None:
    """Why `prefix` cannot fit `max_tokens` tokens by its size alone (one line naming its file,
    or its messages, their size and the limit), or None. Rendering a pin tokenizes its content
    several times over (kvstore.pins.render): this asks nothing of a tokenizer."""
    parts = (
        [prefix.text] if prefix.text is not None else [m["content"] for m in prefix.messages or ()]
    )
    size = sum(len(p.encode("utf-8", "surrogatepass")) for p in parts)
    limit = max_tokens * MAX_BYTES_PER_TOKEN
    if size <= limit:
        return None
    if prefix.text is not None:
        what = "its text is"
    elif prefix.file is not None:  # the file fills the system message
        what = f"{prefix.file} is" if len(parts) == 1 else f"its messages with {prefix.file} are"
    else:
        what = "its messages are"
    return (
        f"pin {prefix.name!r}: {what} {size:,} bytes, over the {limit:,} bytes that "
        f"max_pin_tokens={max_tokens:,} tokens can hold (at most {MAX_BYTES_PER_TOKEN} bytes a "
        f"token); not tokenized: shorten it or raise max_pin_tokens in settings.toml"
    )


def pin_name_problem(name: Any) -> str | None:
    """Why `name` cannot name a pin (its label in the store, a row of the `warm` and `ls`
    tables), or None: it must be a non-empty string without control or format characters."""
    if not isinstance(name, str) or not name.strip():
        return f"must be a non-empty string, got {got(name)}"
    for i, ch in enumerate(name):
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):  # newline, tab, NUL, U+202E...
            return (
                f"{name!r} holds a control character ({ch!r} at position {i}); a pin name is "
                "one line of printable text (it is a row of `kvstore ls`)"
            )
    return None


def _check_messages(value: Any, file_text: str | None, where: _Where) -> tuple[dict, ...]:
    if value is None:
        return ({"role": "system", "content": file_text},)
    if not isinstance(value, list) or not value:
        raise where.error(
            "messages", f"must be a non-empty list of {{ role, content }} tables, got {got(value)}"
        )
    out: list[dict] = []
    replaced = False
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise where.error(
                "messages",
                f"item {i} must be a table {{ role = ..., content = ... }}, got {got(msg)}",
            )
        _check_keys(msg, _MESSAGE_KEYS, where, f"messages item {i}")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str):
            raise where.error(
                "messages",
                f"item {i}: role must be a string, one of {_list(ROLES)}; got {got(role)}",
            )
        if role not in ROLES:
            raise where.error(
                "messages", f"item {i}: unknown role {role!r}; use one of {_list(ROLES)}"
            )
        if file_text is not None and role == "system" and not replaced:
            # The file supplies this message's content, so the inline content may be omitted.
            content, replaced = file_text, True
        if not isinstance(content, str):
            raise where.error("messages", f"item {i}: content must be a string, got {got(content)}")
        out.append({"role": role, "content": content})
    if file_text is not None and not replaced:
        raise where.error("file", "messages has no system message for the file's text to fill")
    return tuple(out)


def _file_path(value: Any, field: str, where: _Where, base: Path) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise where.error(
            field, f"must be a non-empty string (a path relative to the manifest), got {got(value)}"
        )
    path = (base / Path(value).expanduser()).resolve()
    if path.is_dir():
        raise where.error(field, f"{path} is a directory; name a file in it")
    if not path.exists():
        raise where.error(field, f"file not found: {path}; create it or fix the path")
    if not path.is_file():  # a device, FIFO or socket: reading it would never end, or block
        raise where.error(field, f"{path} is not a regular file; name a text file")
    return path


def _read_text(path: Path, field: str, where: _Where) -> str:
    try:  # utf-8-sig: a byte-order mark some editors write is dropped, as editors show the file
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise where.error(field, f"cannot read {path} as UTF-8 text: {e}") from None


def _read_tools(path: Path, where: _Where) -> tuple:
    try:
        tools = json.loads(_read_text(path, "tools", where))
    except json.JSONDecodeError as e:
        raise where.error("tools", f"{path} is not valid JSON: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise where.error("tools", f"{path} must hold a JSON list of tool schema objects")
    return tuple(tools)


def _list(values: tuple) -> str:
    return ", ".join(str(v) for v in values)
