"""Interleaved repetitions and robust summaries: on a shared, noisy 2-core box the ratio of two
medians measured side by side is the result; an absolute time is only context.

`interleave` times alternatives in this process. Start latency is timed in new interpreters, by
one harness for every benchmark: `worker(fn, *args)` names a function of a bench module as a
command line (`python -m bench.timing MODULE:FUNCTION ARGS`, which prints what it returns as
JSON), `fresh_rounds` runs such command lines interleaved, `in_fresh_process` runs one."""

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


def worker(fn: Callable[[list[str]], dict], *args: object) -> list[str]:
    """The command line (after the interpreter) that runs `fn([str(a) for a in args])` in a new
    interpreter through this module's `__main__`, which prints what it returns as JSON."""
    module = fn.__module__
    if module == "__main__":  # a benchmark run as `python -m bench.X`: its importable name
        module = sys.modules["__main__"].__spec__.name
    return ["-m", "bench.timing", f"{module}:{fn.__qualname__}", *map(str, args)]


def fresh_process(
    argv: list[str], *, python: str = sys.executable, env: dict | None = None, cwd: Path = ROOT
) -> dict:
    """Run `python ARGV` in a new interpreter: its last stdout line when that is a JSON object,
    with `process_s`, the whole process's wall time (interpreter start included). `env` replaces
    the default environment (this checkout on PYTHONPATH) for a command of another interpreter."""
    compile_checkout()
    if env is None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error")
    t = time.perf_counter()
    out = subprocess.run([python, *argv], capture_output=True, text=True, env=env, cwd=cwd)
    process_s = time.perf_counter() - t
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])} failed:\n{out.stderr[-2000:]}")
    lines = out.stdout.strip().splitlines() or [""]
    try:
        res = json.loads(lines[-1])
    except ValueError:  # a command that prints no result, only its time counts
        res = {}
    res = res if isinstance(res, dict) else {}
    res["process_s"] = process_s
    return res


def in_fresh_process(fn: Callable[[list[str]], dict], *args: object) -> dict:
    """`fn(args)` in a new interpreter (see `worker`): what it returns, with `process_s`."""
    return fresh_process(worker(fn, *args))


def fresh_rounds(
    cases: dict[str, list[str]], *, reps: int, warmup: int = 1, **kw
) -> dict[str, list[dict]]:
    """Each case's command line (`worker(...)` or any `python` arguments) in a new interpreter,
    `reps` times round-robin with first place rotating, after `warmup` untimed rounds (they fill
    the page cache); each sample is `fresh_process`'s result. `kw` goes to `fresh_process`."""
    names = list(cases)
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(warmup + reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            res = fresh_process(cases[name], **kw)
            if r >= warmup:
                samples[name].append(res)
    return samples


def _main(argv: list[str]) -> None:
    """`python -m bench.timing MODULE:FUNCTION ARGS...`: a worker's one run (see `worker`)."""
    import importlib

    module, _, name = argv[0].partition(":")
    fn = getattr(importlib.import_module(module), name)
    print(json.dumps(fn(argv[1:])))


if __name__ == "__main__":
    _main(sys.argv[1:])
