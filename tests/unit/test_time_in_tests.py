"""STYLE.md's "Time in tests" for the unit tests: they run on trio's virtual clock and never wait a
fixed real time for something to have happened. A wait with a deadline lives in tests/waits.py."""

from __future__ import annotations

import ast
from pathlib import Path

UNIT = Path(__file__).resolve().parent
VIRTUAL_CLOCKS = {"autojump_clock", "mock_clock"}


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(UNIT.glob("*.py"))]


def _is_call_of(node: ast.AST, module: str, name: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == module
    )


def _own_nodes(function: ast.AsyncFunctionDef | ast.FunctionDef) -> list[ast.AST]:
    """The function's body without the functions defined in it (a fake server's pacing is theirs)."""
    found, todo = [], list(function.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_no_unit_test_sleeps_in_real_time():
    offenders = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if _is_call_of(node, "time", "sleep"):
                offenders.append(f"{path.name}:{node.lineno}: time.sleep")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "time"
                and any(a.name == "sleep" for a in node.names)
            ):
                offenders.append(f"{path.name}:{node.lineno}: from time import sleep")
    assert not offenders, "wait for the event under a deadline (tests/waits.py), not a fixed time:\n" + "\n".join(
        offenders
    )


def test_a_test_that_sleeps_runs_on_the_virtual_clock():
    """`await trio.sleep(x)` in a test's own body is a wait for time to pass: on the real clock it
    is a guess at how long something takes; on the autojump clock it is exact and free."""
    offenders = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.AsyncFunctionDef) and node.name.startswith("test_")):
                continue
            if VIRTUAL_CLOCKS & {a.arg for a in node.args.args}:
                continue
            for inner in _own_nodes(node):
                if _is_call_of(inner, "trio", "sleep") and not (
                    inner.args and isinstance(inner.args[0], ast.Constant) and inner.args[0].value == 0
                ):
                    offenders.append(f"{path.name}:{inner.lineno}: {node.name}")
    assert not offenders, (
        "take the autojump_clock fixture, or wait for what the test needs (trio.testing.wait_all_tasks_blocked, "
        "an Event, tests/waits.py's until):\n" + "\n".join(offenders)
    )
