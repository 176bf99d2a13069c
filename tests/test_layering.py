"""How the package is put together: the stages import in pipeline order, modules form no circle,
and settings are read from the one file that holds their defaults.

The stages, earliest first: the shared core (``ir``, ``ops``, ``errors``, ``config`` and the few
helpers every stage reads), ``trace/``, ``decompose/``, ``placement/``, ``lower/``, ``runtime/``,
the Dask adapters (``plugins/``, ``dashboard/``), then the front ends (``serve/``, ``cli``,
``demo`` and the package's own ``__init__``). A module imports only from its own stage and
earlier ones. Every import counts: at module level, under ``TYPE_CHECKING`` and inside functions.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import yaml

import seabiscuit_dask

PACKAGE = "seabiscuit_dask"
ROOT = Path(seabiscuit_dask.__file__).parent

STAGES = ("core", "trace", "decompose", "placement", "lower", "runtime", "adapters", "front")
# NOTE: a module's stage is that of the longest prefix of its name listed here
STAGE_OF = {
    f"{PACKAGE}.ir": "core", f"{PACKAGE}.ops": "core", f"{PACKAGE}.errors": "core",
    f"{PACKAGE}.config": "core", f"{PACKAGE}.version": "core", f"{PACKAGE}.pauses": "core",
    f"{PACKAGE}.timing": "core", f"{PACKAGE}.cost": "core",
    f"{PACKAGE}.qlinear": "core",          # NOTE: the kernel of the op table's sb.qlinear (ONNX traces it)
    f"{PACKAGE}.quantize": "core",         # NOTE: a pass over the IR (weights and decompose apply it)
    # NOTE: the runnable half of the op table: which targets a graph may name, checked wherever a
    # graph comes in (a template read from disk, a deploy); it imports only the core
    f"{PACKAGE}.lower.registry": "core",
    f"{PACKAGE}.trace": "trace", f"{PACKAGE}.templates": "trace", f"{PACKAGE}.weights": "trace",
    f"{PACKAGE}.models": "trace", f"{PACKAGE}.gguf": "trace",
    f"{PACKAGE}.decompose": "decompose",
    f"{PACKAGE}.placement": "placement",
    f"{PACKAGE}.lower": "lower",
    f"{PACKAGE}.runtime": "runtime",
    f"{PACKAGE}.plugins": "adapters", f"{PACKAGE}.dashboard": "adapters",
    f"{PACKAGE}.serve": "front", f"{PACKAGE}.cli": "front", f"{PACKAGE}.demo": "front", PACKAGE: "front",
}

# NOTE: imports made inside a function on purpose, each with a comment there saying why; the
# module imported imports the importer in turn, so these are the only edges of a circle allowed
DEFERRED = frozenset({
    # Plan.report() is the way into report.py, which repairs plans with replan: both build on Plan
    (f"{PACKAGE}.placement.plan", f"{PACKAGE}.placement.report"),
})


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _known(name: str) -> str:
    """The module ``name`` is (or, for a name inside a module, the module it is in)."""
    while name not in modules() and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The package's modules one import statement of ``module`` reads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module if modules()[module].name == "__init__.py" else module.rsplit(".", 1)[0]
        if node.level:
            base = ".".join(base.split(".")[:len(base.split(".")) - node.level + 1])
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module or ""
        # NOTE: ``from pkg import sub`` reads the module pkg.sub where there is one
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules() else source for a in node.names]
    for name in names:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            yield _known(name)


@cache
def imports() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}."""
    out: dict[str, dict[str, int]] = {}
    for module, path in modules().items():
        found = out.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(module, node):
                    if target != module:
                        found.setdefault(target, node.lineno)
    return out


def stage(module: str) -> str:
    prefix = module
    while prefix not in STAGE_OF:
        assert "." in prefix, f"{module} has no stage: add it (or a prefix of it) to STAGE_OF"
        prefix = prefix.rsplit(".", 1)[0]
    return STAGE_OF[prefix]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``edges``: its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_stage_and_the_resolver_sees_their_imports() -> None:
    assert {stage(m) for m in modules()} <= set(STAGES)
    seen = imports()
    assert f"{PACKAGE}.ir" in seen[f"{PACKAGE}.placement.plan"]                # ``from ..ir import``
    assert f"{PACKAGE}.decompose.rules.matmul" in seen[f"{PACKAGE}.decompose.rules"]   # ``from . import``
    assert f"{PACKAGE}.ops" in seen[f"{PACKAGE}.decompose.rules.matmul"]        # ``from ... import ops``
    assert f"{PACKAGE}.decompose" in seen[f"{PACKAGE}.cli"]                      # inside a function
    assert PACKAGE in seen[f"{PACKAGE}.demo"]                                    # ``import seabiscuit_dask``


def test_no_module_imports_a_later_stage() -> None:
    order = {s: i for i, s in enumerate(STAGES)}
    late = [f"{m} ({stage(m)}) line {line} imports {t} ({stage(t)})"
            for m, targets in sorted(imports().items()) for t, line in sorted(targets.items())
            if order[stage(t)] > order[stage(m)]]
    assert not late, "imports running back up the stages:\n" + "\n".join(late)


def test_no_modules_import_each_other_in_a_circle() -> None:
    edges = {m: {t for t in targets if (m, t) not in DEFERRED} for m, targets in imports().items()}
    assert not cycles(edges), cycles(edges)


def test_the_deferred_imports_listed_are_still_there() -> None:
    """An entry whose import went away is struck, so the list names only what is there."""
    every = {(m, t) for m, targets in imports().items() for t in targets}
    assert DEFERRED <= every, sorted(DEFERRED - every)


def test_the_circle_finder_finds_circles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# --- settings -------------------------------------------------------------------------------------


def _getters(module: str, tree: ast.AST) -> set[str]:
    """The names ``module`` calls ``config.get`` by, bare: ``get`` in config.py itself, and in a module
    that imports it by name."""
    names = {"get"} if module == f"{PACKAGE}.config" else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and f"{PACKAGE}.config" in _imported(module, node):
            names |= {a.asname or a.name for a in node.names if a.name == "get"}
    return names


def _settings_read() -> Iterator[tuple[str, int, str | None, bool]]:
    """(module, line, key or None when computed, whether a default is given) of each
    ``config.get(key, ...)`` call of the package."""
    for module, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        bare = _getters(module, tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "get" and isinstance(f.value, ast.Name)
                    and f.value.id == "config") or (isinstance(f, ast.Name) and f.id in bare):
                key = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
                yield module, node.lineno, key, len(node.args) > 1 or bool(node.keywords)


def test_every_setting_read_has_its_default_in_the_yaml() -> None:
    defaults = yaml.safe_load((ROOT / "seabiscuit.yaml").read_text())["seabiscuit"]

    def there(key: str) -> bool:
        d = defaults
        for part in key.split("."):
            if not isinstance(d, dict) or part not in d:
                return False
            d = d[part]
        return True

    read = list(_settings_read())
    assert len(read) > 40
    missing = [f"{m}:{line} {key}" for m, line, key, _ in read if key is not None and not there(key)]
    assert not missing, missing
    inline = [f"{m}:{line} {key}" for m, line, key, default in read
              if default]
    assert not inline, f"settings read with a default of their own (the yaml holds it): {inline}"
