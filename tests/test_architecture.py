"""The package's import structure, read from the source with ``ast`` (no import of the package, no Triton).

Every ``import`` and ``from ... import`` of ``src/sparse_mla`` counts, at module level and inside
functions (relative imports resolved). The rules:

* no import cycle between modules;
* arrows point down the layers: ``core`` < ``formats`` < the operations (``decode``, ``prefill``,
  ``indexer``, ``kvcache``, ``training``) < ``api``, ``library``, ``reference``, ``distributed`` < ``tools`` < the
  package's ``__init__`` and ``__main__``; a module imports its own layer or lower ones only;
  ``testing`` imports nothing from the package (tools and tests use it); ``from .. import
  __version__`` (metadata) may come from any layer;
* no private name across packages: a module of an operation, of ``core`` or of ``formats`` imports
  no ``_name`` (and reads no ``module._name``) from another package, nor a ``_private`` module;
* ``import sparse_mla`` imports no Triton (the kernel modules load on first use).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = "sparse_mla"

OPERATIONS = ("decode", "prefill", "indexer", "kvcache", "training")
# rank of each top-level part of the package; a module may import modules of its rank or lower
LAYERS: dict[str, int] = {
    "core": 0,
    "formats": 1,
    **{op: 2 for op in OPERATIONS},
    "api": 3,
    "library": 3,
    "reference": 3,
    "distributed": 3,
    "tools": 4,
    "testing": 4,  # imports nothing from the package (checked apart); tools may use it
    "": 5,  # sparse_mla/__init__.py
    "__main__": 5,
}
# packages whose modules may not reach into another package's private names
GUARDED = ("core", "formats", *OPERATIONS)


@dataclass
class Import:
    importer: str  # dotted module name
    path: Path
    line: int
    target: str  # dotted module name imported (a module of the package)
    names: tuple[str, ...] = ()  # names taken from ``target`` by ``from target import ...``
    attrs: list[tuple[int, str]] = field(default_factory=list)  # ``alias._name`` reads: (line, name)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=1)
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PKG).rglob("*.py"))}


def _is_package(name: str) -> bool:
    return _modules()[name].name == "__init__.py"


def _resolve_from(importer: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".") if _is_package(importer) else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _in_package(name: str) -> bool:
    return name == PKG or name.startswith(PKG + ".")


def _existing_module(name: str) -> str:
    """``name`` if it is a module of the package, else its longest prefix that is one."""
    mods = _modules()
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


@lru_cache(maxsize=1)
def _imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, Import] = {}  # local name bound to a module of the package
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if not _in_package(a.name):
                        continue
                    imp = Import(name, path, node.lineno, _existing_module(a.name))
                    found.append(imp)
                    if a.asname:
                        aliases[a.asname] = imp
            elif isinstance(node, ast.ImportFrom):
                source = _resolve_from(name, node.module, node.level)
                if not _in_package(source):
                    continue
                plain: list[str] = []
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    if sub in _modules():  # ``from pkg import submodule``
                        imp = Import(name, path, node.lineno, sub)
                        found.append(imp)
                        aliases[a.asname or a.name] = imp
                    else:
                        plain.append(a.name)
                if plain or not node.names:
                    found.append(Import(name, path, node.lineno, _existing_module(source), tuple(plain)))
        for node in ast.walk(tree):  # ``module._name`` through a module bound by an import above
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                aliases[node.value.id].attrs.append((node.lineno, node.attr))
    return tuple(found)


def _part(module: str) -> str:
    """Top-level part of the package a module belongs to (``""`` for the package's ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _where(imp: Import) -> str:
    return f"{imp.path.relative_to(ROOT)}:{imp.line}"


def _private_module(module: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in module.split("."))


# ------------------------------------------------------------------------------------------------ tests


def test_the_scan_sees_the_package():
    """Guards the other tests against passing on an empty scan: every layer's part is found, and
    known arrows (absolute, relative, from a package, inside a function) are resolved."""
    parts = {_part(m) for m in _modules()}
    assert set(LAYERS) <= parts, f"parts of the package not found: {set(LAYERS) - parts}"
    assert set(parts) <= set(LAYERS), f"parts with no layer: {set(parts) - set(LAYERS)} (add them to LAYERS)"
    edges = {(i.importer, i.target) for i in _imports()}
    assert ("sparse_mla", "sparse_mla.api") in edges
    assert any(a.startswith("sparse_mla.decode.") and b.startswith("sparse_mla.core") for a, b in edges)
    assert any(a.startswith("sparse_mla.api") and b.startswith("sparse_mla.decode") for a, b in edges)


def _graph() -> dict[str, dict[str, Import]]:
    """module -> {module it imports: the first such import}"""
    graph: dict[str, dict[str, Import]] = {m: {} for m in _modules()}
    for imp in _imports():
        if imp.target != imp.importer:
            graph[imp.importer].setdefault(imp.target, imp)
    return graph


def _cyclic_components(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Strongly connected components of 2+ modules (Tarjan's, iterative): each holds a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def enter(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)

    for start in graph:
        if start in index:
            continue
        enter(start)
        work = [(start, iter(graph[start]))]
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    enter(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = [stack.pop()]
                while comp[-1] != node:
                    comp.append(stack.pop())
                on_stack.difference_update(comp)
                if len(comp) > 1:
                    components.append(comp)
    return components


def _a_cycle(graph: dict[str, dict[str, Import]], comp: list[str]) -> list[Import]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    members, first = set(comp), min(comp)
    prev: dict[str, Import] = {}
    frontier = [first]
    while first not in prev and frontier:
        frontier = [
            t for m in frontier for t, imp in graph[m].items() if t in members and prev.setdefault(t, imp) is imp
        ]
    path = [prev[first]]
    while path[-1].importer != first:
        path.append(prev[path[-1].importer])
    return path[::-1]


def test_the_cycle_finder():
    def imp(a: str, b: str) -> Import:
        return Import(a, SRC / "x.py", 1, b)

    graph = {"a": {"b": imp("a", "b")}, "b": {"c": imp("b", "c")}, "c": {"a": imp("c", "a")}, "d": {"a": imp("d", "a")}}
    (comp,) = _cyclic_components(graph)
    assert sorted(comp) == ["a", "b", "c"]
    assert [(i.importer, i.target) for i in _a_cycle(graph, comp)] == [("a", "b"), ("b", "c"), ("c", "a")]
    assert not _cyclic_components({"a": {"b": imp("a", "b")}, "b": {}})


def test_no_import_cycles():
    graph = _graph()
    messages = []
    for comp in _cyclic_components(graph):
        cycle = _a_cycle(graph, comp)
        chain = " -> ".join([cycle[0].importer] + [i.target for i in cycle])
        arrows = "; ".join(f"{_where(i)} imports {i.target}" for i in cycle)
        messages.append(f"cycle {chain}  ({arrows})")
    assert not messages, "import cycles between modules:\n" + "\n".join(messages)


def test_imports_point_down_the_layers():
    bad = []
    for imp in _imports():
        src, dst = _part(imp.importer), _part(imp.target)
        if src == "testing" or src == dst:
            continue
        if imp.target == PKG and imp.names and all(n.startswith("__") for n in imp.names):
            continue  # the package's metadata (``from .. import __version__``): no behaviour above
        if LAYERS[dst] > LAYERS[src]:
            bad.append(
                f"{_where(imp)}: {imp.importer} (layer {src or PKG!r}) imports {imp.target} "
                f"(layer {dst or PKG!r}, higher)"
            )
    assert not bad, "imports against the layering (core < formats < operations < api/library/...):\n" + "\n".join(bad)


def test_testing_imports_nothing_from_the_package():
    bad = [f"{_where(i)}: imports {i.target}" for i in _imports() if _part(i.importer) == "testing"]
    assert not bad, "sparse_mla.testing must stay free of the package:\n" + "\n".join(bad)


def test_no_private_names_across_packages():
    bad = []
    for imp in _imports():
        src, dst = _part(imp.importer), _part(imp.target)
        if src not in GUARDED or src == dst:
            continue
        if _private_module(imp.target):
            bad.append(f"{_where(imp)}: {imp.importer} imports the private module {imp.target}")
        for n in imp.names:
            if n.startswith("_") and not n.startswith("__"):
                bad.append(f"{_where(imp)}: {imp.importer} imports {n} from {imp.target}")
        for line, n in imp.attrs:
            bad.append(f"{imp.path.relative_to(ROOT)}:{line}: {imp.importer} reads {imp.target}.{n}")
    assert not bad, "private names reached across packages:\n" + "\n".join(bad)


def test_import_sparse_mla_imports_no_triton():
    code = (
        "import sys\nimport sparse_mla\n"
        "t = sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.'))\n"
        "assert not t, 'import sparse_mla imported ' + ', '.join(t[:5])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
