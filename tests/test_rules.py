"""Rules of the code that hold themselves (House): no function over 80 lines, no module that imports
its own package while that package imports it back, one way into the store and one way out,
settings read as attributes of the one `Settings` value, mlx-lm's private methods overridden only
in kvstore/mlxlm.py, few reaches into another object's `_private`, and the import contracts (run by
`make imports`). A rule in prose alone slipped within two sessions;
these fail `make test` instead."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("kvstore", "client", "daemon")
MAX_FUNCTION_LINES = 80  # a function longer than this is split by responsibility
# A Store's put only in the put operation, its delete only in the one eviction.
STORE_DOORS = {"put": {"kvstore/ops/put.py"}, "delete": {"kvstore/ops/evict.py"}}
# A learned record's meta row is deleted in one BlockStore method, and what reaches it is called
# by the one eviction (by key: verify --repair) or by what hands it the records removed (a
# budget's, a pin's); BlockStore.evict_learned (tests, bench: it calls evict_learned_records)
# by none.
LEARNED_DOOR = ("kvstore/learned/blockstore.py", "_delete")
LEARNED_REMOVERS = {
    "evict_keys": {"kvstore/ops/evict.py"},
    "evict_learned_records": {"kvstore/ops/budget.py", "kvstore/learned/blockstore.py"},
    "drop_covered": {"kvstore/ops/put.py"},
    "evict_learned": set(),
}
# The one KV check (prefill, compare, decide): its comparison is called only in its room, and the
# upgrade canary, `kvstore import`'s check and the fleet check each call its driver.
KV_CHECK_ROOM = "kvstore/kvcheck/"
KV_COMPARISONS = {"layer_differences", "kv_difference"}
KV_CHECK_DRIVER = "check_kv"
KV_CHECKERS = {"kvstore/warm/canary.py", "kvstore/warm/importfit.py", "kvstore/fleet/check.py"}
ADAPTER = "kvstore/mlxlm.py"  # the one module that reaches into mlx-lm's internals
MAX_PRIVATE_REACHES = 10  # `x._name` with x neither self, cls nor super(), outside ADAPTER


def _package_of(path: Path) -> str:
    """The installed module name of a source file (client/ is kvstore.client, daemon/ is
    kvstore.daemon: pyproject's package-dir)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("client", "daemon"):
        parts = ["kvstore", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _files() -> list[Path]:
    return sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py"))


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = (node.end_lineno or node.lineno) - node.lineno + 1  # def to end: no decorators
            if n > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_is_longer_than_80_lines():
    long = [f for path in _files() for f in _long_functions(path)]
    assert not long, "split these by responsibility:\n" + "\n".join(long)


def _store_doors(path: Path) -> list[str]:
    """`store.put` and `store.delete` (a Store's writes, by the name every caller gives it; and
    `blocks.delete`, a BlockStore's) outside the one module of each."""
    rel, found = path.relative_to(ROOT).as_posix(), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and rel not in STORE_DOORS.get(node.attr, {rel}):
            base = node.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
            if name in ("store", "blocks"):
                found.append(f"{rel}:{node.lineno} {name}.{node.attr}")
    return found


def _learned_deletes(path: Path) -> list[str]:
    """A learned record's removal (`txn.delete(k, db=self._db(b"bmeta"))`, a delete naming the
    `bmeta` table) outside LEARNED_DOOR's method."""
    rel, tree = path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))
    door = [
        range(f.lineno, (f.end_lineno or f.lineno) + 1)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and (rel, f.name) == LEARNED_DOOR
    ]
    return [
        f"{rel}:{node.lineno} delete of bmeta"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", "") == "delete"
        and any(isinstance(c, ast.Constant) and c.value == b"bmeta" for c in ast.walk(node))
        and not any(node.lineno in r for r in door)
    ]


def test_entries_enter_and_leave_the_store_by_one_door_each():
    doors = [d for path in _files() for d in _store_doors(path)]
    assert not doors, "go through kvstore.ops.put or kvstore.ops.evict:\n" + "\n".join(doors)


def test_learned_records_leave_by_the_one_eviction():
    """Every learned record's removal is BlockStore._delete, reached only through the removers
    kvstore.ops calls and hands to kvstore.ops.evict (its tombstone, metric and log line)."""
    doors = [d for path in _files() for d in _learned_deletes(path)]
    doors += [
        c
        for path in _files()
        for c in _calls(path, set(LEARNED_REMOVERS))
        if c.split(":")[0] not in LEARNED_REMOVERS[c.rsplit(" ", 1)[1]]
    ]
    assert not doors, "remove learned records through kvstore.ops.evict:\n" + "\n".join(doors)


