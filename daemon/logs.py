"""Where the daemon logs: stderr (journald keeps and rotates it), or under launchd a file of its
own, rotated here, since launchd opens StandardOutPath/StandardErrorPath O_APPEND and never
rotates them (apple-oss-distributions/launchd src/core.c, job_setup_fd)."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path

LOG_BYTES = 10 * 2**20  # 10 MiB per log file before it rolls over
LOG_BACKUPS = 3  # daemon.log.1 .. .3 kept: at most 40 MiB in all
CRASH_LOG_BYTES = 1 * 2**20  # 1 MiB: launchd's stderr file is moved aside at start above this
CRASH_LOG_NAME = "daemon.stderr.log"  # launchd's StandardOutPath/StandardErrorPath, next to it
FORMAT = "%(asctime)s kvstore-daemon[%(process)d] %(levelname)s %(message)s"


def setup_logging(level: str = "info", log_file: Path | None = None) -> None:
    """One line per event: to `log_file` (rotating) when given, else to stderr."""
    if log_file is None:
        handler: logging.Handler = logging.StreamHandler()
    else:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(
            log_file, maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS, encoding="utf-8"
        )
        cap_crash_log(log_file.with_name(CRASH_LOG_NAME))
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def cap_crash_log(path: Path, *, cap: int = CRASH_LOG_BYTES) -> bool:
    """When launchd's stdout/stderr file `path` is over `cap`, move it to NAME.1 (the last crash
    stays readable there) and point our stdout and stderr at a fresh one. True if it did."""
    try:
        if not path.is_file() or path.stat().st_size <= cap:
            return False
        os.replace(path, path.with_name(path.name + ".1"))
        fresh = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return False
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for fd in (1, 2):  # only if it is that file: by hand, stderr is a terminal and stays one
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path.with_name(path.name + ".1"))):
                os.dup2(fresh, fd)
        except OSError:
            pass
    os.close(fresh)
    return True
