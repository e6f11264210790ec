"""The wall time of the commands a user types most, the daemon running, as the user times them.

    .venv/bin/python tests/bench/cli_latency.py [--runs 15] [--no-write]

One daemon on a temporary STOKER_HOME serves the tiny model on the CPU engine (built or taken
from the build cache). Each round runs, in turn, the interpreter alone (`python -c pass`, the
floor any Python command pays), `stoker --help`, `stoker status`, `stoker ps` and `stoker show
default`, each as its own process through the installed `stoker` script, and times it from
the outside (spawn to exit). The order rotates round by round (the machine is shared and
noisy). Goal: under 150 ms each. Results go to docs/benchmarks.md, "CLI commands' wall time".

Beside the wall time it reports each command's CPU time (user + system, from the kernel's
accounting of the child): on a shared machine the wall time also counts the other programs'
turns on the cores, the CPU time much less. The commands run with Python's bytecode cache
(PYTHONDONTWRITEBYTECODE unset, as `./dev` does), as a user's do: without it every module of
Stoker is compiled from source at each run.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stoker.daemon.bundles.tinymodel import write_tiny_model  # noqa: E402
from stoker.daemon.core.paths import StokerPaths  # noqa: E402
from tests.bench.report import engine_bundle, machine, percentile, write_section  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config  # noqa: E402

STOKER = str(Path(sys.executable).with_name("stoker"))
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "stoker --help": [STOKER, "--help"],
    "stoker status": [STOKER, "status"],
    "stoker ps": [STOKER, "ps"],
    "stoker show default": [STOKER, "show", "default"],
}


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """The wall time and the CPU time (user + system) of one run of `argv`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    took = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{argv} failed: {done.stderr.decode()}")
    return took, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="stoker-bench-cli-"))
    env = {**os.environ, "STOKER_HOME": str(home)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    paths = StokerPaths.from_env(env)
    engine_bundle(paths)
    model = write_tiny_model(home / "tiny.gguf")
    daemon = DaemonProcess(home)
    write_config(daemon.paths, tiny_config(model))
    daemon.start()
    try:
        daemon.wait_state("ready")
        times: dict[str, list[float]] = {name: [] for name in COMMANDS}
        cpu: dict[str, list[float]] = {name: [] for name in COMMANDS}
        names = list(COMMANDS)
        for name in names:  # warm the page cache and the bytecode cache once
            timed(COMMANDS[name], env)
        for round_ in range(args.runs):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                wall, used = timed(COMMANDS[name], env)
                times[name].append(wall)
                cpu[name].append(used)
    finally:
        daemon.stop()

    floor = statistics.median(times["python -c pass"])
    cpu_floor = statistics.median(cpu["python -c pass"])
    rows = [
        "| command | median | p90 | over `python -c pass` | × `python -c pass` | CPU median | CPU over `python -c pass` | goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        goal = (
            "-"
            if name.startswith("python") or name.startswith("stoker show")
            else ("met" if median < 0.150 else "missed")
        )
        rows.append(
            f"| `{name}` | {median * 1000:.0f} ms | {percentile(values, 90) * 1000:.0f} ms | "
            f"{(median - floor) * 1000:+.0f} ms | {median / floor:.1f} | {statistics.median(cpu[name]) * 1000:.0f} ms | "
            f"{(statistics.median(cpu[name]) - cpu_floor) * 1000:+.0f} ms | {goal} |"
        )
    body = "\n".join(
        [
            "`.venv/bin/python tests/bench/cli_latency.py --runs "
            f"{args.runs}`: each command as its own process, the daemon running on the tiny model, "
            "timed from spawn to exit, rounds interleaved. Goal: under 150 ms for `--help`, `status` and `ps`.",
            "",
            f"Machine: {machine()}; load average at the end {os.getloadavg()[0]:.1f}.",
            "",
            *rows,
        ]
    )
    print(body)
    if not args.no_write:
        write_section("CLI commands' wall time", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
