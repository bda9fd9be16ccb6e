"""`kvstore export` and `kvstore import`: entries to and from mlx-lm prompt-cache files."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from kvstore import mlxlm
from kvstore.codec import cache_api, codec
from kvstore.errors import CodecError, CorruptEntryError, KVStoreError, StoreError
from kvstore.home.settings import FILEHASH_NAME
from kvstore.identity.fingerprint import (
    FileHashCache,
    describe_cache,
    model_fingerprint,
    resolve_model_path,
    template_hash,
)
from kvstore.identity.model import DEFAULT_KV_GROUP_SIZE, ModelIdentity, entry_model_name
from kvstore.learned.blockstore import load_entry
from kvstore.store.entry import EntryMeta, entry_fields, entry_key, pack_tokens
from kvstore.store.store import Store
from kvstore.warm.importfit import check_fits

# The user-metadata key an export writes the entry's token ids under (a JSON list): what
# `kvstore import` reads when neither --tokens nor --prompt is given. mlx-lm's loader passes
# user metadata through untouched (its values must be strings).
TOKEN_IDS_KEY = "token_ids"


def write_file(
    blob: bytes | memoryview,
    file: Path,
    *,
    name: str = "blob",
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a stored blob as a prompt-cache file the installed mlx-lm's `load_prompt_cache`
    loads: the blob as it is (mlx-lm 0.32's layout), or under mlx-lm 0.31 the decoded cache
    written by its own `save_prompt_cache`. `metadata` replaces keys of the blob's user metadata
    (the cache is then re-encoded). Atomic: `file` is whole or untouched."""
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp.safetensors")
    try:
        if metadata or cache_api.META_STATE:
            cache, user = codec.decode(blob, name=name)
            if metadata:  # mlx_lm.generate reads tokenizer_config from every prompt-cache file
                user = {"tokenizer_config": "{}", **user, **metadata}
        if cache_api.META_STATE:
            try:
                cache_api.save_file(tmp, cache, user)
            except (RuntimeError, ValueError) as e:
                raise KVStoreError(
                    f"{name}: mlx-lm {mlxlm.version()}'s save_prompt_cache cannot write this "
                    f"cache ({e}); export it with mlx-lm 0.32 or later"
                ) from None
        else:
            tmp.write_bytes(codec.encode(cache, user) if metadata else blob)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def exported_model_path(meta: EntryMeta) -> str:
    """The model path an export names: its name (`entry_model_name`: a hub id as stored, mlx-lm
    resolves it anywhere; a local path as the absolute directory it resolved to when stored):
    `mlx_lm.generate --model PATH --prompt-cache-file` compares the two, and a relative one holds
    only in the folder the entry was made from."""
    return _absolute_if_local(entry_model_name(meta.model, meta.model_dir))


def _looks_local(model: str) -> bool:
    return model.startswith((".", "/", "~")) or Path(model).expanduser().is_absolute()


def _absolute_if_local(model: str) -> str:
    given = Path(model).expanduser()
    return str(given.resolve()) if _looks_local(model) and given.is_dir() else model


def export_entry(store: Store, key: bytes, file: Path) -> EntryMeta:
    """Write one entry as a prompt-cache file (`write_file`), with `model` (resolved:
    `exported_model_path`), `tokenizer_config` and `token_ids` (JSON) metadata, so that
    `kvstore import FILE --model M` needs neither --tokens nor --prompt."""
    meta, cache = load_entry(store, key)  # verifies checksum and decodes before anything is written
    folder = file.parent
    if not folder.is_dir():
        raise KVStoreError(
            f"{folder}: no such folder to write {file.name} in; create it or choose another path"
        )
    user = {
        "model": exported_model_path(meta),
        TOKEN_IDS_KEY: json.dumps(meta.token_ids(), separators=(",", ":")),
    }
    try:
        if meta.extra.kv_layers:  # a state-only snapshot: the whole cache, assembled
            from kvstore.codec import codec

            blob = codec.encode(cache)
        else:
            blob = store.read_blob(key)
        write_file(blob, file, name=key.hex(), metadata=user)
    except OSError as e:
        raise KVStoreError(f"{file}: cannot write it: {e.strerror or e}") from None
    return meta


