"""Names a package exports without importing their modules until first use (PEP 562): `import
kvstore` and the command line stay free of mlx, mlx-lm and transformers until something needs
them. Used by the packages kvstore, kvstore.client and kvstore.daemon."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, table: dict[str, str], namespace: dict[str, Any], names: list[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's `__getattr__` and `__dir__`: a name of `table` (name -> module) is imported
    from its module on first access and kept in `namespace`, the package's globals(), so later
    lookups skip the hook; `names` is its `__all__`."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
