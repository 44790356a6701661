"""The import graph of ``src/ncap``: no cycles (imports inside functions and under
TYPE_CHECKING included), and the leaves stay leaves."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import ncap

SRC = Path(ncap.__file__).parent
HEAVY = ("aiohttp", "ncap.stores", "ncap.providers")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}


def _resolve(name: str) -> str:
    """The deepest module of ours that ``name`` names (``a.b.C`` → ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> Iterator[str]:
    """Every name ``module`` imports, wherever the statement is (every ast node)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        ours = {_resolve(n) for n in _imports(module) if n.startswith("ncap")}
        graph[module] = {m for m in ours if m and m != module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle, as the path that closes it, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_walker_sees_type_checking_and_function_level_imports() -> None:
    graph = _graph()
    # providers.provider_for imports its adapters inside the function
    assert "ncap.providers.openai" in graph["ncap.providers"]
    assert "ncap.lifecycle.plan" in graph["ncap.lifecycle.gateway"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_src_ncap_outside_the_cli() -> None:
    graph = {m: deps for m, deps in _graph().items() if not m.startswith("ncap.cli")}
    assert not any(d.startswith("ncap.cli") for deps in graph.values() for d in deps)
    assert _cycle(graph) is None


def test_no_import_cycle_in_src_ncap() -> None:
    assert _cycle(_graph()) is None


def test_protocol_and_domain_import_no_io_stores_or_providers() -> None:
    graph = _graph()
    leaves = [m for m in MODULES if m.startswith(("ncap.protocol", "ncap.domain"))]
    assert leaves
    for module in leaves:
        seen, todo = set(), [module]
        while todo:  # transitively: everything the leaf would load
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            todo.extend(graph[current])
            raw = set(_imports(current))
            bad = {n for n in raw | seen if n == "aiohttp" or n.startswith(HEAVY)}
            assert not bad, f"{module} reaches {sorted(bad)} through {current}"
