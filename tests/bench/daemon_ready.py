"""Daemon time-to-ready against llama-server run directly, and status round trips.

    .venv/bin/python tests/bench/daemon_ready.py [--runs 5] [--model PATH]

1. Time-to-ready: the same engine, model and arguments, (a) spawned directly and polled on
   /health every 2 ms until 200, and (b) through the daemon, from the `up` request to the
   `machine.launch.ready` event on a subscriber. Runs alternate; the figure is the median of
   the per-pair ratios daemon/direct (target <= 1.05).
2. `status` round trips over the socket while a subscriber is attached: p50 and p99 on one
   connection and with a new connection per request, the way the CLI does it (target p99 < 5 ms).

Results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from daemon.bundles.build import build_bundle  # noqa: E402
from daemon.bundles.installed import install_bundle  # noqa: E402
from daemon.control.client import ControlClient  # noqa: E402
from daemon.models.resolve import resolve_model  # noqa: E402
from daemon.core.paths import StokerPaths  # noqa: E402
from daemon.engine.process import ServerSpec, server_argv, server_env  # noqa: E402
from tests.bench.report import machine, percentile, write_section  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_direct(server: Path, model: Path, ctx: int, workdir: Path) -> float:
    """Spawn llama-server the way the daemon does, poll /health until 200."""
    port = free_port()
    key_file = workdir / "key"
    key_file.write_text("benchkey\n")
    spec = ServerSpec(server_path=server, model_path=model, port=port, ctx_size=ctx, parallel=1, flash_attn="auto")
    argv = server_argv(spec, api_key_file=key_file)
    cwd = workdir / "cwd"
    cwd.mkdir(exist_ok=True)
    with open(workdir / "direct.log", "ab") as log, httpx.Client(timeout=1.0, trust_env=False) as client:
        started = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=server_env(spec), start_new_session=True
        )
        try:
            while True:
                try:
                    if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        return time.perf_counter() - started
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"direct server exited {proc.returncode}")
                time.sleep(0.002)
        finally:
            proc.terminate()
            proc.wait(30)


def time_daemon(d: DaemonProcess) -> float:
    """From the `up` request to the ready event on a subscriber."""
    with ControlClient(d.paths.socket_path, timeout=120) as sub_client, d.client(timeout=120) as client:
        events = sub_client.subscribe()
        started = time.perf_counter()
        client.call("up")
        for event in events:
            if event.get("topic") == "machine.launch.ready" and event.get("event") == "Ready":
                elapsed = time.perf_counter() - started
                break
        events.close()
        client.call("down")
    return elapsed


def status_rtt(d: DaemonProcess, count: int) -> dict[str, list[float]]:
    """Round trips of `status` while a subscriber is attached."""
    stop = threading.Event()
    seen = []

    def subscriber() -> None:
        with ControlClient(d.paths.socket_path, timeout=None) as c:
            stream = c.subscribe()
            for event in stream:
                seen.append(event)
                if stop.is_set():
                    break

    thread = threading.Thread(target=subscriber, daemon=True)
    thread.start()
    time.sleep(0.2)
    persistent, fresh = [], []
    with d.client() as client:
        for _ in range(count):
            t = time.perf_counter()
            client.call("status")
            persistent.append((time.perf_counter() - t) * 1000)
    for _ in range(count // 4):
        t = time.perf_counter()
        with d.client() as client:
            client.call("status")
        fresh.append((time.perf_counter() - t) * 1000)
    stop.set()
    d.call("restart")  # an event so the subscriber notices the stop flag
    return {"one connection": persistent, "connection per call": fresh}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--status-calls", type=int, default=2000)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="stoker-bench-"))
    env = {**os.environ, "STOKER_HOME": str(home)}
    paths = StokerPaths.from_env(env)
    result = build_bundle(paths, backend="cpu", progress=lambda line: print(line, file=sys.stderr))
    bundle = install_bundle(result.zip_path, paths, expect_backend="cpu")
    model = resolve_model(args.model, paths)
    ctx = 4096
    print(f"engine {bundle.meta.version} ({bundle.meta.variant}), model {model.name}", file=sys.stderr)

    d = DaemonProcess(home)
    write_config(d.paths, tiny_config(model, ctx_size=ctx, stall_timeout_s=120.0, ready_timeout_s=600.0))
    d.start()
    try:
        d.wait_state("ready", timeout=600)
        d.call("down")
        work = home / "direct"
        work.mkdir()
        direct, via_daemon = [], []
        for i in range(args.runs):
            direct.append(time_direct(bundle.server, model, ctx, work))
            via_daemon.append(time_daemon(d))
            print(f"run {i + 1}: direct {direct[-1]:.3f} s, daemon {via_daemon[-1]:.3f} s", file=sys.stderr)
        ratios = [b / a for a, b in zip(direct, via_daemon)]
        d.call("up")
        d.wait_state("ready", timeout=600)
        rtts = status_rtt(d, args.status_calls)
    finally:
        d.stop()

    ratio = statistics.median(ratios)
    lines = [
        f"Machine: {machine()}. Engine {bundle.meta.version}, CPU variant {bundle.meta.variant}; "
        f"model {model.name}, ctx {ctx}. Command: `.venv/bin/python tests/bench/daemon_ready.py --runs {args.runs}`.",
        "",
        "### Time to ready (daemon `up` -> ready event, against spawn -> first /health 200)",
        "",
        "| run | direct (s) | daemon (s) | ratio |",
        "|---|---|---|---|",
    ]
    lines += [f"| {i + 1} | {a:.3f} | {b:.3f} | {b / a:.3f} |" for i, (a, b) in enumerate(zip(direct, via_daemon))]
    lines += [
        "",
        f"**Median ratio daemon/direct: {ratio:.3f}** (target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'}).",
        "",
    ]
    lines += [
        "### `status` round trips with a subscriber attached",
        "",
        "| connection | calls | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, values in rtts.items():
        lines.append(
            f"| {name} | {len(values)} | {percentile(values, 50):.3f} | {percentile(values, 99):.3f} | {max(values):.3f} |"
        )
    p99 = percentile(rtts["one connection"], 99)
    lines += ["", f"Target p99 < 5 ms on one connection: {'met' if p99 < 5 else 'NOT met'} ({p99:.3f} ms)."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("Daemon time-to-ready and status round trips", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
