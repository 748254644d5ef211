"""What is trained is decided in `algo/` (and selected in `config/`): no other module of the
package compares a loss's, an estimator's or another registry entry's name, or a value of the
`algorithm` section, with a string. It asks `algo/` instead (`Recipe`, `token_fields`,
`shown_field`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cagrpo_ray.algo import REGISTRIES

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "cagrpo_ray"
ALLOWED = ("algo", "config")  # where the names are defined and selected
NAMES = {name for registry in REGISTRIES for name in registry}
# an operand that reads one of these is an algorithm choice, whatever string it meets
ALGORITHM_READS = ("algorithm", "policy_loss", "advantage_estimator")


def strings(node: ast.AST) -> set[str]:
    """The string constants of an operand: itself, or the elements of a tuple, list or set."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, code) of each comparison of a registry name, or of an algorithm setting, with a
    string (==, !=, in, not in, and match-case values)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            constants = set().union(*(strings(op) for op in operands))
            reads = any(
                word in ast.unparse(op) for op in operands for word in ALGORITHM_READS
            ) and bool(constants)
            if constants & NAMES or reads:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match):
            values = {
                case.pattern.value.value
                for case in node.cases
                if isinstance(case.pattern, ast.MatchValue)
                and isinstance(case.pattern.value, ast.Constant)
            }
            if values & NAMES:
                found.append((node.lineno, ast.unparse(node.subject)))
    return found


def test_the_finder_finds_what_the_runtime_used_to_compare():
    old = (
        'if loss == "cagrpo": pass\n'
        'x = w if metadata.get("policy_loss") == "cagrpo" else c\n'
        'if cfg.algorithm.overlong == "mask": pass\n'
        'if a.kappa_control == "entropy" and name in ("clip_cov", "kl_cov"): pass\n'
        "match estimator:\n"
        '    case "dr_grpo": pass\n'
    )
    assert sorted(line for line, _ in name_comparisons(old)) == [1, 2, 3, 4, 5]
    assert name_comparisons('if reason == "length": pass\nif k in ("a", "b"): pass\n') == []


def test_no_name_is_compared_outside_algo_and_config():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in ALLOWED:
            continue
        for line, code in name_comparisons(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {code}")
    assert not offenders, "ask cagrpo_ray.algo instead:\n" + "\n".join(offenders)
