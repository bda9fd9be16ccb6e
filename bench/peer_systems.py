"""The systems bench/peer.py compares, and how each is started, prepared, stopped or crashed.

- `kvstore serve` with its daemon (a kvstore home);
- plain `mlx_lm.server` (nothing outlives its restart: the floor of a start, the greedy reference);
- vllm-mlx 0.6.0 (KVSTORE_PEER_VENV): `--continuous-batching --ssd-cache-dir`, with and without
  `--warm-prompts`; its clean stop also saves a prefix cache under ~/.cache/vllm-mlx;
- Rapid-MLX 0.16.10 (KVSTORE_RAPID_VENV), the active fork of vllm-mlx, read from its source:
  its prefix cache is saved at a clean stop only (`rapid_mlx/runtime/cache.py`,
  `save_prefix_cache_to_disk`, `_DEFAULT_SHUTDOWN_BUDGET_SEC = 3.5`) to
  `~/.cache/rapid-mlx/prefix_cache/<model>--<hash>` and loaded in the background after the
  server says ready (`load_prefix_cache_from_disk`); the hash covers the model name and, for a
  local folder, every file's size, mtime, ctime and inode (`_cached_model_revision`,
  `_file_identity`), and the bytes of files up to 8 MiB. A hybrid's entry (recurrent state)
  cannot be cut back, so it serves a new request only when it ends exactly where the request
  continues; `--hybrid-cache-entries N` (default 0) retains up to N such entries
  (`cli_parser.py`'s help), though at 0 it still served message-boundary snapshots of stages 2-3
  here. Two settings: its defaults, and its best persistent one: each stage's
  system prompt sent alone first (an entry that ends where every later request of the stage
  continues: its "agent warm-up") with `--hybrid-cache-entries 64` (a hand-run prepare with 16
  saved 16 of 16 entries: 16 was a limit there; 64 is above what the prepare makes). Both run
  with telemetry off (`--no-telemetry`, RAPID_MLX_TELEMETRY=0) and
  `--disable-version-check` (no network here).

Every peer runs with a HOME of its own inside its state folder, so what it saves under ~/.cache
is part of the state a restart is given a copy of.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from bench.learned import USERS, Server, _kv, _stage_messages, _wait_learned, free_port
from bench.learned import running_daemon as running_daemon

ARCHS = {"plain": "llama", "hybrid": "qwen3_5"}  # model class -> kvstore.tiny architecture
STAGE_NAMES = ("synthesize", "reason", "examine")  # three system prompts of ~800-1100 tokens
KVSTORE, PLAIN = "kvstore serve", "mlx_lm.server"
VLLM = {"vllm-mlx ssd": [], "vllm-mlx ssd + warm prompts": ["--warm-prompts"]}
RAPID_ENTRIES = 64  # --hybrid-cache-entries of the persistent setting: above the entries made
RAPID = {
    "Rapid-MLX defaults": [],
    "Rapid-MLX persistent": ["--hybrid-cache-entries", str(RAPID_ENTRIES)],
}
PEERS = {**VLLM, **RAPID}
FAMILY = {**dict.fromkeys(VLLM, "vllm-mlx 0.6.0"), **dict.fromkeys(RAPID, "Rapid-MLX 0.16.10")}
INSTALL = {
    "vllm-mlx 0.6.0": "python3 -m venv V && V/bin/pip install vllm-mlx==0.6.0 'mlx[cpu]'",
    "Rapid-MLX 0.16.10": "python3 -m venv V && V/bin/pip install rapid-mlx==0.16.10 'mlx[cpu]'",
}
VENV_VAR = {"vllm-mlx 0.6.0": "KVSTORE_PEER_VENV", "Rapid-MLX 0.16.10": "KVSTORE_RAPID_VENV"}
EXE = {"vllm-mlx 0.6.0": ("vllm-mlx", "vllm_mlx"), "Rapid-MLX 0.16.10": ("rapid-mlx", "rapid_mlx")}
CHECK_TIMEOUT = 300.0  # seconds for a peer's venv to import it (torch: slow the first time)
QUIET = {"RAPID_MLX_TELEMETRY": "0", "RAPID_MLX_DISABLE_VERSION_CHECK": "1"}


def venv_exe(family: str) -> tuple[Path | None, str]:
    """(the peer's executable, '') when its venv variable names a venv where it imports, else
    (None, why not, in one line)."""
    var, (exe_name, module), install = VENV_VAR[family], EXE[family], INSTALL[family]
    venv = os.environ.get(var)
    if not venv:
        return None, f"{var} is not set (a venv: `{install}`, or `make bench-peer`)"
    exe = Path(venv) / "bin" / exe_name
    if not exe.exists():
        return None, f"{exe} does not exist (set it up: `{install}`, or `make bench-peer`)"
    try:
        out = subprocess.run(
            [str(Path(venv) / "bin" / "python"), "-c", f"import {module}, mlx.core"],
            capture_output=True, text=True, timeout=CHECK_TIMEOUT,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{venv}'s python cannot import {module}: {e}"
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{venv}'s python cannot import {module}: {last[:300]}"
    return exe, ""


def peer_exe() -> tuple[Path | None, str]:
    """vllm-mlx's executable, or why it cannot run."""
    return venv_exe("vllm-mlx 0.6.0")


def available() -> tuple[dict[str, Path], dict[str, str]]:
    """({family: executable} of the peers that can run, {family: why not} of the others), each
    missing one said in one line."""
    exes, missing = {}, {}
    for family in INSTALL:
        exe, why = venv_exe(family)
        if exe is None:
            missing[family] = f"{family} cannot run, it is left out: {why}"
            print(f"  {missing[family]}", flush=True)
        else:
            exes[family] = exe
    return exes, missing


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower())


