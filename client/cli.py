"""The client's click commands: `kvstore serve` and `kvstore parity`
(kvstore.cli.main loads them through the kvstore.commands entry points without importing
them). No other module of the client imports click.

`kvstore serve`: mlx-lm's own OpenAI-compatible server, with the persistent prompt cache.

The server runs in-process, unchanged, under the hooks of kvstore.client.serve.hooks (hydrate at
model load, and with --persist-system-prompts the stable system segment and its persister). This
module is the command and its argv hand-off to mlx_lm.server's main(); it imports the hooks (and
mlx-lm with them) only when the server runs.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import click

from kvstore.client.parity import ATOL, MAX_TOKENS, REFERENCES, _table, load_prompts, run_parity
from kvstore.errors import KVStoreError
from kvstore.home.settings import given_home
from kvstore.identity.modelconfig import overrides_from_json

log = logging.getLogger("kvstore.serve")

LEARN_DRAIN_S = 10.0  # seconds a stopping server waits for queued learn jobs (learn_drain_s)

__all__ = ["serve", "serve_cmd"]


def _home(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path:
    """The home resolved, refused in one line when it cannot be one (kvstore's own `--home`)."""
    try:
        return given_home(value)
    except KVStoreError as e:
        raise click.ClickException(str(e)) from None


# the client's commands take --home as every kvstore command does (kvstore.cli.options)
home_option = click.option(
    "--home",
    type=click.Path(),  # checked by _home: a file is one line, not a usage error
    metavar="DIRECTORY",
    envvar="KVSTORE_HOME",
    callback=_home,
    help="kvstore home (default: $KVSTORE_HOME or the per-user data directory).",
)


def serve(
    model: str,
    *,
    home: Path,
    port: int | None = None,
    persist: bool = False,
    model_config: dict | None = None,
    learn: bool = True,
    server_args: Sequence[str] = (),
) -> None:
    """Run mlx_lm.server's main() with `--model model` and `server_args`, hydrated from `home`.

    SIGTERM stops it as Ctrl-C does (mlx-lm shuts its server down on KeyboardInterrupt); then
    the learn reports and records still queued are sent to the daemon (at most learn_drain_s)."""
    # here, not at the top: `kvstore --help` loads this module, the hooks load mlx-lm
    from kvstore.client.serve.hooks import patched_server

    argv = ["mlx_lm.server", "--model", model]
    if port is not None:
        argv += ["--port", str(port)]
    argv += list(server_args)
    hooks: list = []
    with patched_server(
        home, persist=persist, model_config=model_config, learn=learn, hooks_out=hooks
    ) as server:
        saved_argv = sys.argv
        sys.argv = argv  # main() parses sys.argv: every mlx_lm.server option passes through
        saved_term = _stop_on_sigterm()
        _freeze_imports()
        fixed_mmap_threshold()
        try:
            server.main()
        except KeyboardInterrupt:
            pass  # a SIGTERM before mlx-lm's own handler was in place
        finally:
            sys.argv = saved_argv
            if saved_term is not None:
                signal.signal(signal.SIGTERM, saved_term)
            for h in hooks:
                _drain(h)
    fatal = next((h.fatal for h in hooks if h.fatal), None)
    if fatal:
        raise ServeStopped(f"kvstore serve: {fatal}")


def _freeze_imports() -> None:
    """Move every object alive now (what mlx-lm, transformers and kvstore imported) to the
    collector's permanent generation, so that no later collection walks them again.

    mlx-lm's model load starts with a full `gc.collect()` (ModelProvider._load, to free the
    last model), which would walk them all before the first request could be answered; and each
    later full collection, which Python triggers during requests, would walk them again. Frozen
    objects are still freed by reference counting; only a reference cycle already garbage at
    this point stays, and what is made later (the model, the caches, each request's objects) is
    collected as before. `gc.freeze` (Python 3.7+) exists to keep long-lived start-up state out
    of collections; done here, in the process `kvstore serve` owns, never by the library in an
    app's process."""
    gc.freeze()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's default, kept: larger buffers are mappings of their own


def fixed_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at its default, so that every buffer above 128 KiB (mlx's
    arrays of KV, the learned records' blobs) is a mapping of its own, returned to the system
    when freed. By default glibc raises the threshold to the size of each such buffer freed
    (up to 32 MiB): later buffers of that size then come from the heap, and KV buffers of every
    size, many freed after their request on the write-behind's thread, would fragment it: a
    long-running serve's memory would grow while what Python and mlx hold stays flat. Whether it
    was set: only glibc has it (Linux; not macOS, where mlx's buffers are Metal's). In the
    process `kvstore serve` owns, never the library's."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc's (musl has a mallopt that does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


class ServeStopped(KVStoreError):
    """The server stopped itself: its model cannot be loaded."""


def _stop_on_sigterm():
    """SIGTERM raises KeyboardInterrupt in the main thread; the previous handler, or None when
    this is not the main thread (signals cannot be set there)."""

    def stop(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:
        return None


def _drain(hooks) -> None:
    """Send what the learner and the persister still hold; log what made it."""
    timeout = LEARN_DRAIN_S  # not a setting (the store's settings have no learn_drain_s)
    learner = hooks.learner
    if learner is not None:
        pending = learner.writer.pending
        t0 = time.monotonic()
        sent, abandoned = learner.drain(timeout)
        log.info(
            "kvstore: learn queue drained in %.2f s: %d pending at stop, %d abandoned "
            "(%d reports, %d records, %d snapshots sent in all)",
            time.monotonic() - t0, pending, abandoned,
            learner.reported, learner.records_sent, learner.snapshots_sent,
        )  # fmt: skip
        learner.cold.close()
    hooks.close(timeout)  # hits and prefill stats records still held, then the write-behind


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
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="HTTP port (mlx_lm.server's default: 8080).",
)
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
@click.option(
    "--no-learn",
    is_flag=True,
    help="Do not report prompts to the daemon or restore learned prefixes from the store "
    "(learning recurring prefixes is on by default).",
)
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def serve_cmd(
    home: Path | None,
    model: str,
    port: int | None,
    persist_system_prompts: bool,
    model_config: str | None,
    no_learn: bool,
    server_args: tuple[str, ...],
) -> None:
    """Run mlx_lm.server with the persistent prompt cache.

    Stored entries of the model are hydrated into the server's prompt cache when it loads the
    model, so the first request after a start reports them in
    usage.prompt_tokens_details.cached_tokens. Prompt prefixes that recur are learned: the
    daemon stores their KV, and later starts (or a memory miss) are served them from the store.
    GET /metrics answers Prometheus metrics. Other options go to mlx_lm.server as they are.

    \b
    kvstore serve --model ./Qwen3.5-9B-8bit --port 8080 --prompt-cache-size 20
    """
    from kvstore.home.settings import resolve_home

    try:
        overrides = overrides_from_json(model_config)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--model-config") from None
    try:
        serve(
            model,
            home=resolve_home(home),
            port=port,
            persist=persist_system_prompts,
            model_config=overrides,
            learn=not no_learn,
            server_args=server_args,
        )
    except ServeStopped as e:
        # one line for the supervisor's log, a non-zero exit for its restart policy; os._exit as
        # below (mlx-lm's generation thread may still be alive)
        click.echo(f"Error: {e}", err=True)
        _exit(1)
    except KVStoreError as e:
        raise click.ClickException(str(e)) from None
    # Stopped and drained. mlx's teardown with mlx-lm's generation thread still alive can abort
    # ("terminate called without an active exception", seen with the qwen3_5 layout, with or
    # without learning): nothing is left to do, so leave without it.
    _exit(0)


def _exit(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@click.command(name="parity", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--manifest",
    "-m",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Manifest TOML (default: manifest.toml in the home).",
)
@click.option(
    "--prompts",
    "-p",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help='JSONL: one {"messages": [...], "tools"?, "stage"?} per line.',
)
@click.option(
    "--max-tokens",
    default=MAX_TOKENS,
    show_default=True,
    type=click.IntRange(1),
    help="Greedy tokens generated per prompt.",
)
@click.option(
    "--atol",
    default=ATOL,
    show_default=True,
    type=click.FloatRange(0),
    help="Largest allowed absolute logit difference.",
)
@click.option(
    "--reference",
    type=click.Choice(REFERENCES),
    default="split",
    show_default=True,
    help="split: cold prefill of the same prefix, then the rest (bit-exact when the "
    "entry is honest); whole: the prompt in one pass, as an app without kvstore "
    "(chunking noise may need a looser --atol).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@home_option
def parity_cmd(
    manifest: Path | None,
    prompts: Path,
    max_tokens: int,
    atol: float,
    reference: str,
    as_json: bool,
    home: Path | None,
) -> None:
    """Check that stored entries change no output: greedy with the store vs without.

    Exits non-zero when any prompt's greedy tokens diverge or its logits differ by more than
    --atol, naming the prompt and the divergence.

    \b
    kvstore parity --manifest pins.toml --prompts prompts.jsonl --max-tokens 32
    """
    from kvstore.home.settings import MANIFEST_NAME, resolve_home
    from kvstore.pins.manifest import load_manifest

    home = resolve_home(home)
    try:
        m = load_manifest(manifest or home / MANIFEST_NAME)
        report = run_parity(
            m,
            load_prompts(prompts),
            home=home,
            max_tokens=max_tokens,
            atol=atol,
            reference=reference,
        )
    except KVStoreError as e:
        raise click.ClickException(str(e)) from None
    for w in report.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else _table(report))
    if report.failed:
        raise click.ClickException(
            f"parity failed for {len(report.failed)} of {len(report.results)} prompts: "
            + "; ".join(f"{r.name} (line {r.line}): {r.problem}" for r in report.failed)
        )
