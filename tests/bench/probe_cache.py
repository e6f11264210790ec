"""`stoker probe` answered from the 30 s cache against a fresh probe, in the same run.

    .venv/bin/python tests/bench/probe_cache.py [--runs 10]

A real daemon (its autostart fails at once on a missing model, so no engine runs) is asked
over its socket, the way the CLI asks: `probe` for every backend with `fresh: true` (each
backend's detect(), concurrently) and then `probe` from the cache.
Runs alternate fresh / cached; the figure is the median round trip of each and their ratio.
The cache must also be *right*: every cached answer is checked against the fresh one before it.

Results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.report import machine, percentile, write_section  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config  # noqa: E402


def verdicts(reply: dict) -> dict[str, tuple]:
    return {b["backend"]: (b["usable"], b["reason"], b["generation"]) for b in reply["backends"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="stoker-bench-probe-") as tmp:
        home = Path(tmp)
        d = DaemonProcess(home)
        write_config(d.paths, tiny_config(home / "absent.gguf"))
        d.start()
        fresh_ms: list[float] = []
        cached_ms: list[float] = []
        try:
            d.wait_state("failed", timeout=120)  # model_missing: idle, nothing else running
            with d.client(timeout=120.0) as client:
                client.call("probe", fresh=True)  # warm: imports, NVML lookup, page cache
                for _ in range(args.runs):
                    started = time.perf_counter()
                    fresh = client.call("probe", fresh=True)
                    fresh_ms.append((time.perf_counter() - started) * 1000)
                    started = time.perf_counter()
                    cached = client.call("probe")
                    cached_ms.append((time.perf_counter() - started) * 1000)
                    assert all(b["cached"] for b in cached["backends"]), cached
                    assert verdicts(cached) == verdicts(fresh), (cached, fresh)
                backends = [b["backend"] for b in fresh["backends"]]
                usable = [b["backend"] for b in fresh["backends"] if b["usable"]]
        finally:
            d.stop()
    f50, c50 = statistics.median(fresh_ms), statistics.median(cached_ms)
    ratio = f50 / c50
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    text = (
        f"Machine: {machine()}; load average during the run {load}.\n\n"
        "`probe` over the daemon's socket for every registered backend "
        f"({', '.join(backends)}; usable here: {', '.join(usable) or 'none'}), {args.runs} alternating runs. "
        "Fresh: each backend's `detect()`, concurrently (generation N+1): in its own subprocess, or "
        "in-process where `quick_detect()` needs no driver (no tool installed, not a Mac). Cached: "
        "the verdicts of the probe just before, within the 30 s TTL, checked equal to them.\n\n"
        "| | median | p90 | min |\n|---|---|---|---|\n"
        f"| fresh probe (`stoker probe --fresh`) | {f50:.1f} ms | {percentile(fresh_ms, 90):.1f} ms | {min(fresh_ms):.1f} ms |\n"
        f"| from cache (`stoker probe`) | {c50:.2f} ms | {percentile(cached_ms, 90):.2f} ms | {min(cached_ms):.2f} ms |\n\n"
        f"Cache speed-up (median fresh / median cached): **{ratio:.0f}x**.\n\n"
        "Command: `.venv/bin/python tests/bench/probe_cache.py --runs "
        f"{args.runs}`. The fresh figure is dominated by starting the Python probe processes that "
        "remain (cuda's NVML probe, and the CPU backend's instruction tests) on a shared 2-core "
        "machine; on a GPU host NVML init adds about 110 ms (ENGINE.md). Before `quick_detect` "
        "all five ran as subprocesses: 2177 ms median.\n"
    )
    print(text)
    if not args.no_write:
        write_section("Probe: cache against fresh", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
