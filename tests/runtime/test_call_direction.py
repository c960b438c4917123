"""Calls go one way (issue 35): the executor calls the plan and fusion,
which never call it back; the runtime reaches the solver only through
graph.Updates, never by name. Read from the sources (ast), as the
import-direction test reads imports."""
import ast

import pytest

from helpers.paths import REPO

RUNTIME = REPO / "cct" / "runtime"


def tree(path):
    return ast.parse(path.read_text(), filename=str(path))


def names(node):
    """Every identifier a node's code uses: names and attribute names (not strings)."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name):
            yield inner.id, inner.lineno
        elif isinstance(inner, ast.Attribute):
            yield inner.attr, inner.lineno


@pytest.mark.parametrize("module", ["plan.py", "fusion.py"])
def test_the_plan_and_fusion_never_call_the_executor(module):
    """Their classes take what the executor decided (values, the net, the
    BLAS threads) and hand control back by returning, not by calling it."""
    classes = [node for node in tree(RUNTIME / module).body if isinstance(node, ast.ClassDef)]
    used = [(name, line) for cls in classes for name, line in names(cls) if "executor" in name.lower()]
    assert not used, f"{module} reaches the executor at {used}"
    imports = [node for node in ast.walk(tree(RUNTIME / module)) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not any("executor" in (getattr(node, "module", None) or "") or
                   any("executor" in alias.name for alias in node.names) for node in imports)


@pytest.mark.parametrize("module", ["scheduler.py", "graph.py", "tuner.py"])
def test_the_schedules_reach_the_net_through_its_steps(module):
    """The streams, their runner and the tuner get a graph.Steps from the
    executor (Executor.steps) and call that, never the executor by name."""
    used = [(name, line) for name, line in names(tree(RUNTIME / module))
            if "executor" in name.lower() and name != "ThreadPoolExecutor"]    # (a stream's own thread)
    assert not used, f"{module} reaches the executor at {used}"


def test_the_executor_hands_the_plan_and_fusion_no_self():
    """A callee given the executor could call it back: it gets values."""
    passed = []
    for node in ast.walk(tree(RUNTIME / "executor.py")):
        if not isinstance(node, ast.Call):
            continue
        callee = {name for name, _ in names(node.func)}
        if callee & {"fusion", "fusion_module", "Plan", "plan", "_plan"}:
            if any(isinstance(arg, ast.Name) and arg.id == "self" for arg in node.args):
                passed.append(node.lineno)
    assert not passed, f"executor.py passes itself to the plan or fusion at lines {passed}"


def test_the_runtime_names_no_solver():
    """Whole-iteration sub-tasks reach the training loop through graph.Updates
    (cct.training.windows.SolverUpdates), which the solver hands down."""
    found = [(path.name, name, line) for path in sorted(RUNTIME.glob("*.py"))
             for name, line in names(tree(path)) if "solver" in name.lower()]
    assert not found, f"the runtime names the solver: {found}"