def record_template(model: str, model_config: dict | None = None) -> list:
    """The cache objects `make_prompt_cache` gives the model at `model`, built from its config
    alone (no weights are read): the classes a learned chain is assembled in (a sliding-window
    layer must come back as a RotatingKVCache, which the records, plain KV, do not say)."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore.identity.fingerprint import build_architecture
    from kvstore.identity.modelconfig import effective_config

    model_dir = resolve_model_path(model)
    config = effective_config(model_dir, model_config)
    return make_prompt_cache(build_architecture(config, model_dir))


def export_record(store: Store, key: bytes, file: Path, *, model: str | None = None):
    """Write the learned chain from position 0 up to and including the record `key` as one
    prompt-cache file (`write_file`), with `model` and `tokenizer_config` metadata as entry
    exports have. The cache is assembled in the classes of the model the records were learned
    with (their `model`; `model` overrides it, e.g. when the model moved). Returns the chain's
    BlockMeta list and the model path written."""
    from kvstore.learned.blockstore import BlockStore
    from kvstore.learned.records import assemble

    blocks = BlockStore(store)
    try:
        chain = blocks.chain_to(key)
    except StoreError as e:
        raise KVStoreError(f"cannot export learned record {key.hex()}: {e}") from None
    blobs = blocks.read_blobs(chain)
    if len(blobs) != len(chain):
        bad = chain[len(blobs)]
        raise KVStoreError(
            f"learned record {bad.key.hex()} [{bad.start}, {bad.end}) is missing or corrupt "
            "(checksum); nothing written"
        )
    last = chain[-1]
    path = model or last.extra.model
    if not path:
        raise KVStoreError(
            f"learned record {key.hex()} does not say which model made it; pass --model PATH"
        )
    config = None if model else last.extra.model_config
    try:
        template = record_template(path, config)
    except (KVStoreError, OSError) as e:
        raise KVStoreError(
            f"cannot build the cache layout of model {path!r} for learned record {key.hex()}: "
            f"{e}; pass --model PATH"
        ) from None
    try:
        cache = assemble(blobs, chain, last.end, template)
    except CodecError as e:
        raise KVStoreError(f"cannot assemble learned record {key.hex()}: {e}") from None
    folder = file.parent
    if not folder.is_dir():
        raise KVStoreError(
            f"{folder}: no such folder to write {file.name} in; create it or choose another path"
        )
    from kvstore.store.entry import unpack_tokens

    tokens = [t for b in chain for t in unpack_tokens(b.tokens)]
    user = {
        "model": _absolute_if_local(path),
        "tokenizer_config": "{}",
        TOKEN_IDS_KEY: json.dumps(tokens, separators=(",", ":")),
    }
    blob = codec.encode(cache, user)
    try:
        write_file(blob, file, name=key.hex())
    except OSError as e:
        raise KVStoreError(f"{file}: cannot write it: {e.strerror or e}") from None
    return chain, path


def _file_tokens(metadata: dict[str, str], file: Path) -> list:
    """The token ids `kvstore export` wrote in a file's metadata; a one-line error when absent."""
    raw = metadata.get(TOKEN_IDS_KEY)
    if raw is None:
        raise KVStoreError(
            f"{file} carries no token ids (it was not written by `kvstore export`); give the "
            "tokens it was made from with --tokens TOKENS.json or --prompt TEXT"
        )
    try:
        tokens = json.loads(raw)
    except ValueError as e:
        raise KVStoreError(f"{file}: its {TOKEN_IDS_KEY} metadata is not JSON: {e}") from None
    if not isinstance(tokens, list):
        raise KVStoreError(f"{file}: its {TOKEN_IDS_KEY} metadata is not a list of token ids")
    return tokens


def _prompt_tokens(model_dir: Path, prompt: str) -> list[int]:
    """Tokenize as mlx_lm.cache_prompt does: a user turn continued, or plain text."""
    from kvstore.identity.modelconfig import load_tokenizer

    tok = load_tokenizer(model_dir, str(model_dir))
    if tok.has_chat_template:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=False,
            continue_final_message=True,
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tok.encode(prompt))


