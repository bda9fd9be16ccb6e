"""The `kvstore` command line (click).

User errors exit non-zero with one line naming what was wrong.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import click

from kvstore import __version__
from kvstore.errors import KVStoreError
from kvstore.eviction import select_for_eviction
from kvstore.remote import RemoteWriter, connect, warm_report
from kvstore.settings import ensure_home, resolve_home

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 500M, 8G, 1048576)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


home_option = click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="KVSTORE_HOME",
    callback=lambda _ctx, _param, value: resolve_home(value),
    help="kvstore home (default: $KVSTORE_HOME or the per-user data directory).",
)


def user_errors(f):
    """Turn the project's own errors into one-line click errors (exit 1)."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except KVStoreError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def _tty() -> bool:
    return sys.stderr.isatty()


def _progress(msg: str) -> None:
    if _tty():
        click.echo(msg, err=True)


def open_store(home: Path, *, write: bool = False):
    from kvstore.store import Store

    if write:
        ensure_home(home)
    return Store(home, readonly=not write)


def resolve_keys(store, texts: tuple[str, ...]) -> list[bytes]:
    """Full keys, unique prefixes of them, or unique prefixes of the prefix-hash half (what `ls`
    shows: the first half of every key of one model is the same fingerprint)."""
    all_keys = [k.hex() for k in store.keys()]
    out = []
    for t in texts:
        t = t.lower()
        if not re.fullmatch(r"[0-9a-f]+", t):
            raise click.ClickException(f"key {t!r} is not hex")
        hits = [k for k in all_keys if k.startswith(t) or k[32:].startswith(t)]
        if len(hits) != 1:
            what = "no entry" if not hits else f"{len(hits)} entries"
            raise click.ClickException(f"key {t!r} matches {what}; give more hex digits")
        out.append(bytes.fromhex(hits[0]))
    return out


class _PluginGroup(click.Group):
    """Adds the commands the daemon and client packages register under the entry-point group
    `kvstore.commands`, loaded only when named, so this core package never imports them."""

    @staticmethod
    def _plugins() -> dict:
        return {ep.name: ep for ep in entry_points(group="kvstore.commands")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._plugins()))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is None and (ep := self._plugins().get(name)) is not None:
            try:
                cmd = ep.load()
            except Exception as e:  # a broken plugin must not take the core CLI down
                raise click.ClickException(f"command {name!r} unavailable: {e}") from None
        return cmd


