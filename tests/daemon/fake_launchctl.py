"""A `launchctl` for tests on Linux that behaves like the real one where the installer cares.

State lives in $FAKE_LAUNCHD_DIR/state.json; every call is appended to calls.log. Behaviour, per
launchctl(1), support/launchctl.c (apple-oss-distributions/launchd) and brew services' handling:
- `bootout` returns at once, before the job has exited: the job stays loaded (and `print` still
  shows it, `bootstrap` of its label still fails) for $FAKE_LAUNCHD_EXIT_DELAY seconds.
- `bootstrap` of a label still loaded fails: "Bootstrap failed: 5: Input/output error", exit 5;
  so does a plist that is group- or world-writable ("Dubious permissions" in launchctl.c).
- `print` of a label not loaded fails: 'Could not find service ...', exit 113; of a loaded one
  prints `state = ...`, `pid = N`, `last exit code = N` as launchctl does.
- `bootout` of a label not loaded: "Boot-out failed: 3: No such process", exit 3.
"""

from __future__ import annotations

import json
import os
import plistlib
import sys
import time
from pathlib import Path

DIR = Path(os.environ["FAKE_LAUNCHD_DIR"])
STATE = DIR / "state.json"
EXIT_DELAY = float(os.environ.get("FAKE_LAUNCHD_EXIT_DELAY", "1.0"))


def load() -> dict:
    state = json.loads(STATE.read_text()) if STATE.exists() else {"jobs": {}, "next_pid": 4100}
    now = time.time()
    gone = [k for k, job in state["jobs"].items() if job.get("gone_at") and now >= job["gone_at"]]
    for label in gone:  # the booted-out job has now exited and launchd forgets it
        del state["jobs"][label]
    if gone:
        save(state)
    return state


def save(state: dict) -> None:
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, STATE)


def fail(msg: str, rc: int) -> int:
    print(msg, file=sys.stderr)
    return rc


def main(argv: list[str]) -> int:
    with (DIR / "calls.log").open("a") as f:
        f.write(" ".join(argv) + "\n")
    state = load()
    cmd, args = (argv[0], argv[1:]) if argv else ("help", [])
    uid = os.getuid()
    if cmd == "print":
        target = args[0]
        if target == f"gui/{uid}":
            print(f"{target} = {{\n\ttype = login\n}}")
            return 0
        label = target.rsplit("/", 1)[-1]
        job = state["jobs"].get(label)
        if job is None:
            print("Bad request.", file=sys.stderr)
            return fail(f'Could not find service "{label}" in domain for user gui: {uid}', 113)
        running = job.get("pid") is not None
        print(f"{target} = {{")
        print("\tactive count = 1" if running else "\tactive count = 0")
        print(f"\tpath = {job['path']}")
        print(f"\tstate = {'running' if running else 'not running'}")
        print(f"\tprogram = {job['program'][0]}")
        if running:
            print(f"\tpid = {job['pid']}")
        print(f"\truns = {job['runs']}")
        le = job.get("last_exit")
        print(f"\tlast exit code = {le}" if le is not None else "\tlast exit code = (never exited)")
        print("}")
        return 0
    if cmd == "bootout":
        label = args[0].rsplit("/", 1)[-1]
        job = state["jobs"].get(label)
        if job is None:
            return fail("Boot-out failed: 3: No such process", 3)
        job.setdefault("gone_at", time.time() + EXIT_DELAY)  # SIGTERM sent; not exited yet
        save(state)
        return 0
    if cmd == "enable":
        state.setdefault("enabled", []).append(args[0])
        save(state)
        return 0
    if cmd == "bootstrap":
        path = Path(args[1])
        st = path.stat()
        if st.st_mode & 0o022 or st.st_uid not in (0, uid):
            print(f"launchctl: Dubious permissions on file (skipping): {path}", file=sys.stderr)
            return fail("Bootstrap failed: 5: Input/output error", 5)
        job_def = plistlib.loads(path.read_bytes())
        label = job_def["Label"]
        if label in state["jobs"]:
            return fail("Bootstrap failed: 5: Input/output error", 5)
        if state.get("flaky_bootstraps", 0) > 0:  # launchd still tearing the old job down
            state["flaky_bootstraps"] -= 1
            save(state)
            return fail("Bootstrap failed: 37: Operation already in progress", 37)
        state["next_pid"] += 1
        state["jobs"][label] = {
            "path": str(path),
            "program": job_def["ProgramArguments"],
            "env": job_def.get("EnvironmentVariables", {}),
            "pid": state["next_pid"],
            "runs": 1,
            "last_exit": None,
        }
        save(state)
        return 0
    return fail(f"Unrecognized subcommand: {cmd}", 64)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
