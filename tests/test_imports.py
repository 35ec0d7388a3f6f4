"""dfmodel's modules import each other without cycles (module level, deferred imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import dfmodel

ROOT = Path(dfmodel.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _runtime_nodes(tree):
    """Every node except those under ``if TYPE_CHECKING:`` (annotation-only imports)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph() -> nx.DiGraph:
    """Edges module -> dfmodel module it imports (any import statement in the file, including
    those inside functions: a deferred import is still a dependency). A package's
    ``__init__`` re-exporting its own submodules is not counted as the package depending on
    them when the submodule is only reached through the package (``from pkg import x``)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("dfmodel"):
                    g.add_edge(name, t)
    return g


def test_no_import_cycles():
    g = import_graph()
    # a package __init__ importing its own submodules is the package's API, not a cycle
    api = [(a, b) for a, b in g.edges if b.startswith(a + ".") and a.count(".") < b.count(".")]
    g.remove_edges_from(api)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_the_interface_imports_no_family():
    g = import_graph()
    assert not [t for t in g.successors("dfmodel.inter_chip.family_api")]
    assert "dfmodel.inter_chip.families" not in nx.descendants(g, "dfmodel.inter_chip.dlrm")
    assert "dfmodel.algorithms" in g and not list(g.successors("dfmodel.algorithms"))
