"""No import cycles in the product packages.

The imports are read with ``ast`` rather than by importing: so every import counts, also those
under ``if TYPE_CHECKING:`` and inside functions (a cycle hidden there still ties two modules
into one unit that cannot be read, tested or moved apart), and no module is executed (no
torch, no model). Relative imports are resolved; ``from package import name`` is an edge to
the submodule ``package.name`` when there is one, else to ``package``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The product's packages; the top-level ``*_app.py`` and ``start_app.py`` modules count too.
PACKAGES = ("client", "server", "protocol", "utils", "launcher", "chat_ui", "tools")


def product_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the product under ``root``."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    for path in sorted(root.glob("*.py")):
        modules[path.stem] = path
    return modules


def _imported_names(module: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The dotted names ``module`` imports: ``from a import b`` gives ``a.b`` when that is a
    module, else ``a``."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in modules else base


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the product modules it imports (each name resolved to its longest module)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        names = {resolve(name) for name in _imported_names(module, path, modules)}
        graph[module] = {name for name in names if name is not None and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component: list[str] = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))  # one frame per module on a long chain
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return found


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    """The cycle's modules, each with the modules of the cycle it imports."""
    members = set(component)
    lines = [f"{len(component)} modules import each other:"]
    for module in component:
        lines.append(f"  {module} -> {', '.join(sorted(graph[module] & members))}")
    return "\n".join(lines)


def test_the_product_has_no_import_cycle() -> None:
    modules = product_modules(ROOT)
    assert "client.gateway" in modules and "client_app" in modules  # the walk found the tree
    graph = import_graph(modules)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(c, graph) for c in found)


def test_a_cycle_through_type_checking_and_relative_imports_is_found(tmp_path: Path) -> None:
    """The check itself: a cycle closed by a ``TYPE_CHECKING`` import, a relative import and
    an import inside a function is reported, module by module."""
    package = tmp_path / "client" / "kinds"
    package.mkdir(parents=True)
    (tmp_path / "client" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from .one import One\n")
    (package / "one.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from client import schema\n"
    )
    (tmp_path / "client" / "schema.py").write_text(
        "def kinds():\n    from client.kinds import one\n    return one\n"
    )
    (tmp_path / "client" / "plain.py").write_text("from client import schema\n")
    modules = product_modules(tmp_path)
    graph = import_graph(modules)
    assert graph["client.kinds"] == {"client.kinds.one"}
    assert cycles(graph) == [["client.kinds.one", "client.schema"]]
    assert "client.schema -> client.kinds.one" in describe(cycles(graph)[0], graph)
