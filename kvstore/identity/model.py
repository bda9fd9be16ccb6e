"""A model as it is run: the one value that says which KV a model computes for given tokens.

`ModelIdentity` is the path, the LoRA adapter, the KV quantization (as `generate(kv_bits=,
kv_group_size=, quantized_kv_start=)` takes it) and the load-time config overrides (as
`mlx_lm.load(model_config=)` takes them). The manifest builds one per `[[model]]` table, the client
one from its keyword arguments, and an entry's meta stores it: the path is the meta's `model`,
the rest is `state` in its `extra` (keys unchanged since schema 1, so old stores read as before).
`model_fingerprint` hashes what it names; `same_model()` is the key two of them compare by.

A model's name is one string everywhere (`model_name`): a local directory as its resolved
absolute folder, a hub id as given. Entries, learned records and the ledger are stored under it,
an entry's identity is read under it (`entry_model_name`: older entries stored the path as an app
gave it, `./tiny-llama`), and `--model` filters are read as it, so a filter matches what `ls`
shows whichever way the model was named.

Chat-template arguments are not part of it: they change which tokens a pin renders to (and so
the entry's key), never the KV a model computes for given tokens. They stay with the prefix
(`PrefixSpec`) and the entry (`EntryMeta.chat_template_kwargs`).

`ResolvedModel` is an identity located on this machine: its directory, and its effective config
and template hash read from there at most once (a warm's plan makes one per model, and every later
step of that warm takes them from it instead of reading them again).

No mlx here: the manifest, the CLI and the entry meta use this without loading a model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TypedDict

from kvstore.errors import ManifestError, got

KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_KV_GROUP_SIZE = 64  # mlx_lm.generate's default
DEFAULT_QUANTIZED_KV_START = 5000  # mlx_lm.generate's default: KV quantized from this offset on


class IdentityKeywords(TypedDict, total=False):
    """The keyword arguments an app names its model's identity with (`load`, `hydrate`,
    `PersistentPromptCache`), as mlx_lm's load and generate take them."""

    adapter_path: str | Path | None
    kv_bits: int | None
    kv_group_size: int
    quantized_kv_start: int
    model_config: dict | None


IDENTITY_KEYWORDS = tuple(IdentityKeywords.__annotations__)


@dataclass(frozen=True)
class ModelIdentity:
    """A model (a directory or hub id, as given), its adapter, KV quantization and overrides.

    Not hashable when it has overrides (a dict): compare and group by `same_model()`."""

    path: str
    adapter: str | None = None
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    model_config: dict | None = None  # load-time overrides, as mlx_lm.load(model_config=)

    @property
    def state(self) -> dict[str, Any]:
        """The msgpack-able form an entry's meta `extra` holds (the path is the meta's `model`)."""
        return {
            "adapter": self.adapter,
            "kv_bits": self.kv_bits,
            "kv_group_size": self.kv_group_size,
            "quantized_kv_start": self.quantized_kv_start,
            "model_config": self.model_config,
        }

    @classmethod
    def given(cls, path: Any, keywords: dict[str, Any] | None = None) -> ModelIdentity:
        """The identity an app's keyword arguments name (IdentityKeywords; the ones of them in
        `keywords` are taken out of it), as given: types unchecked (the client checks them and
        turns a wrong one into its one warning)."""
        rows = {k: keywords.pop(k) for k in IDENTITY_KEYWORDS if k in keywords} if keywords else {}
        adapter = rows.pop("adapter_path", None)
        return cls(path, adapter, **rows)

    @classmethod
    def of_entry(cls, meta: Any) -> ModelIdentity:
        """The model a stored entry was made with (path, adapter, KV quantization, overrides):
        its `extra` holds the identity state, its `model` and `model_dir` the name
        (`entry_model_name`)."""
        return cls.from_state(meta.extra.to_map(), entry_model_name(meta.model, meta.model_dir))

    @classmethod
    def from_state(cls, state: dict[str, Any], path: str) -> ModelIdentity:
        """The identity `state` (an entry's `extra`, other keys ignored) stores for `path`;
        keys an older entry lacks take generate's defaults. Read as stored, never validated:
        a stored value is compared, not run."""
        return cls(
            path=path,
            adapter=state.get("adapter"),
            kv_bits=state.get("kv_bits"),
            kv_group_size=state.get("kv_group_size", DEFAULT_KV_GROUP_SIZE),
            quantized_kv_start=state.get("quantized_kv_start", DEFAULT_QUANTIZED_KV_START),
            model_config=state.get("model_config"),
        )

    def same_model(self) -> tuple:
        """What makes two identities the same model run the same way: group size and quantized
        start count only when the KV is quantized; no overrides and {} are the same."""
        quant = (self.kv_group_size, self.quantized_kv_start) if self.kv_bits else (None, None)
        return (self.path, self.adapter, self.kv_bits, *quant, overrides_key(self.model_config))

    def check(self) -> ModelIdentity:
        """Itself; ManifestError naming the first KV quantization setting that generate() would
        not take (never a fingerprint no entry was made under)."""
        if problem := kv_quantization_problem(
            self.kv_bits, self.kv_group_size, self.quantized_kv_start
        ):
            raise ManifestError(f"{problem[0]}: {problem[1]}")
        return self