class EntryWriter(Protocol):
    """Where an import puts the entry: the put operation on a store here or through the daemon
    (kvstore.ops.put.LocalWriter, DaemonWriter)."""

    def put(self, key: bytes, blob: bytes, **fields: Any) -> EntryMeta: ...


def import_file(
    writer: EntryWriter,
    file: Path,
    *,
    model: str,
    tokens_file: Path | None = None,
    prompt: str | None = None,
    adapter: str | None = None,
    model_config: dict | None = None,
    label: str = "imported",
    pin: bool = False,
    trust: bool = False,
    home: Path,
    reader: Store,
) -> EntryMeta:
    """Validate a prompt-cache file against the model (layers, heads, head dims, dtype, KV
    quantization, its own `model` metadata) and the tokens, then check that its KV is what this
    model computes for these tokens (re-prefilled, kvstore.warm.importfit.kv_check) and store it;
    nothing is stored for a file that does not fit or differs. `trust` skips the re-prefill: the
    entry is stored marked `trusted` (unchecked), as `ls` and `verify` show.

    Without `tokens_file` or `prompt`, the token ids are the ones `kvstore export` wrote in the
    file's metadata. KV the store already holds (read from `reader`) is not imported
    again: AlreadyStored names the entry, which keeps its label, owners and pin state."""
    blob = Path(file).read_bytes()
    try:
        cache, metadata = codec.decode(blob, name=str(file), either_layout=True)
    except CodecError as e:
        raise KVStoreError(f"not a valid prompt-cache file: {e}") from None  # e names the file
    model_dir = resolve_model_path(model)
    tokens = _import_tokens(
        metadata, file, model_dir, tokens_file=tokens_file, prompt=prompt, model_config=model_config
    )
    check_fits(
        cache,
        metadata,
        file=Path(file),
        model=model,
        model_dir=model_dir,
        adapter=adapter,
        model_config=model_config,
    )
    identity = _file_identity(cache, model, adapter, model_config)
    fp = model_fingerprint(
        replace(identity, path=str(model_dir)), hash_cache=FileHashCache(home / FILEHASH_NAME)
    )
    _check_layout(cache, tokens, file, model, fp.layout)
    key = entry_key(fp.digest, tokens)
    keep = _stored(reader, key, tokens, file)
    checked = None
    if not trust:
        checked = _check_kv(cache, tokens, file, identity, model_dir, fp)
    metadata = {
        "model": metadata.get("model", model),
        "tokenizer_config": metadata.get("tokenizer_config", "{}"),
    }
    blob = codec.encode(cache, metadata)
    state = identity.state
    del state["quantized_kv_start"]  # where the file's KV began to be quantized is not known
    fields = entry_fields(
        tokens,
        label=keep.label if keep is not None else label,
        pinned=keep.pinned if keep is not None else pin,
        model=model,
        template_hash=template_hash(model_dir),
        classes=codec.cache_classes(cache),
        state=state,
        source="import",
        **({"trusted": True, "checked": False} if trust else {"checked": True, "check": checked}),
        # its blob went bad: the import replaces it, in the entry's own name
        extra={k: v for k, v in keep.extra.to_map().items() if k in _KEPT} if keep else None,
    )
    return writer.put(key, blob, **fields.as_kwargs())


