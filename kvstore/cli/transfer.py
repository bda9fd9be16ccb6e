"""`kvstore export | import | fingerprint`: entries as mlx-lm prompt-cache files; identity."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from kvstore.cli.options import (
    home_option,
    human_size,
    open_store,
    parse_json_object,
    pin_label,
    resolve_keys,
    user_errors,
)
from kvstore.store.keys import digest_hex


@click.command(name="export")
@click.argument("key")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--model",
    default=None,
    help="For a learned record: the model path whose cache layout it is assembled in "
    "(default: the model the record was learned with).",
)
@home_option
@user_errors
def export_cmd(key: str, file: Path, model: str | None, home: Path) -> None:
    """Write an entry, or a learned chain, as a file `mlx_lm.generate --prompt-cache-file FILE`
    loads.

    KEY is an entry's key (as `kvstore ls` shows it) or a learned record's (`kvstore ls
    --learned`): the chain from the first token up to the end of that record is assembled from
    its blocks into one cache.
    """
    from kvstore.learned.blockstore import BlockStore
    from kvstore.warm.transfer import export_entry, export_record

    with open_store(home) as store:
        records = [m.key for m in BlockStore(store).records()]
        entry_hits = _matches(store.keys(), key)
        record_hits = _matches(records, key)
        if record_hits and not entry_hits:
            (k,) = resolve_keys(store, (key,), keys=records, what="learned record")
            chain, path = export_record(store, k, file, model=model)
            nbytes = file.stat().st_size
            click.echo(
                f"wrote {file} ({chain[-1].end} tokens of {path}, from {len(chain)} learned "
                f"records, {human_size(nbytes)})"
            )
            return
        if record_hits:
            raise click.ClickException(
                f"key {key!r} matches an entry and a learned record; give more hex digits"
            )
        (k,) = resolve_keys(store, (key,))
        if model is not None:
            raise click.UsageError("--model is for a learned record; an entry knows its model")
        meta = export_entry(store, k, file)
    click.echo(f"wrote {file} ({meta.ntokens} tokens of {meta.model}, {human_size(meta.nbytes)})")
    if meta.extra.fleet_check == "pending":  # kvstore.fleet.check
        click.echo(
            f"warning: its KV was computed by {meta.extra.uploader or 'another box'} and "
            "is not yet checked against this box's model (the first kvstore.client.load or "
            "kvstore serve of the model checks it)",
            err=True,
        )


def _matches(keys: list[bytes], text: str) -> list[bytes]:
    """The keys `text` names as resolve_keys reads it (a prefix of the key or of its hash half)."""
    t = text.lower()
    return [k for k in keys if k.hex().startswith(t) or digest_hex(k).startswith(t)]


@click.command(name="import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", required=True, help="Model path the cache was made with.")
@click.option(
    "--tokens",
    "tokens_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSON list of the cached token ids (default: those `kvstore export` wrote in FILE).",
)
@click.option("--prompt", default=None, help="The prompt given to mlx_lm.cache_prompt.")
@click.option("--adapter", default=None, help="LoRA adapter the cache was made with.")
@click.option(
    "--model-config",
    "model_config",
    default=None,
    metavar="JSON",
    help="config.json overrides the model ran with, as mlx_lm.load(model_config=...).",
)
@click.option("--label", default="imported", callback=pin_label)
@click.option("--pin", is_flag=True, help="Store it pinned (never evicted automatically).")
@click.option(
    "--trust",
    is_flag=True,
    help="Store it without re-prefilling to check it (marked trusted/unchecked in ls and verify).",
)
@home_option
@user_errors
def import_cmd(
    file, model, tokens_file, prompt, adapter, model_config, label, pin, trust, home: Path
) -> None:
    """Store a prompt-cache file written by `mlx_lm.cache_prompt` or `kvstore export`.

    The tokens are --tokens or --prompt, or (a file `kvstore export` wrote) the token ids in its
    metadata. Before storing, the model is loaded and re-prefills the tokens: the file's KV must be
    what this model computes for them (within the upgrade canary's tolerance), else nothing is
    stored. KV the store already holds is not imported again: the entry keeps its label, owners
    and pin state.

    \b
    kvstore import cache.safetensors --model ./Qwen3-0.6B --prompt "You are..." --pin
    """
    from kvstore.ops.put import DaemonWriter, LocalWriter
    from kvstore.warm.transfer import AlreadyStored, import_file

    if tokens_file is not None and prompt is not None:
        raise click.UsageError("give at most one of --tokens TOKENS.json or --prompt TEXT")
    overrides = parse_json_object(model_config, "--model-config")
    from kvstore.wire.daemon_client import DaemonClient, connect_writer

    client = connect_writer(home)
    # With a daemon running, the entry goes through it (it verifies and commits); else directly.
    # Whether the KV is stored already is read from the store itself (read-only beside a daemon).
    with client or open_store(home, write=True) as store:
        local = None if isinstance(store, DaemonClient) else store
        reader = open_store(home) if local is None else local
        try:
            meta = import_file(
                DaemonWriter(store) if local is None else LocalWriter(local, home),
                file,
                model=model,
                tokens_file=tokens_file,
                prompt=prompt,
                adapter=adapter,
                model_config=overrides,
                label=label,
                pin=pin,
                trust=trust,
                home=home,
                reader=reader,
            )
        except AlreadyStored as e:
            click.echo(str(e))
            return
        finally:
            if local is None:
                reader.close()
    how = "trusted: not checked" if meta.trusted else f"checked: {meta.extra.check} match"
    click.echo(
        f"imported {meta.key.hex()} ({meta.ntokens} tokens, {human_size(meta.nbytes)}; {how})"
    )


@click.command()
@click.argument("model_path")
@click.option("--adapter", default=None)
@click.option("--kv-bits", type=int, default=None)
@click.option("--kv-group-size", type=int, default=64)
@click.option(
    "--model-config",
    "model_config",
    default=None,
    metavar="JSON",
    help="config.json overrides, as mlx_lm.load(model_config=...).",
)
@click.option("--json", "as_json", is_flag=True)
@home_option
@user_errors
def fingerprint(
    model_path, adapter, kv_bits, kv_group_size, model_config, as_json, home: Path
) -> None:
    """Print a model's fingerprint (the key prefix of its entries) and template hash.

    \b
    kvstore fingerprint ./Qwen3-0.6B --model-config '{"rope_theta": 1000000}'
    """
    from dataclasses import replace

    from kvstore.errors import ManifestError
    from kvstore.home.settings import FILEHASH_NAME
    from kvstore.identity.fingerprint import FileHashCache, model_fingerprint, template_hash
    from kvstore.identity.model import ModelIdentity

    identity = ModelIdentity(str(model_path), adapter, kv_bits=kv_bits, kv_group_size=kv_group_size)
    try:  # refused as a manifest refuses it
        identity.check()
    except ManifestError as e:
        field, _, what = str(e).partition(": ")
        raise click.BadParameter(what, param_hint=f"--{field.replace('_', '-')}") from None

    t = time.perf_counter()
    cache = FileHashCache(home / FILEHASH_NAME if home.is_dir() else None)
    overrides = parse_json_object(model_config, "--model-config")
    fp = model_fingerprint(replace(identity, model_config=overrides), hash_cache=cache)
    th = template_hash(model_path)
    dt = time.perf_counter() - t
    if as_json:
        click.echo(
            json.dumps(
                {
                    "fingerprint": fp.hex,
                    "template_hash": th.hex(),
                    "layout": [list(x) for x in fp.layout],
                    "seconds": dt,
                }
            )
        )
    else:  # one `name value` pair a line: `awk '$1 == "fingerprint" {print $2}'` reads it
        click.echo(f"fingerprint    {fp.hex}\ntemplate_hash  {th.hex()}")
