"""A rule for the device kernels that the CPU's compilers do not enforce: no statement after an `if` that returns.
Triton 3.6 (the device's) compiles the code after a returning constexpr branch too, so code valid only when the branch
is not taken fails there while this machine's Triton compiles it (a kernel of 0c2b4b5 did exactly that). Branches
that return go in an if / else."""
import ast
from pathlib import Path

import pytest

KERNELS = sorted((Path(__file__).parent.parent / "kernels").glob("*.py"))


def _jit_functions(tree: ast.AST):
    """The Triton kernels and their helpers (Gluon's kernels build only on a GPU, so the device's tests cover them)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "triton.jit" for d in node.decorator_list):
            yield node


def _returns_then_continues(body: list[ast.stmt]) -> list[int]:
    """Lines of the `if` statements in body (or nested in it) that hold a return and are followed by more code."""
    found = []
    for i, stmt in enumerate(body):
        branches = [getattr(stmt, name, []) for name in ("body", "orelse")]
        if isinstance(stmt, ast.If) and i < len(body) - 1 and any(isinstance(n, ast.Return) for b in branches
                                                                  for s in b for n in ast.walk(s)):
            found.append(stmt.lineno)
        for branch in branches:
            found += _returns_then_continues(branch)
    return found


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_no_code_after_a_returning_branch_in_a_kernel(path):
    tree = ast.parse(path.read_text())
    bad = [(fn.name, line) for fn in _jit_functions(tree) for line in _returns_then_continues(fn.body)]
    assert not bad, f"{path.name}: an if that returns, then more code (use if / else): {bad}"


def test_the_rule_sees_the_pattern():
    early = ast.parse("def f(x, C):\n    if C:\n        return x\n    y = x + 1\n    return y\n").body[0]
    branches = ast.parse("def f(x, C):\n    if C:\n        y = x\n    else:\n        y = x + 1\n    return y\n").body[0]
    assert _returns_then_continues(early.body) == [2] and _returns_then_continues(branches.body) == []
