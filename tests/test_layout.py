"""The package's module layout (issue 29's "no import circle, and no module imports another's
underscore names"), read from the sources' import statements with ``ast``."""

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).parent.parent / "functional_train"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(mods: dict[str, Path]):
    """``(module, target module, imported name or None, at top level)`` for each import of a
    module of the package, resolving relative imports; a ``from X import y`` whose ``y`` is a
    module gives that module as the target."""
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods:
                        yield name, alias.name, None, id(node) in top
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source not in mods:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in mods:
                        yield name, sub, None, id(node) in top
                    else:
                        yield name, source, alias.name, id(node) in top


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (networkx, a dependency of
    torch), each sorted."""
    graph = nx.DiGraph([(v, w) for v, ws in edges.items() for w in ws])
    graph.add_nodes_from(edges)
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_modules():
    """No two modules import each other, directly or through others, at their top level. A
    package's ``__init__`` is left out: it re-exports its modules, so every module importing
    from it would close a circle through it. An import inside a function runs when it is
    called and may close a circle on purpose; it is not counted."""
    mods = _modules()
    packages = {name for name, path in mods.items() if path.name == "__init__.py"}
    edges: dict[str, set[str]] = {name: set() for name in mods if name not in packages}
    for name, target, _, top in _imports(mods):
        if top and name in edges and target not in packages and target != name:
            edges[name].add(target)
    assert _cycles(edges) == []


def test_no_module_imports_another_modules_underscore_names():
    """A helper shared between modules has a public name in its module (a private module,
    such as ``_validate``, is imported as a module, and its names are public)."""
    mods = _modules()
    private = [
        f"{name} imports {target}.{imported}"
        for name, target, imported, _ in _imports(mods)
        if imported is not None and imported.startswith("_") and target != name
    ]
    assert private == []
