"""tilegen's modules import downward only: no import circle, anywhere.

The graph is read from the sources with ``ast``, every ``import`` and ``from ... import`` of a
tilegen module counted, those inside functions included (a deferred import is still a
dependency; it only hides a circle until the day it runs first). An edge goes to the module
that defines the imported name: ``from tilegen.families import base`` is an edge to
``tilegen.families.base``, ``from tilegen.families import family_of`` one to the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tilegen"

#: The layers of the house, bottom first; a module may import only from its own layer or below.
LAYERS = [
    ("base", ["tilegen.version", "tilegen.env", "tilegen.files", "tilegen.lazy", "tilegen.dtypes", "tilegen.ir", "tilegen.mods",
              "tilegen.device", "tilegen.triton_internals"]),
    ("families", ["tilegen.families"]),
    ("codegen", ["tilegen.codegen", "tilegen.key"]),
    ("database", ["tilegen.db"]),
    ("dispatch", ["tilegen.dispatch"]),
    ("ops", ["tilegen.ops"]),
    ("layers", ["tilegen.layers"]),
    ("tuning", ["tilegen.tuning"]),
    ("top", ["tilegen.cli", "tilegen.bench", "tilegen.integrations", "tilegen.__main__", "tilegen"]),
]


def modules(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every module of the package."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the tilegen modules it imports."""
    known = modules(root)

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, (path, is_package) in known.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # ``from a import b``: b is a module of its own, or a name defined in a.
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                           for alias in node.names]
            for target in targets:
                if target == "tilegen" or target.startswith("tilegen."):
                    found = owner(target)
                    if found is not None and found != name:
                        graph[name].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module}: in no layer of the house; add it to LAYERS"
    return rank


def test_the_graph_sees_imports_inside_functions_and_relative_ones(tmp_path):
    root = tmp_path / "tilegen"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("def f():\n    from tilegen.sub import b\n")
    (root / "sub" / "__init__.py").write_text("from .b import thing\n")
    (root / "sub" / "b.py").write_text("import tilegen.a\nthing = 1\n")
    graph = import_graph(root)
    assert graph["tilegen.a"] == {"tilegen.sub.b"} and graph["tilegen.sub"] == {"tilegen.sub.b"}
    assert circles(graph) == [["tilegen.a", "tilegen.sub.b"]]


def test_there_is_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_import_goes_down_the_layers():
    upward = sorted(
        f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for source, targets in import_graph().items()
        for target in targets
        if layer_of(target) > layer_of(source)
    )
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("module", ["tilegen.families", "tilegen.codegen", "tilegen.db", "tilegen.dispatch"])
def test_lower_layers_never_import_the_ops_or_the_package(module):
    graph = import_graph()
    reach, pending = set(), [m for m in graph if m == module or m.startswith(module + ".")]
    while pending:
        current = pending.pop()
        for target in graph[current]:
            if target not in reach:
                reach.add(target)
                pending.append(target)
    assert "tilegen" not in reach and not any(m.startswith("tilegen.ops") for m in reach), sorted(reach)