@click.group(cls=_PluginGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvstore")
def main() -> None:
    """kvstore: persistent prefix KV caches for mlx-lm.

    \b
    kvstore warm --manifest pins.toml     # prefill and store every pin
    kvstore ls                            # what is stored
    kvstore verify                        # checksums and full decode
    """


@main.command()
@click.option(
    "--manifest",
    "-m",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Manifest TOML (default: manifest.toml in the home).",
)
@home_option
@user_errors
def warm(manifest: Path | None, home: Path) -> None:
    """Prefill and store every pin of a manifest that is missing.

    \b
    kvstore warm --manifest pins.toml
    """
    from kvstore.manifest import load_manifest
    from kvstore.settings import MANIFEST_NAME
    from kvstore.warm import warm as do_warm

    manifest = manifest or home / MANIFEST_NAME
    m = load_manifest(manifest)
    client = connect(home)
    if client is not None:  # the daemon is the writer: it warms (and watches this manifest)
        _progress(f"warming through the daemon for {home}; its log shows the progress")
        with client:
            report = warm_report(client.warm(m.path))
    else:
        with open_store(home, write=True) as store:
            report = do_warm(m, store, home=home, progress=_progress)
    for p in report.purged:
        click.echo(f"purged   {p.label:20} {p.key[:12]}  {p.model}: {p.cause}")
    for p in report.pins:
        line = f"{p.status:8} {p.name:20} {p.tokens:6d} tokens  {p.model}"
        if p.status == "warmed":
            line += f"  ({human_size(p.nbytes)}, {p.seconds:.2f}s)"
        click.echo(line)
        if p.warning:
            click.echo(f"warning: {p.warning}", err=True)
    click.echo(
        f"{report.warmed} warmed, {len(report.pins) - report.warmed - len(report.failed)} "
        f"present, {len(report.failed)} failed in {report.seconds:.2f}s"
    )
    if report.failed:
        raise click.ClickException("; ".join(f"{p.name}: {p.error}" for p in report.failed))


def _age(ts: float) -> str:
    s = max(0.0, time.time() - ts)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def _previews(metas) -> dict[bytes, str]:
    """First tokens of each entry, decoded with its model's tokenizer when that loads."""
    from kvstore.identity import resolve_model_path

    tokenizers: dict[str, object] = {}
    out = {}
    for m in metas:
        if m.model not in tokenizers:
            try:
                from mlx_lm.utils import load_tokenizer

                tokenizers[m.model] = load_tokenizer(resolve_model_path(m.model))
            except Exception:
                tokenizers[m.model] = None
        tok = tokenizers[m.model]
        ids = m.token_ids()[:24]
        text = tok.decode(ids) if tok is not None else " ".join(map(str, ids))
        out[m.key] = text.replace("\n", "\\n")[:48]
    return out


@main.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry, as a list.")
@click.option("--model", default=None, help="Only entries of this model path.")
@click.option("--label", default=None, help="Only entries with this label.")
@home_option
@user_errors
def ls_cmd(as_json: bool, model: str | None, label: str | None, home: Path) -> None:
    """List stored entries.

    \b
    kvstore ls
    kvstore ls --json | jq '.[] | select(.pinned)'
    """
    if not (home / "store" / "data.mdb").is_file():
        metas, errors = [], []
    else:
        with open_store(home) as store:
            errors: list = []
            metas = store.metas(errors=errors)
    metas = [
        m
        for m in metas
        if (model is None or m.model == model) and (label is None or m.label == label)
    ]
    if as_json:
        click.echo(json.dumps([m.to_json() for m in metas], indent=1))
    else:
        previews = _previews(metas)
        click.echo(
            f"{'KEY':14} {'LABEL':16} {'TOKENS':>6} {'SIZE':>10} PIN {'HITS':>4} "
            f"{'LAST USED':>10}  MODEL / FIRST TOKENS"
        )
        for m in sorted(metas, key=lambda m: (m.model, m.label)):
            click.echo(
                f"{m.key.hex()[32:44]:14} {m.label[:16]:16} {m.ntokens:6d} "
                f"{human_size(m.nbytes):>10} {'yes' if m.pinned else 'no ':3} {m.hits:4d} "
                f'{_age(m.last_used):>10}  {Path(m.model).name}: "{previews[m.key]}"'
            )
        click.echo(f"{len(metas)} entries, {human_size(sum(m.nbytes for m in metas))}")
    for e in errors:
        click.echo(f"warning: {e}", err=True)


@main.command()
@click.argument("keys", nargs=-1)
@click.option("--label", default=None, help="Entries with this label.")
@click.option("--model", default=None, help="Entries of this model path (as stored).")
@click.option("--unpinned", is_flag=True, help="Only unpinned entries.")
@click.option("--stale", is_flag=True, help="Entries whose model changed or is gone.")
@click.option("--all", "everything", is_flag=True, help="Every entry.")
@click.option("--to-size", default=None, help="Evict LRU unpinned entries until the store fits.")
@home_option
@user_errors
def evict(keys, label, model, unpinned, stale, everything, to_size, home: Path) -> None:
    """Remove entries. Filters combine (AND); at least one is required.

    \b
    kvstore evict 3fa2c1          # one key (a unique hex prefix)
    kvstore evict --label classify
    kvstore evict --unpinned --to-size 2G
    """
    if not (keys or label or model or unpinned or stale or everything or to_size):
        raise click.UsageError(
            "name what to evict: KEY..., --label, --model, --unpinned, --stale, --to-size or --all"
        )
    size = parse_size(to_size) if to_size else None
    client = connect(home)
    if client is not None:  # the daemon is the writer: it selects and deletes in one job
        with client, open_store(home) as store:
            resolved = resolve_keys(store, keys) if keys else []
            res = client.request(
                "evict",
                keys=list(resolved),
                label=label,
                model=model,
                unpinned=unpinned,
                stale=stale,
                all=everything,
                to_size=size,
            )
        n = res["evicted"]
        click.echo(f"evicted {n} entr{'y' if n == 1 else 'ies'}, {human_size(res['bytes'])}")
        return
    with open_store(home, write=True) as store:
        resolved = resolve_keys(store, keys) if keys else ()
        metas = store.metas(errors=[])
        victims = select_for_eviction(
            metas,
            keys=resolved,
            label=label,
            model=model,
            unpinned=unpinned,
            stale=stale,
            everything=everything,
            to_size=size,
            home=home,
        )
        n = store.delete(m.key for m in victims)
    click.echo(
        f"evicted {n} entr{'y' if n == 1 else 'ies'}, {human_size(sum(m.nbytes for m in victims))}"
    )


@main.command()
@click.option("--json", "as_json", is_flag=True)
@home_option
@user_errors
def stats(as_json: bool, home: Path) -> None:
    """Store size, entries, pins, settings; with a daemon running, its state and the prefill
    ledger (per model and label: calls, tokens from cache, tokens prefilled, seconds).

    \b
    kvstore stats
    kvstore stats --json | jq .ledger
    """
    from kvstore.settings import load_settings

    client = connect(home, timeout=10)
    if client is not None:
        with client:
            data = client.request("stats")
    elif not (home / "store" / "data.mdb").is_file():
        data = {"path": str(home / "store"), "entries": 0, "bytes": 0}
    else:
        with open_store(home) as store:
            data = store.stats()
    if "ledger" not in data:
        from kvstore.ledger import Ledger

        data["ledger"] = Ledger(home).stats()
    data.setdefault("settings", load_settings(home))
    if as_json:
        click.echo(json.dumps(data, indent=1))
        return
    for k, v in data.items():
        if not isinstance(v, dict):
            click.echo(f"{k:14} {human_size(v) if 'bytes' in k or k == 'map_size' else v}")
    daemon = data.get("daemon")
    if daemon:
        click.echo(
            f"daemon         pid {daemon['pid']}, up {daemon['uptime']:.0f}s, "
            f"{human_size(daemon['rss'])} resident, watcher {daemon['watcher']}"
        )
    else:
        click.echo("daemon         not running")
    rows = (data.get("ledger") or {}).get("by_model_label") or []
    if rows:
        click.echo(
            f"\n{'MODEL':20} {'LABEL':14} {'CALLS':>6} {'PROMPT':>8} {'CACHED':>8} "
            f"{'PREFILLED':>9} {'PREFILL S':>9} {'SAVED S~':>8}"
        )
        for r in rows:
            click.echo(
                f"{Path(r['model']).name[:20]:20} {r['label'][:14]:14} {r['calls']:6d} "
                f"{r['prompt_tokens']:8d} {r['cached_tokens']:8d} "
                f"{r['prefilled_tokens']:9d} {r['prefill_s']:9.2f} "
                f"{r['saved_s']:8.2f}"
            )
    click.echo("settings:")
    for k, v in data["settings"].items():
        click.echo(f"  {k:22} {v}")


@main.command()
@click.option("--repair", is_flag=True, help="Delete the entries that fail.")
@home_option
@user_errors
def verify(repair: bool, home: Path) -> None:
    """Check every entry: meta, checksum, and a full decode. Exits 1 naming each bad entry.

    Checking reads the store directly. With --repair the deletions are writes: with a daemon
    running it does the repair (it is the one writer), else this process does.
    """
    if not (home / "store" / "data.mdb").is_file():
        click.echo("no store: nothing to verify")
        return
    client = connect(home) if repair else None  # a busy daemon is an error: never write beside it
    if client is not None:
        _progress(f"repairing through the daemon for {home}; it checks every entry")
        with client:
            res = client.call("repair", timeout=None)
        n = res["entries"]
        problems = [(bytes(p["key"]).hex(), p["reason"]) for p in res["problems"]]
    else:
        with open_store(home, write=repair) as store:
            n = len(store.keys())
            bar = (
                (lambda i, total: click.echo(f"\rverified {i}/{total}", err=True, nl=i == total))
                if _tty()
                else None
            )
            problems = [(p.key.hex(), p.reason) for p in store.check(repair=repair, progress=bar)]
    for key, reason in problems:
        click.echo(f"bad entry {key}: {reason}")
    if problems:
        raise click.ClickException(
            f"{len(problems)} of {n} entries failed" + (" and were deleted" if repair else "")
        )
    click.echo(f"{n} entries ok")


@main.command(name="export")
@click.argument("key")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@home_option
@user_errors
def export_cmd(key: str, file: Path, home: Path) -> None:
    """Write an entry as a file that `mlx_lm.generate --prompt-cache-file FILE` loads."""
    from kvstore.transfer import export_entry

    with open_store(home) as store:
        (k,) = resolve_keys(store, (key,))
        meta = export_entry(store, k, file)
    click.echo(f"wrote {file} ({meta.ntokens} tokens of {meta.model}, {human_size(meta.nbytes)})")


@main.command(name="import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", required=True, help="Model path the cache was made with.")
@click.option(
    "--tokens",
    "tokens_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSON list of the cached token ids.",
)
@click.option("--prompt", default=None, help="The prompt given to mlx_lm.cache_prompt.")
@click.option("--adapter", default=None, help="LoRA adapter the cache was made with.")
@click.option("--label", default="imported")
@click.option("--pin", is_flag=True, help="Store it pinned (never evicted automatically).")
@home_option
@user_errors
def import_cmd(file, model, tokens_file, prompt, adapter, label, pin, home: Path) -> None:
    """Store a prompt-cache file written by `mlx_lm.cache_prompt` or `kvstore export`.

    \b
    kvstore import cache.safetensors --model ./Qwen3-0.6B --prompt "You are..." --pin
    """
    from kvstore.transfer import import_file

    if (tokens_file is None) == (prompt is None):
        raise click.UsageError("give exactly one of --tokens TOKENS.json or --prompt TEXT")
    client = connect(home)
    # With a daemon running, the entry goes through it (it verifies and commits); else directly.
    with client or open_store(home, write=True) as store:
        meta = import_file(
            RemoteWriter(client) if client is not None else store,
            file,
            model=model,
            tokens_file=tokens_file,
            prompt=prompt,
            adapter=adapter,
            label=label,
            pin=pin,
            home=home,
        )
    click.echo(f"imported {meta.key.hex()} ({meta.ntokens} tokens, {human_size(meta.nbytes)})")


@main.command()
@click.argument("model_path")
@click.option("--adapter", default=None)
@click.option("--kv-bits", type=int, default=None)
@click.option("--kv-group-size", type=int, default=64)
@click.option("--json", "as_json", is_flag=True)
@home_option
@user_errors
def fingerprint(model_path, adapter, kv_bits, kv_group_size, as_json, home: Path) -> None:
    """Print a model's fingerprint (the key prefix of its entries) and template hash."""
    from kvstore.identity import FileHashCache, model_fingerprint, template_hash
    from kvstore.settings import FILEHASH_NAME

    t = time.perf_counter()
    cache = FileHashCache(home / FILEHASH_NAME if home.is_dir() else None)
    fp = model_fingerprint(
        model_path,
        adapter_path=adapter,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        hash_cache=cache,
    )
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
    else:
        click.echo(fp.hex)


if __name__ == "__main__":
    main()
