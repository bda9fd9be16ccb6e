"""The thin kvstore client: hydrate stored prefix caches into mlx-lm's LRUPromptCache (or `load` a
model with its cache hydrated alongside), pin stage prefixes at runtime, record every call's
prefill cost, and `attach` a model a framework loaded (smolagents, Outlines, ...) to its cache.

`from kvstore.client import hydrate` stays light: the modules that pull in mlx_lm.server and friends
(serve, parity, analyze) load on first use of one of their names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.client.hydrate import HydrateReport, hydrate

# Imported eagerly: the function then shadows its submodule's name on the package for good.
from kvstore.client.load import load  # noqa: E402  (light: mlx_lm is imported on the first call)
from kvstore.lazy import lazy_exports

# name -> module, imported on first access (module __getattr__, PEP 562)
_LAZY = {
    "Attachment": "kvstore.client.attachment",
    "attach": "kvstore.client.attachment",
    "PersistentPromptCache": "kvstore.client.persistent",
    "Pin": "kvstore.client.persistent",
    "CallStats": "kvstore.client.callstats",
    "LabelSummary": "kvstore.client.callstats",
    "StatsRecorder": "kvstore.client.callstats",
    "generate": "kvstore.client.callstats",
    "stream_generate": "kvstore.client.callstats",
    "StageReport": "kvstore.analyze",
    "load_capture": "kvstore.analyze",
    "ParityReport": "kvstore.client.parity",
    "load_prompts": "kvstore.client.parity",
    "run_parity": "kvstore.client.parity",
    "patched_server": "kvstore.client.serve.hooks",
}
if TYPE_CHECKING:  # what a user's type checker sees of the lazy names: their real types
    from kvstore.analyze import (
        StageReport,
        load_capture,
    )
    from kvstore.client.attachment import (
        Attachment,
        attach,
    )
    from kvstore.client.callstats import (
        CallStats,
        LabelSummary,
        StatsRecorder,
        generate,
        stream_generate,
    )
    from kvstore.client.parity import (
        ParityReport,
        load_prompts,
        run_parity,
    )
    from kvstore.client.persistent import (
        PersistentPromptCache,
        Pin,
    )
    from kvstore.client.serve.hooks import (
        patched_server,
    )

# kvstore.client.cli.serve and kvstore.analyze.analyze are not re-exported: a
# package attribute cannot be both the submodule and the function of the same name.

__all__ = [  # static, so type checkers see every name (the lazy ones as TYPE_CHECKING imports)
    "Attachment",
    "CallStats",
    "HydrateReport",
    "LabelSummary",
    "ParityReport",
    "PersistentPromptCache",
    "Pin",
    "StageReport",
    "StatsRecorder",
    "attach",
    "generate",
    "hydrate",
    "load",
    "load_capture",
    "load_prompts",
    "patched_server",
    "run_parity",
    "stream_generate",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals(), __all__)
