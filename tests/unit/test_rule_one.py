"""Rule 1 (STYLE.md): every decision that moves a machine lives in states/, never in daemon/.

The daemon gathers facts (an exit code, a classified reason, a VRAM reading) and carries the
tables' answers out. Two signs of a decision taken in daemon/ are checked here on the source:
branching on a reason code (`reason == ReasonCode.X`, `match reason: case ReasonCode.X`) and
counting crashes, restarts or attempts. The few places that branch on a code only to word a
message, shape an error or answer a client are listed below with why; a new one fails this
test until its decision moves into a table under states/, or it is listed with its reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

DAEMON = Path(__file__).resolve().parents[2] / "daemon"

# (module, function): why branching on a reason code there decides no transition.
WORDING_ONLY = {
    ("bundles/smoke.py", "_engine_failed"): "a bundle's smoke test names its failure; no machine moves",
    ("bundles/verify.py", "_run_engine"): "the same, for `stoker bundle verify`",
    ("cli/daemon_or_here.py", "through_daemon_or_here"): "the CLI chooses between the daemon and working alone",
    ("cli/model_view.py", "show"): "without a daemon, show still reads the file: the CLI chooses what it can show",
    ("control/client.py", "_await_reply"): "the client words a refusal of its own request",
    ("fallback/orchestrator.py", "startup_sentence"): "the sentence about a failed start, from its evidence",
    ("frontdoor/app.py", "_remote_refused"): "the sentence of a 503/502 states/frontdoor/remote_endpoint.py chose",
    ("frontdoor/hold.py", "_detail"): "the words after a 503 states/frontdoor/policy.py chose",
    ("frontdoor/tallies.py", "_launch"): "/metrics counts crash loops the launch machine recorded",
    ("install/manifest.py", "load_manifest"): "a refused manifest's sentence says which refusal",
    ("launch/supervisor.py", "_watch_ready"): "a stall or a start timeout is reported as the StallTimeout event",
    ("models/pull.py", "remove"): "the pull machine refused the removal (its table decides); this words it",
    ("models/resolve.py", "refusal"): "the sentence of a refusal states/pull/lookup.py decided",
    ("snapshots/save_restore.py", "before_stop"): "which failures the snapshot log records; the stop goes on",
}
# module: why a counter of attempts there is no machine's crash or restart count.
COUNTS_OWN_ATTEMPTS = {
    "core/download.py": "the resumable downloader counts its HTTP requests under its own retry table",
    "frontdoor/tallies.py": "the /metrics counters tally from history what the machines recorded",
}
COUNTER = re.compile(r"(crash|restart|attempt|tries|retr)", re.IGNORECASE)


def _functions(tree: ast.Module) -> dict[ast.AST, str]:
    """Every node of `tree` mapped to the name of the function it is in."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            owner[child] = inner
            visit(child, inner)

    visit(tree, "<module>")
    return owner


def _names_a_reason(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("ReasonCode", "R")
        for n in ast.walk(node)
    )


def _reason_branches() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(DAEMON.rglob("*.py")):
        tree = ast.parse(path.read_text())
        owner = _functions(tree)
        for node in ast.walk(tree):
            branching = (isinstance(node, ast.Compare) and _names_a_reason(node)) or (
                isinstance(node, ast.MatchValue) and _names_a_reason(node.value)
            )
            if branching:
                found.add((str(path.relative_to(DAEMON)), owner.get(node, "<module>")))
    return found


def test_daemon_branches_on_reason_codes_only_to_word_them():
    stray = _reason_branches() - set(WORDING_ONLY)
    assert not stray, (
        f"daemon/ decides on a reason code in {sorted(stray)}: move the decision into a table under states/ "
        "(the event carries the facts), or, if it only words a message, list it in WORDING_ONLY with why"
    )


def test_every_listed_exception_still_exists():
    assert set(WORDING_ONLY) <= _reason_branches(), "a listed place no longer branches on a code: unlist it"


def test_daemon_counts_no_crashes_restarts_or_attempts():
    counting = set()
    for path in sorted(DAEMON.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
                target = ast.unparse(node.target)
                if COUNTER.search(target):
                    counting.add((str(path.relative_to(DAEMON)), target))
    stray = {(module, target) for module, target in counting if module not in COUNTS_OWN_ATTEMPTS}
    assert not stray, f"daemon/ counts attempts itself in {sorted(stray)}: the machine's data counts them"
