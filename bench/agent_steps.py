"""A smolagents agent's steps, plain against attached (issue 41), side by side in one run.

A `ToolCallingAgent` over smolagents' `MLXModel` on the tiny llama (kvstore.tiny, generated
here), one tool, 5 steps then smolagents' final-answer call, greedy, each run in a new
interpreter against a real `kvstore daemon`: plain (mlx-lm prefills every step's whole prompt),
attached (`kvstore.client.attach` on the engine's model, a fresh store), then after a restart
(new processes on the store the attached run left) the same task again and a new task (plain
too, to compare its outputs). Per call: prompt tokens, tokens prefilled; per run its wall time;
each attached run's model outputs must be the plain run's of its task (the tiny model answers
newlines: a weak check here; tests/integrations checks token identity with a repetition penalty).

    python -m bench.agent_steps
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.learned import running_daemon
from bench.timing import in_fresh_process

STEPS = 5
MAX_TOKENS = 24
TASKS = (
    "What is the weather in Paris, and should I take an umbrella?",
    "Is it sunny in Lisbon today? Tell me whether to book the boat trip.",
)
ACK_TIMEOUT = 30.0  # seconds for the daemon to commit what the attached run made learnable


def agent_run(argv: list[str]) -> dict:
    """One agent run in this interpreter (a `bench.timing` worker): per model call its prompt
    tokens, tokens prefilled, wall time, and the agent's outputs."""
    import warnings

    warnings.simplefilter("ignore")  # smolagents' and transformers' notices
    from smolagents import MLXModel, ToolCallingAgent, tool
    from smolagents.memory import ActionStep

    from kvstore.client import attach

    model_path, home, mode, task, steps = argv

    @tool
    def weather(city: str) -> str:
        """The weather forecast for a city.

        Args:
            city: the city's name
        """
        return f"Rain in {city} this afternoon."

    engine = MLXModel(model_path, max_tokens=MAX_TOKENS)
    att = None
    if mode == "attached":
        att = attach(engine.model, engine.tokenizer, model_path, home=home, verbose=False)
    agent = ToolCallingAgent(tools=[weather], model=engine, max_steps=int(steps), verbosity_level=0)
    t = time.perf_counter()
    agent.run(TASKS[int(task)])
    run_s = time.perf_counter() - t
    steps = [s for s in agent.memory.steps if isinstance(s, ActionStep)]
    out = {
        "run_s": run_s,
        "prompt": [s.token_usage.input_tokens for s in steps if s.token_usage],
        "step_s": [s.timing.duration for s in steps],
        "outputs": [str(s.model_output) for s in steps],
    }
    if att is not None:
        out["cached"] = [c.cached_tokens for c in att.calls]
        out["prefilled"] = [c.prefilled_tokens for c in att.calls]
        out["calls_prompt"] = [c.prompt_tokens for c in att.calls]
        att.detach()
    else:
        out["prefilled"] = list(out["prompt"])  # no cache: every step's whole prompt
    return out


def _wait_learned(home: Path) -> float:
    """Seconds until the daemon's learned records stop changing (what the run made learnable is
    committed); NaN when nothing was learned in ACK_TIMEOUT."""
    from kvstore.wire.daemon_client import DaemonClient
    from kvstore.wire.messages import StatsRequest

    t, last, since = time.monotonic(), None, time.monotonic()
    while time.monotonic() - t < ACK_TIMEOUT:
        with DaemonClient(home) as c:
            learned = c.send(StatsRequest()).to_wire().get("learned") or {}
        key = (learned.get("records"), learned.get("bytes"))
        if key != last:
            last, since = key, time.monotonic()
        elif learned.get("records") and time.monotonic() - since >= 1.0:
            return time.monotonic() - t - 1.0
        time.sleep(0.2)
    return float("nan")


def run(steps: int = STEPS) -> dict:
    from kvstore.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvstore-agent-") as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "llama", "llama")
        home = root / "home"
        env = dict(os.environ, KVSTORE_HOME=str(home), HF_HUB_OFFLINE="1")
        with running_daemon(home, root / "daemon.log", env):
            plain = in_fresh_process(agent_run, model, home, "plain", 0, steps)
            attached = in_fresh_process(agent_run, model, home, "attached", 0, steps)
            learned_s = _wait_learned(home)
            again = in_fresh_process(agent_run, model, home, "attached", 0, steps)
            new = in_fresh_process(agent_run, model, home, "attached", 1, steps)
            plain_new = in_fresh_process(agent_run, model, home, "plain", 1, steps)
    runs = {
        "plain": plain,
        "attached": attached,
        "after a restart, the same task": again,
        "after a restart, a new task": new,
        "plain, the new task": plain_new,
    }
    same = plain["outputs"] == attached["outputs"] == again["outputs"]
    same = same and new["outputs"] == plain_new["outputs"]
    load = os.getloadavg()[0]  # the box is shared: wall times move with it
    return {"runs": runs, "same_outputs": same, "learned_s": learned_s, "load_1min": load}


def _table(res: dict) -> str:
    runs = res["runs"]
    plain = runs["plain"]
    steps = len(plain["prompt"]) - 1  # the last call is smolagents' final answer
    lines = [f"| run | prefilled tokens per call ({steps} steps, final answer) | agent run s |"]
    lines.append("|---|---|---|")
    for name, r in runs.items():
        base = runs["plain, the new task"] if "new task" in name else plain
        ratio = sum(base["prefilled"]) / max(1, sum(r["prefilled"]))
        pre = "/".join(str(n) for n in r["prefilled"])
        time_ratio = base["run_s"] / r["run_s"]
        lines.append(
            f"| {name} | {pre} ({ratio:.1f}x fewer) | {r['run_s']:.1f} ({time_ratio:.1f}x) |"
        )
    for name in ("plain", "plain, the new task"):
        lines.append(f"{name}: prompt tokens per call {'/'.join(map(str, runs[name]['prompt']))}")
    lines.append(f"attached runs' outputs the plain runs': {res['same_outputs']}")
    lines.append(f"load average at the end: {res['load_1min']:.1f}")
    return "\n".join(lines)


def main() -> None:
    res = run()
    print(_table(res))
    json.dump(res, sys.stdout)
    print()


if __name__ == "__main__":
    main()