class Systems:
    """How to start each system on one model, from a state folder (a kvstore home, a peer's
    folder; None for plain mlx_lm.server)."""

    def __init__(self, root: Path, arch: str, exes: dict[str, Path], model: Path | None = None):
        from kvstore.tiny import make_tiny_model

        self.root, self.arch, self.exes = root, arch, exes
        if model is None:
            model = make_tiny_model(root / f"model-{arch}", ARCHS[arch])
        self.model = Path(model).resolve()
        self.warm = root / "warm-prompts.json"
        self.warm.write_text(json.dumps([[{"role": "system", "content": _system(s)}]
                                         for s in STAGE_NAMES]))  # fmt: skip
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")

    def names(self) -> list[str]:
        """kvstore serve, plain mlx_lm.server, then every setting of each peer that can run."""
        return [KVSTORE, PLAIN, *(n for n in PEERS if FAMILY[n] in self.exes)]

    def log(self, name: str) -> Path:
        return self.root / f"{self.arch}-{slug(name)}.log"

    def daemon(self, name: str, state: Path | None):
        """kvstore's daemon on `state` (started before the server, untimed), else nothing."""
        if name != KVSTORE or state is None:
            return nullcontext()
        return running_daemon(state, self.root / f"{self.arch}-daemon.log", self._env(state))

    def _env(self, home: Path) -> dict:
        return dict(self.env, KVSTORE_HOME=str(home))

    def argv(self, name: str, state: Path | None, port: int, model: Path) -> list[str]:
        """The command line that starts `name` on `model` at `port`."""
        if name == KVSTORE:
            assert state is not None
            return _kv("serve", "--home", str(state), "--model", str(model), "--port", str(port))
        if name == PLAIN:
            return [sys.executable, "-m", "mlx_lm.server", "--model", str(model),
                    "--port", str(port)]  # fmt: skip
        assert state is not None
        if name in VLLM:
            extra = [*VLLM[name], str(self.warm)] if VLLM[name] else []
            return [str(self.exes[FAMILY[name]]), "serve", str(model), "--port", str(port),
                    "--continuous-batching", "--ssd-cache-dir", str(state / "ssd"),
                    *extra]  # fmt: skip
        return [str(self.exes[FAMILY[name]]), "--no-telemetry", "--disable-version-check",
                "serve", str(model), "--port", str(port), *RAPID[name]]  # fmt: skip

    def start(self, name: str, state: Path | None, model: Path | None = None
              ) -> tuple[Server, str | None]:  # fmt: skip
        """The server spawned in a session of its own (its clock starts at the spawn; `crash`
        kills its whole process group), and the model name to send."""
        model = model or self.model
        argv = self.argv(name, state, free_port(), model)
        port = int(argv[argv.index("--port") + 1])
        if name == KVSTORE:
            assert state is not None
            env = self._env(state)
        elif name == PLAIN:
            env = self.env
        else:
            # a peer saves its prefix cache under ~/.cache: a HOME of its own keeps it in the state
            assert state is not None
            (state / "home").mkdir(parents=True, exist_ok=True)
            env = dict(self.env, HOME=str(state / "home"), **QUIET)
        s = Server(argv, port, self.log(name), env, new_session=True)
        return s, (str(model) if name in PEERS else None)


