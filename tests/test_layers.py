"""The import graph of ``src/ncap``: no cycles (imports inside functions and under
TYPE_CHECKING included), and the leaves stay leaves."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

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


# -- layers: a package imports only from its own layer or the ones below ------------------

LAYERS = {  # lowest first; the top-level module ``ncap`` is layer 0
    "ncap": 0,
    "errors": 0,
    "config": 1,
    "protocol": 1,
    "logsafe": 1,
    "redact": 1,
    "metrics": 1,
    "auth": 1,
    "domain": 2,
    "streaming": 2,
    "admission": 2,
    "client": 2,
    "engine": 2,
    "stores": 3,
    "providers": 3,
    "lifecycle": 4,
    "reports": 4,
    "testing": 4,
    "http": 5,
    "cli": 6,
}


def _package(module: str) -> str:
    """``ncap.stores.sqlite.ledger`` -> ``stores``; ``ncap`` -> ``ncap``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _climbs(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a package from a higher layer than the importer's."""
    return sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps
        if LAYERS[_package(dep)] > LAYERS[_package(module)]
    )


def test_every_package_has_a_layer() -> None:
    assert {_package(m) for m in MODULES} <= set(LAYERS)


def test_no_import_climbs_a_layer() -> None:
    assert _climbs(_graph()) == []


def test_the_layer_check_sees_a_climbing_import() -> None:
    # the stores importing the reports (the index helper they once borrowed) climbs
    planted = {"ncap.stores": {"ncap.reports.indexes"}, "ncap.reports": {"ncap.stores"}}
    assert _climbs(planted) == ["ncap.stores -> ncap.reports.indexes"]


# -- stores: a backend is chosen in ncap.stores only ---------------------------------------

STORE_SCHEME = re.compile(r"^(memory|sqlite|postgres|postgresql|redis|rediss)(:|$)")
ALLOWED_STORE_MODULES = ("ncap.stores", "ncap.stores.ports")


def _strings(node: ast.AST) -> Iterator[str]:
    for child in ast.walk(node):
        if isinstance(child, ast.Constant) and isinstance(child.value, str):
            yield child.value


def _scheme_reads(source: str) -> list[int]:
    """Lines that read a store URL's scheme: a scheme compared (``==``, ``in``,
    ``startswith``, a ``match`` case, a dict keyed by it) or ``urlsplit(…).scheme``.
    A URL written as data (a default, a message) reads nothing."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            texts = [s for part in (node.left, *node.comparators) for s in _strings(part)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            wanted = node.func.attr in ("startswith", "endswith", "removeprefix")
            texts = [s for arg in node.args for s in _strings(arg)] if wanted else []
        elif isinstance(node, ast.Dict):
            texts = [s for key in node.keys if key is not None for s in _strings(key)]
        elif isinstance(node, ast.MatchValue):
            texts = list(_strings(node.value))
        elif isinstance(node, ast.Attribute) and node.attr == "scheme":
            call = node.value
            name = getattr(getattr(call, "func", None), "id", "") or getattr(
                getattr(call, "func", None), "attr", ""
            )
            texts = ["scheme:"] if name in ("urlsplit", "urlparse") else []
        else:
            continue
        if any(STORE_SCHEME.match(t) or t == "scheme:" for t in texts):
            lines.append(node.lineno)
    return sorted(set(lines))


def _backend_imports(module: str, imported: Iterator[str]) -> list[str]:
    """Store modules ``module`` imports other than the stores' package and ports."""
    if module == "ncap.stores" or module.startswith("ncap.stores."):
        return []
    return sorted(
        {
            _resolve(name)
            for name in imported
            if name.startswith("ncap.stores.") and _resolve(name) not in ALLOWED_STORE_MODULES
        }
    )


def _outside_stores() -> list[str]:
    return [m for m in MODULES if m != "ncap.stores" and not m.startswith("ncap.stores.")]


def test_no_module_outside_the_stores_reads_a_store_url_scheme() -> None:
    found = {m: _scheme_reads(MODULES[m].read_text()) for m in _outside_stores()}
    assert {m: lines for m, lines in found.items() if lines} == {}


def test_no_module_outside_the_stores_imports_a_backend() -> None:
    found = {m: _backend_imports(m, _imports(m)) for m in MODULES}
    assert {m: names for m, names in found.items() if names} == {}


@pytest.mark.parametrize(
    "planted",
    [
        'if url.startswith("sqlite://"):\n    pass\n',
        'if url.startswith(("postgresql://", "postgres://")):\n    pass\n',
        'ok = urlsplit(url).scheme != "sqlite"\n',
        "kind = urlparse(url).scheme\n",
        'scheme = url.partition(":")[0]\nname = {"postgres": "postgresql"}.get(scheme)\n',
        'if scheme in ("redis", "rediss"):\n    pass\n',
        'match scheme:\n    case "memory":\n        pass\n',
    ],
)
def test_the_scheme_check_sees_a_planted_read(planted: str) -> None:
    assert _scheme_reads(planted) != []


def test_the_scheme_check_lets_urls_written_as_data_pass() -> None:
    data = 'LEDGER = "sqlite:///.ncap/ledger.db"\nhelp = "use redis://… budgets"\n'
    assert _scheme_reads(data) == []


def test_the_backend_import_check_sees_a_planted_import() -> None:
    planted = ["ncap.stores.sqlite.ledger.SQLiteLedgerStore", "ncap.stores.ports.Hold"]
    assert _backend_imports("ncap.http.app", iter(planted)) == ["ncap.stores.sqlite.ledger"]
    assert _backend_imports("ncap.stores.sqlite", iter(planted)) == []
    assert _backend_imports("ncap.cli.ledger", iter(["ncap.stores.RowExport"])) == []
