"""`kvstore export` and `kvstore import`: entries to and from mlx-lm prompt-cache files."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from kvstore.codec import cache_api, codec
from kvstore.errors import CodecError, KVStoreError, StoreError
from kvstore.identity.fingerprint import (
    FileHashCache,
    describe_cache,
    model_fingerprint,
    resolve_model_path,
    template_hash,
)
from kvstore.identity.model import DEFAULT_KV_GROUP_SIZE, ModelIdentity
from kvstore.settings import FILEHASH_NAME
from kvstore.store.entry import EntryMeta, entry_key, pack_tokens
from kvstore.store.store import Store
from kvstore.warm.importfit import check_fits


def write_file(blob: bytes | memoryview, file: Path, *, name: str = "blob") -> None:
    """Write a stored blob as a prompt-cache file the installed mlx-lm's `load_prompt_cache`
    loads: the blob as it is (mlx-lm 0.32's layout), or under mlx-lm 0.31 the decoded cache
    written by its own `save_prompt_cache`. Atomic: `file` is whole or untouched."""
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp.safetensors")
    try:
        if cache_api.META_STATE:
            cache, user = codec.decode(blob, name=name)
            try:
                cache_api.save_file(tmp, cache, user)
            except (RuntimeError, ValueError) as e:
                raise KVStoreError(
                    f"{name}: mlx-lm {cache_api.version()}'s save_prompt_cache cannot write this "
                    f"cache ({e}); export it with mlx-lm 0.32 or later"
                ) from None
        else:
            tmp.write_bytes(blob)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def export_entry(store: Store, key: bytes, file: Path) -> EntryMeta:
    """Write one entry as a prompt-cache file (`write_file`), with `model` and `tokenizer_config`
    metadata."""
    meta, _ = store.load(key)  # verifies checksum and decodes before anything is written
    folder = file.parent
    if not folder.is_dir():
        raise KVStoreError(
            f"{folder}: no such folder to write {file.name} in; create it or choose another path"
        )
    try:
        write_file(store.read_blob(key), file, name=key.hex())
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
    from kvstore.codec.blocks import assemble
    from kvstore.store.blocks import BlockStore

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
    path = model or last.extra.get("model")
    if not path:
        raise KVStoreError(
            f"learned record {key.hex()} does not say which model made it; pass --model PATH"
        )
    config = None if model else last.extra.get("model_config")
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
    blob = codec.encode(cache, {"model": path, "tokenizer_config": "{}"})
    try:
        write_file(blob, file, name=key.hex())
    except OSError as e:
        raise KVStoreError(f"{file}: cannot write it: {e.strerror or e}") from None
    return chain, path


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


def import_file(
    store: Store,
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
) -> EntryMeta:
    """Validate a prompt-cache file against the model (layers, heads, head dims, dtype, KV
    quantization, its own `model` metadata) and the tokens, then check that its KV is what this
    model computes for these tokens (re-prefilled, kvstore.warm.importfit.kv_check) and store it;
    nothing is stored for a file that does not fit or differs. `trust` skips the re-prefill: the
    entry is stored marked `trusted` (unchecked), as `ls` and `verify` show."""
    blob = Path(file).read_bytes()
    try:
        cache, metadata = codec.decode(blob, name=str(file), either_layout=True)
    except CodecError as e:
        raise KVStoreError(f"not a valid prompt-cache file: {e}") from None  # e names the file
    model_dir = resolve_model_path(model)
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
    else:
        tokens = _prompt_tokens(model_dir, prompt or "")
    from kvstore.identity.modelconfig import effective_config
    from kvstore.warm.prefill import check_token_ids, config_vocab_size

    try:  # ids past the model's vocabulary: no prefill of this model could have made the file
        vocab = config_vocab_size(effective_config(model_dir, model_config))
        tokens = list(check_token_ids(tokens, vocab, what=str(tokens_file or "--prompt")))
    except ValueError as e:
        raise KVStoreError(str(e)) from None
    check_fits(
        cache,
        metadata,
        file=Path(file),
        model=model,
        model_dir=model_dir,
        adapter=adapter,
        model_config=model_config,
    )
    quantized = [c for c in cache if type(c).__name__ == "QuantizedKVCache"]
    identity = ModelIdentity(
        model,
        adapter,
        kv_bits=quantized[0].bits if quantized else None,
        kv_group_size=quantized[0].group_size if quantized else DEFAULT_KV_GROUP_SIZE,
        model_config=model_config,
    )
    fp = model_fingerprint(
        replace(identity, path=str(model_dir)), hash_cache=FileHashCache(home / FILEHASH_NAME)
    )
    # the file's layout, with quantized layers read back as the plain KVCache the model makes
    got = tuple(
        ("KVCache",) if type(c).__name__ == "QuantizedKVCache" else describe_cache(c) for c in cache
    )
    if got != fp.layout:
        raise KVStoreError(
            f"{file}: cache layout {[g[0] for g in got]} does not match model {model!r} "
            f"({[g[0] for g in fp.layout]}); was it made with another model?"
        )
    held = codec.cache_tokens(cache)
    if held != len(tokens) and not (held is None and codec.keeps_no_offset(cache)):
        raise KVStoreError(
            f"{file}: the cache holds {held} tokens but the given prompt has {len(tokens)}; "
            "pass the exact prompt (or --tokens) it was made from"
        )
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
    return store.put(
        entry_key(fp.digest, tokens),
        blob,
        tokens=pack_tokens(tokens),
        label=label,
        pinned=pin,
        model=model,
        template_hash=template_hash(model_dir),
        classes=codec.cache_classes(cache),
        extra={
            **state,
            "source": "import",
            **(
                {"trusted": True, "checked": False}
                if trust
                else {"checked": True, "check": checked}
            ),
        },
    )


def _check_kv(cache, tokens, file, identity: ModelIdentity, model_dir, fp) -> str:
    """Re-prefill with the model as given and compare (kvstore.warm.importfit.kv_check); what was
    compared, in words. Raises ImportMismatch (nothing stored) when the KV differs."""
    from kvstore.warm.importfit import kv_check, loaded_for_check

    with loaded_for_check(identity, model_dir, fp) as loaded:
        return kv_check(loaded, cache, tokens, what=str(file))