def _system(stage: str) -> str:
    from bench.stages import STAGES

    return STAGES[stage]["system"]


def history(arch: str) -> list[str]:
    """The user turns each system is asked before its restarts: two make each stage's prefix
    recur; on the hybrid a third crosses it (a state layout stores the prefix when a later request
    crosses the boundary the daemon named)."""
    return list(USERS[:2] if arch == "plain" else USERS[:3])


def warm_up(name: str) -> bool:
    """Whether `name`'s preparation first sends each stage's system prompt alone (Rapid-MLX's
    persistent setting: the entry a hybrid can serve must end where the requests continue)."""
    return name == "Rapid-MLX persistent"


def serve_history(sy: Systems, name: str, s: Server, m: str | None, state: Path | None) -> None:
    """Every stage asked with the history's user turns (after the system-only warm-up where the
    setting has one); for kvstore, until its daemon acknowledged what it learned."""
    if warm_up(name):
        for stage in STAGE_NAMES:
            s.chat([{"role": "system", "content": _system(stage)}], model=m)
    for k, user in enumerate(history(sy.arch)):
        if k == 2:
            time.sleep(1.0)  # the daemon's replies name the boundaries first
        for stage in STAGE_NAMES:
            s.chat(_stage_messages(stage, user), model=m)
    if name == KVSTORE:
        assert state is not None
        _wait_learned(state, sy.arch == "plain")


def prepare(sy: Systems, name: str, state: Path, model: Path | None = None) -> None:
    """Ask `name` every stage with the history's user turns, then stop it cleanly: `state` holds
    what it keeps across a restart."""
    with sy.daemon(name, state):
        s, m = sy.start(name, state, model)
        try:
            s.wait_ready("/v1/models")
            serve_history(sy, name, s, m, state)
        finally:
            rc = s.stop(signal.SIGTERM)  # the peers save their prefix caches at a clean stop only
        if rc not in (0, -signal.SIGTERM):
            raise RuntimeError(f"{name} exited {rc} at its stop:\n{s.tail()}")


def crash(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGKILL to `proc`'s whole process group (a crash, an OOM kill, a forced reboot: nothing
    runs after it), reaped; its return code."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait(timeout=timeout)


def crash_after_history(sy: Systems, name: str, state: Path) -> None:
    """Ask `name` every stage as `prepare` does, then kill it with SIGKILL instead of stopping
    it: for kvstore serve its daemon too (a forced reboot takes both), once the daemon
    acknowledged what it learned (the others get the same requests and nothing to wait for)."""
    with sy.daemon(name, state) as daemon:
        s, m = sy.start(name, state)
        try:
            s.wait_ready("/v1/models")
            serve_history(sy, name, s, m, state)
            rc = crash(s.proc)
            if daemon is not None:
                daemon.send_signal(signal.SIGKILL)
                daemon.wait(timeout=30)
        finally:
            s.stop(signal.SIGTERM)  # already dead: closes its log
    if rc != -signal.SIGKILL:
        raise RuntimeError(f"{name} exited {rc} before its SIGKILL:\n{s.tail()}")
