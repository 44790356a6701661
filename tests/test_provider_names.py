"""No code outside ``providers/`` and ``config`` compares a provider's name: everything
else asks the route's capabilities (``ncap.providers.kinds``). The scan reads every
module's syntax tree, so a comparison hidden in a function body or a ``match`` counts."""

from __future__ import annotations

import ast
from pathlib import Path

from ncap.providers.kinds import KINDS

SRC = Path(__file__).resolve().parents[1] / "src" / "ncap"
ALLOWED = {SRC / "config.py", *(SRC / "providers").rglob("*.py")}
NAMES = frozenset(KINDS)


def _names_a_provider(node: ast.AST) -> bool:
    """A provider's name as a literal, alone or in a tuple/list/set literal."""
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_provider(e) for e in node.elts)
    return False


def _reads_provider(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "provider"


def comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing a provider name, or comparing anything with ``….provider``."""
    return [node.lineno for node in ast.walk(tree) if _compares(node)]


def _compares(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        return any(_names_a_provider(s) or _reads_provider(s) for s in sides)
    if isinstance(node, ast.Match):
        return _reads_provider(node.subject)
    if isinstance(node, ast.MatchValue):
        return _names_a_provider(node.value)
    return False


def test_the_scan_catches_each_form() -> None:
    caught = """
if route.provider == "x": pass
if "gemini" == kind: pass
if name in ("local", "y"): pass
match route.provider:
    case _: pass
match kind:
    case "anthropic": pass
"""
    assert sorted(comparisons(ast.parse(caught))) == [2, 3, 4, 5, 8]
    fine = 'x = {"provider": "openai"}\nf(provider=route.provider)\nif caps.in_process: pass\n'
    assert comparisons(ast.parse(fine)) == []


def test_no_provider_name_is_compared_outside_providers_and_config() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path in ALLOWED:
            continue
        for line in comparisons(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(SRC)}:{line}")
    assert offenders == []