def _calls(path: Path, names: set[str]) -> list[str]:
    """Calls of a function named in `names` (`f(...)`, `m.f(...)`), as "path:line name"."""
    rel, found = path.relative_to(ROOT).as_posix(), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
            if name in names:
                found.append(f"{rel}:{node.lineno} {name}")
    return found


def test_the_kv_checks_share_one_driver():
    """The canary, the import's check and the fleet check judge KV through kvstore.kvcheck's one
    driver: none compares KV itself, and each calls the driver."""
    own = [
        c for p in _files() for c in _calls(p, KV_COMPARISONS) if not c.startswith(KV_CHECK_ROOM)
    ]
    assert not own, "compare KV through kvstore.kvcheck.check.check_kv:\n" + "\n".join(own)
    callers = {c.split(":")[0] for p in _files() for c in _calls(p, {KV_CHECK_DRIVER})}
    assert KV_CHECKERS <= callers, sorted(KV_CHECKERS - callers)


def _settings_by_key(path: Path) -> list[str]:
    """`settings["x"]`, `settings.get("x")` (any name ending in settings), `DEFAULTS["x"]` and
    `load_settings(...)["x"]`: a setting read by string key, not as an attribute of `Settings`."""
    rel, found = path.relative_to(ROOT).as_posix(), []

    def is_settings(node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            node = node.func
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
        return name.endswith("settings") or name == "DEFAULTS"

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Subscript) and is_settings(node.value):
            found.append(f"{rel}:{node.lineno} [...]")
        elif isinstance(node, ast.Attribute) and node.attr == "get" and is_settings(node.value):
            found.append(f"{rel}:{node.lineno} .get")
    return found


def test_settings_are_read_as_attributes():
    by_key = [f for path in _files() for f in _settings_by_key(path)]
    assert not by_key, "read these as attributes of Settings (load_settings):\n" + "\n".join(by_key)


def _mlx_lm_overrides(path: Path) -> list[str]:
    """A private attribute of mlx-lm set outside ADAPTER: `x._name = ...` or `setattr(x, "_name",
    ...)` on an mlx-lm object, or a method `_name` that a subclass of an mlx-lm class defines where
    the class has one. mlx-lm objects are names imported from `mlx_lm` and `server` (what serve's
    hooks call the mlx_lm.server module they are given)."""
    import importlib

    rel, found = path.relative_to(ROOT).as_posix(), []
    tree = ast.parse(path.read_text(), str(path))
    names = {"server": "mlx_lm.server"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({(a.asname or a.name).split(".")[0]: (a.asname and a.name) or "mlx_lm"
                          for a in node.names if a.name.split(".")[0] == "mlx_lm"})  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlx_lm":
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})

    def mlx_lm(node: ast.AST) -> object | None:
        if isinstance(node, ast.Attribute) and (owner := mlx_lm(node.value)) is not None:
            return getattr(owner, node.attr, None)
        if isinstance(node, ast.Name) and node.id in names:
            module, _, attr = names[node.id].rpartition(".")
            try:
                return importlib.import_module(names[node.id])
            except ImportError:
                return getattr(importlib.import_module(module), attr, None)
        return None

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for node in ast.walk(tree):
        targets: list[tuple[ast.AST, str]] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute):
                    targets.append((t.value, t.attr))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                targets.append((node.args[0], str(node.args[1].value)))
        elif isinstance(node, ast.ClassDef):
            methods = [f.name for f in node.body if isinstance(f, ast.FunctionDef)]
            targets.extend((b, m) for b in node.bases for m in methods if hasattr(mlx_lm(b), m))
        for owner, attr in targets:
            if private(attr) and mlx_lm(owner) is not None and rel != ADAPTER:
                found.append(f"{rel}:{node.lineno} {attr}")
    return found


def test_mlx_lm_private_methods_are_overridden_only_in_its_adapter():
    overrides = [f for path in _files() for f in _mlx_lm_overrides(path)]
    assert not overrides, "go through kvstore.mlxlm (overriding):\n" + "\n".join(overrides)


def _private_reaches(path: Path) -> list[str]:
    """`x._name` (not a dunder) where x is neither `self`, `cls` nor `super()`, outside ADAPTER."""
    rel, found = path.relative_to(ROOT).as_posix(), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute) or rel == ADAPTER:
            continue
        own = getattr(node.value, "id", "") in ("self", "cls") or (
            isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super"
        )
        if node.attr.startswith("_") and not node.attr.startswith("__") and not own:
            found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return found