@dataclass(frozen=True)
class ResolvedModel:
    """A ModelIdentity and where it is here: `directory` (resolved once, by
    kvstore.identity.fingerprint.resolve_model), its effective `config` (config.json with the
    identity's overrides) and its `template_hash`, each read from that directory on first use
    and then kept: one read per model per warm."""

    identity: ModelIdentity
    directory: Path

    @property
    def path(self) -> str:
        """The model as given (a directory or hub id)."""
        return self.identity.path

    @cached_property
    def config(self) -> dict:
        """config.json as mlx_lm.load reads it, the identity's overrides merged in."""
        from kvstore.identity.modelconfig import check_overrides, effective_config

        return effective_config(self.directory, check_overrides(self.identity.model_config))

    @cached_property
    def template_hash(self) -> bytes:
        """Hash of the chat template, tokenizer files and special tokens (16 bytes)."""
        from kvstore.identity.modelconfig import template_digest

        return template_digest(self.directory)

    @cached_property
    def location(self) -> dict[str, str]:
        """Where the model (and its adapter, when that is a directory) resolved here, as an
        entry's extra records them (`model_dir`, `adapter_dir`; kvstore.store.entry's
        model_location, without resolving the model again)."""
        out = {"model_dir": str(self.directory)}
        if self.identity.adapter:
            adir = Path(self.identity.adapter).expanduser()
            if adir.is_dir():
                out["adapter_dir"] = str(adir.resolve())
        return out


def model_name(model: str | Path) -> str:
    """The one name of a model: a local directory (a relative path read from this process's
    current directory, `~` expanded) as its resolved absolute folder, symlinks followed; anything
    else (a hub id, a directory not here) as given."""
    p = Path(model).expanduser()
    try:
        return str(p.resolve()) if p.is_dir() else str(model)
    except OSError:  # a path the OS refuses (too long, a loop): not a directory here
        return str(model)


def entry_model_name(model: str, model_dir: Any) -> str:
    """The name (`model_name`) of the model an entry or learned record was stored for: its
    `model` when that is an absolute path or a hub id; a path stored as an app gave it
    (`./tiny-llama`, by versions before names were resolved) is named by the absolute folder its
    put recorded (`model_dir`), where one was recorded."""
    if Path(model).is_absolute() or not (
        isinstance(model_dir, str) and Path(model_dir).is_absolute()
    ):
        return model
    hub_id = _HUB_ID.fullmatch(model) and not model.startswith((".", "~"))
    if hub_id and "snapshots" in Path(model_dir).parts:
        return model  # the folder is this machine's hub-cache snapshot of the id
    return model_dir


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # what resolve_model_path looks up in the hub cache


def overrides_key(model_config: dict | None) -> str | None:
    """A hashable, order-free form of load-time overrides (None and {} are both none)."""
    return json.dumps(model_config, sort_keys=True, default=str) if model_config else None


def kv_quantization_problem(
    kv_bits: Any, kv_group_size: Any, quantized_kv_start: Any
) -> tuple[str, str] | None:
    """The one rule for KV quantization, as generate() takes it: (setting, what is wrong with
    it and what it must be) for the first wrong one, or None."""
    if kv_bits is not None and (not _is_int(kv_bits) or kv_bits not in KV_BITS):
        return "kv_bits", f"must be an integer, one of {_list(KV_BITS)}; got {got(kv_bits)}"
    if not _is_int(kv_group_size) or kv_group_size not in KV_GROUP_SIZES:
        return (
            "kv_group_size",
            f"must be an integer, one of {_list(KV_GROUP_SIZES)}; got {got(kv_group_size)}",
        )
    if not _is_int(quantized_kv_start) or quantized_kv_start < 0:
        return "quantized_kv_start", f"must be an integer >= 0; got {got(quantized_kv_start)}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _list(values: tuple) -> str:
    return ", ".join(str(v) for v in values)
