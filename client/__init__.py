"""The thin kvstore client: hydrate stored prefix caches into mlx-lm's LRUPromptCache (or `load` a
model with its cache hydrated alongside), pin stage prefixes at runtime, and record every call's
prefill cost.

`from client import hydrate` stays light: the modules that pull in mlx_lm.server and friends
(serve, parity, analyze) load on first use of one of their names.
"""

from __future__ import annotations

import importlib
from typing import Any

from client.hydrate import HydrateReport, hydrate

# Imported eagerly: the function then shadows its submodule's name on the package for good.
from client.load import load  # noqa: E402  (light: mlx_lm is imported on the first call)

# name -> module, imported on first access (module __getattr__, PEP 562)
_LAZY = {
    "PersistentPromptCache": "client.persistent",
    "Pin": "client.persistent",
    "CallStats": "client.stats",
    "LabelSummary": "client.stats",
    "StatsRecorder": "client.stats",
    "generate": "client.stats",
    "stream_generate": "client.stats",
    "StageReport": "client.analyze",
    "load_capture": "client.analyze",
    "ParityReport": "client.parity",
    "load_prompts": "client.parity",
    "run_parity": "client.parity",
    "patched_server": "client.serve",
}
# client.serve.serve and client.analyze.analyze are not re-exported: a package attribute cannot be
# both the submodule and the function of the same name.

__all__ = ["HydrateReport", "hydrate", "load", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