def _import_tokens(
    metadata: dict[str, str],
    file: Path,
    model_dir: Path,
    *,
    tokens_file: Path | None,
    prompt: str | None,
    model_config: dict | None,
) -> list[int]:
    """The token ids an import stores the file under (--tokens, --prompt, or the ids an export
    wrote in its metadata), checked against the model's vocabulary."""
    if tokens_file is not None and prompt is not None:
        raise KVStoreError("give at most one of --tokens TOKENS.json or --prompt TEXT")
    source = str(tokens_file or "--prompt")
    if tokens_file is not None:
        try:
            tokens = json.loads(Path(tokens_file).read_text())
            if not (
                isinstance(tokens, list)
                and all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens)
            ):
                raise ValueError("expected a JSON list of token ids (integers 0 .. 2**32-1)")
        except (OSError, ValueError) as e:
            raise KVStoreError(f"{tokens_file}: cannot read token ids: {e}") from None
    elif prompt is not None:
        tokens = _prompt_tokens(model_dir, prompt)
    else:
        tokens, source = _file_tokens(metadata, file), f"{file} ({TOKEN_IDS_KEY} metadata)"
    from kvstore.identity.modelconfig import effective_config
    from kvstore.kvcheck.prefill import check_token_ids, config_vocab_size

    try:  # ids past the model's vocabulary: no prefill of this model could have made the file
        vocab = config_vocab_size(effective_config(model_dir, model_config))
        return list(check_token_ids(tokens, vocab, what=source))
    except ValueError as e:
        raise KVStoreError(str(e)) from None


def _file_identity(
    cache: list, model: str, adapter: str | None, model_config: dict | None
) -> ModelIdentity:
    """The model identity the file's KV was made with (its KV quantization read from the cache)."""
    quantized = [c for c in cache if type(c).__name__ == "QuantizedKVCache"]
    return ModelIdentity(
        model,
        adapter,
        kv_bits=quantized[0].bits if quantized else None,
        kv_group_size=quantized[0].group_size if quantized else DEFAULT_KV_GROUP_SIZE,
        model_config=model_config,
    )


def _check_layout(cache: list, tokens: list[int], file: Path, model: str, layout: tuple) -> None:
    """The file's cache layout is the model's, and it holds as many tokens as were given."""
    # the file's layout, with quantized layers read back as the plain KVCache the model makes
    got = tuple(
        ("KVCache",) if type(c).__name__ == "QuantizedKVCache" else describe_cache(c) for c in cache
    )
    if got != layout:
        raise KVStoreError(
            f"{file}: cache layout {[g[0] for g in got]} does not match model {model!r} "
            f"({[g[0] for g in layout]}); was it made with another model?"
        )
    held = codec.cache_tokens(cache)
    if held != len(tokens) and not (held is None and codec.keeps_no_offset(cache)):
        raise KVStoreError(
            f"{file}: the cache holds {held} tokens but the given prompt has {len(tokens)}; "
            "pass the exact prompt (or --tokens) it was made from"
        )


# What an import that replaces a damaged entry keeps of it: whose it is and where it came from.
_KEPT = ("source", "manifest", "owners", "origin")


class AlreadyStored(KVStoreError):
    """The file's KV is an entry the store already holds (same model fingerprint and tokens):
    nothing is imported, and the entry keeps its label, owners and pin state. `meta` is it."""

    def __init__(self, msg: str, meta: EntryMeta):
        super().__init__(msg)
        self.meta = meta


def _stored(reader: Store, key: bytes, tokens: list[int], file: Path) -> EntryMeta | None:
    """Raise AlreadyStored when `reader` holds a sound entry for `key` and `tokens`; return the
    entry when its blob went bad (the import replaces it), else None."""
    try:
        meta = reader.get_meta(key)
    except CorruptEntryError:
        return None
    if meta is None or meta.tokens != pack_tokens(tokens):
        return None
    if not reader.blob_ok(meta):
        return meta
    what = f"pin {meta.label!r}" if meta.pinned else f"entry {meta.label!r}"
    where = f"manifest {meta.manifest}" if meta.source == "manifest" and meta.manifest else None
    where = where or (f"source {meta.source}" if meta.source else "")
    raise AlreadyStored(
        f"{file}: already stored as {what}" + (f" ({where})" if where else "")
        + f", key {key.hex()}; kept as it is, nothing imported",
        meta,
    )  # fmt: skip


def _check_kv(cache, tokens, file, identity: ModelIdentity, model_dir, fp) -> str:
    """Re-prefill with the model as given and compare (kvstore.warm.importfit.kv_check); what was
    compared, in words. Raises ImportMismatch (nothing stored) when the KV differs."""
    from kvstore.warm.importfit import kv_check, loaded_for_check

    with loaded_for_check(identity, model_dir, fp) as loaded:
        return kv_check(loaded, cache, tokens, what=str(file))
