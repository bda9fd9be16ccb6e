"""JSONL inputs (captured prompts for `kvstore analyze`, prompts for `kvstore parity`): one
JSON object per line; errors name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def read_objects(path: Path, error: type[Exception], what: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; `error` names the file:line at fault."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read {what}: {e}") from None
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise error(f"{path}:{n}: not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise error(f"{path}:{n}: each line must be a JSON object")
        yield n, obj
