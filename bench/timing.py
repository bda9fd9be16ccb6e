"""Interleaved repetitions and robust summaries: on a shared, noisy 2-core box the ratio of two
medians measured side by side is the result; an absolute time is only context."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Stats:
    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Stats:
        s = sorted(samples)
        if len(s) >= 4:
            q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive")
        else:
            q1, q3 = s[0], s[-1]
        return cls(statistics.median(s), q1, q3, s[0], s[-1], len(s))

    def to_json(self) -> dict:
        return asdict(self)

    def ms(self) -> str:
        return f"{self.median * 1e3:.2f} ms [{self.q1 * 1e3:.2f}-{self.q3 * 1e3:.2f}]"


def interleave(
    alternatives: dict[str, Callable[[], object]],
    *,
    reps: int,
    warmup: int = 1,
    before: Callable[[str], None] | None = None,
) -> dict[str, Stats]:
    """Time each alternative `reps` times in round-robin order, after `warmup` untimed rounds.

    Round-robin (rotating which goes first) spreads background noise over all alternatives
    instead of letting it land on whichever ran during a burst. `before(name)` runs untimed.
    """
    names = list(alternatives)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if before:
                before(name)
            t = time.perf_counter()
            alternatives[name]()
            dt = time.perf_counter() - t
            if r >= warmup:
                samples[name].append(dt)
    return {n: Stats.of(s) for n, s in samples.items()}


def once(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


_COMPILED: list[bool] = []


def compile_checkout() -> None:
    """Bytecode for this checkout's packages, once per benchmark process. `pip install` writes it
    for every package it installs (mlx-lm's and transformers' included), and an interpreter
    writes it on first import; with PYTHONDONTWRITEBYTECODE set nothing would, and every new
    process (a worker, a restarted `kvstore serve`) would compile kvstore's modules from source
    (11 ms of a 21 ms first hydrate at 1 MB) while the loader it is compared with reads bytecode."""
    if not _COMPILED:
        import compileall

        for package in ("kvstore", "client", "daemon", "bench"):
            compileall.compile_dir(str(ROOT / package), quiet=2)
        _COMPILED.append(True)


def in_fresh_process(module: str, args: list[str]) -> dict:
    """Run `python -m module --worker ARGS` in a new interpreter; its last stdout line (JSON),
    with `process_s`: the whole process's wall time, interpreter start included."""
    compile_checkout()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error")
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", module, "--worker", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if out.returncode:
        raise RuntimeError(f"{module} worker {args[0]} failed:\n{out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t
    return res