def test_few_reaches_into_another_objects_private_attributes():
    """A need for another object's `_private` names a missing public method (os._exit and a
    NamedTuple's _replace count too)."""
    reaches = [r for path in _files() for r in _private_reaches(path)]
    assert len(reaches) <= MAX_PRIVATE_REACHES, "\n".join(reaches)


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """Every kvstore module `path` imports, at any depth of its code (function-level imports
    count); `from package import submodule` imports the submodule, not the package's names."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            for a in node.names:
                out.add(f"{name}.{a.name}" if f"{name}.{a.name}" in modules else name)
    return out & modules


def test_no_module_imports_a_package_that_imports_it():
    """import-linter's sibling contract does not see a module importing its own package (the
    package's __init__) while that __init__ imports the module: a circle all the same."""
    modules = {_package_of(p): p for p in _files()}
    graph = {m: _imports(p, m, set(modules)) for m, p in modules.items()}
    circles = []
    for module, imported in graph.items():
        for package in imported:
            if (
                package != module
                and module.startswith(package + ".")
                and _reaches(graph, package, module)
            ):
                circles.append(f"{module} imports {package}, which imports it")
    assert not circles, "\n".join(circles)


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return False


@pytest.mark.parametrize(
    "bad", ["long", "circle", "door", "settings", "override", "private", "kvcheck"]
)
def test_the_rules_catch_what_they_exist_for(tmp_path, bad, monkeypatch):
    """The checks above fail on the thing they forbid (a rule that cannot fail checks nothing)."""
    if bad == "long":
        body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
        f = tmp_path / "m.py"
        f.write_text(f"def f():\n{body}\n")
        monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
        assert _long_functions(f)
    elif bad == "door":
        f = tmp_path / "m.py"
        f.write_text("def f(self, store):\n    store.put(b'k', b'v')\n    self.store.delete([])\n")
        monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
        assert _store_doors(f) == ["m.py:2 store.put", "m.py:3 store.delete"]
        f.write_text("def _delete(txn, k, d):\n    txn.delete(k, db=d(b'bmeta'))\n"
                     "blocks.delete([])\nb.drop_covered(f, t)\n")  # fmt: skip
        assert _learned_deletes(f) == ["m.py:2 delete of bmeta"]
        assert _store_doors(f) == ["m.py:3 blocks.delete"]
        assert _calls(f, set(LEARNED_REMOVERS)) == ["m.py:4 drop_covered"]
    elif bad == "settings":
        f = tmp_path / "m.py"
        f.write_text("a = settings['x']\nb = self.settings.get('y')\nc = load_settings(h)['z']\n")
        monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
        assert sorted(_settings_by_key(f)) == ["m.py:1 [...]", "m.py:2 .get", "m.py:3 [...]"]
    elif bad == "override":
        f = tmp_path / "m.py"
        f.write_text("from mlx_lm import server\nimport mlx_lm.server as s\n"
                     "class P(server.ModelProvider):\n    def _load(self): pass\n"
                     "    def _mine(self): pass\ns.ResponseGenerator._tokenize = None\n"
                     "setattr(server.APIHandler, '_x', 1)\n")  # fmt: skip
        monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
        assert _mlx_lm_overrides(f) == ["m.py:3 _load", "m.py:6 _tokenize", "m.py:7 _x"]
    elif bad == "kvcheck":
        f = tmp_path / "m.py"
        f.write_text("d, t = kv_difference(a, b)\nv = kvdiff.layer_differences(a, b)\n")
        monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
        assert _calls(f, KV_COMPARISONS) == ["m.py:1 kv_difference", "m.py:2 layer_differences"]
    elif bad == "private":
        f = tmp_path / "m.py"
        f.write_text("a = other._x\nb = self._y + cls._z + super()._w + o.__dict__\n")
        monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
        assert _private_reaches(f) == ["m.py:1 other._x"]
    else:
        graph = {
            "kvstore.client": {"kvstore.client.load"},
            "kvstore.client.load": {"kvstore.client"},
        }
        assert _reaches(graph, "kvstore.client", "kvstore.client.load")


def _contract(name_starts: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["name"].startswith(name_starts))


def test_the_import_contracts_name_every_module():
    """The contracts list modules by name: one added later and not listed would be outside them."""
    core = {
        _package_of(p).split(".")[1]
        for p in (ROOT / "kvstore").iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()
    }
    listed = {m.split(".")[1] for m in _contract("The core imports")["source_modules"]}
    assert core - {"cli"} <= listed, sorted(core - {"cli"} - listed)
    click = set(_contract("Click commands")["source_modules"])
    for top in ("client", "daemon"):
        for p in (ROOT / top).iterdir():
            if p.name in ("__init__.py", "cli.py", "cli", "__pycache__") or not (
                p.suffix == ".py" or (p / "__init__.py").is_file()
            ):
                continue
            assert _package_of(p if p.suffix == ".py" else p / "__init__.py") in click, p.name
