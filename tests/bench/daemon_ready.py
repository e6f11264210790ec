"""Daemon time-to-ready against llama-server run directly, and status round trips.

    .venv/bin/python tests/bench/daemon_ready.py [--runs 5] [--model PATH]
    .venv/bin/python tests/bench/daemon_ready.py --big-gib 3 --runs 5   # a generated 3 GiB F16 model
    .venv/bin/python tests/bench/daemon_ready.py --big-gib 1.6 --runs 3 --cli   # and `stoker up --wait`

1. Time-to-ready: the same engine, model and arguments, (a) spawned directly and polled on
   /health every 2 ms until 200, and (b) through the daemon, from the `up` request to the
   `machine.launch.ready` event on a subscriber. Runs alternate; the figure is the median of
   the per-pair ratios daemon/direct (target <= 1.05). The daemon runs with its default
   snapshot settings (on), and before each of its runs the model file's mtime is moved
   (`--touch`, the default), so every daemon run is the first ready of that file as the daemon
   sees it: whatever it learns about a model file (its identity) is paid for in the figure.
   `--big-gib N` writes an 8B-shaped F16 model of about N GiB (tests/bench/bigmodel.py) to
   $TMPDIR and uses it: the case where anything proportional to the model's size shows.
   `--backend cuda` runs a CUDA bundle (built or taken from the cache) on a GPU host.
   `--cli` adds a third arm, the way a user starts it: `stoker up --wait` as its own process,
   timed from spawn to exit, against the same direct start; reported with the CLI's own start
   (a `stoker status --json` run beside it, spawn to exit: the interpreter, the imports, one
   round trip) taken off, and with it.
   `--fresh` adds a fourth arm: a daemon started in a fresh home (the engine bundle linked in,
   nothing else: no kept fitter answer, no header cache, no history), from its spawn to its
   default model's ready, with when its engine was spawned and first healthy in the same run.
2. `status` round trips over the socket while a subscriber is attached: p50 and p99 on one
   connection and with a new connection per request, the way the CLI does it (target p99 < 5 ms).
   Skipped with --big-gib.

Results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
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
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stoker.daemon.control.client import ControlClient  # noqa: E402
from tests.model_files import model_file  # noqa: E402
from stoker.daemon.core.paths import StokerPaths  # noqa: E402
from stoker.daemon.core.digests import sha256_file  # noqa: E402
from stoker.daemon.models.identity import _CACHE as _IDENTITIES  # noqa: E402
from stoker.daemon.models.identity import model_identity  # noqa: E402
from tests.bench.bigmodel import big_model  # noqa: E402
from tests.bench.report import engine_bundle, machine, percentile, write_section  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_server(d: DaemonProcess) -> tuple[list[str], dict[str, str]]:
    """The ready server's own argv and environment (the plan the daemon ran), so that the
    direct arm runs exactly what the daemon runs."""
    proc = psutil.Process(d.call("status")["pid"])
    return proc.cmdline(), proc.environ()


def time_direct(argv: list[str], env: dict[str, str], workdir: Path) -> float:
    """Spawn the daemon's argv directly (own port, key and slot dir), poll /health until 200."""
    port = free_port()
    key_file = workdir / "key"
    key_file.write_text("benchkey\n")
    argv = list(argv)
    for flag, value in (("--port", str(port)), ("--api-key-file", str(key_file)), ("--slot-save-path", None)):
        if flag in argv:
            i = argv.index(flag)
            if value is None:
                del argv[i : i + 2]
            else:
                argv[i + 1] = value
    cwd = workdir / "cwd"
    cwd.mkdir(exist_ok=True)
    with open(workdir / "direct.log", "ab") as log, httpx.Client(timeout=1.0, trust_env=False) as client:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
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
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def model_identity_cache_clear() -> None:
    _IDENTITIES.clear()


def warm(path: Path) -> None:
    """Read the file whole, so that it is in the page cache."""
    with open(path, "rb", buffering=0) as fh:
        while fh.read(16 << 20):
            pass


class EngineWatch(threading.Thread):
    """Beside a daemon run: when its llama-server appeared and when its /health first said 200,
    polled every 2 ms, so that one run gives both the engine's own start-up and the daemon's."""

    def __init__(self, daemon_pid: int, started: float) -> None:
        super().__init__(daemon=True)
        self.daemon_pid, self.started = daemon_pid, started
        self.spawned: float | None = None
        self.healthy: float | None = None
        self.stop = threading.Event()
        # A server still stopping from the run before is not this run's.
        self.before = {p.pid for p in psutil.Process(daemon_pid).children(recursive=True)}

    def run(self) -> None:
        server: psutil.Process | None = None
        port = None
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            while not self.stop.is_set() and self.healthy is None:
                if server is None:
                    for child in psutil.Process(self.daemon_pid).children(recursive=True):
                        try:
                            name = child.name()
                        except psutil.Error:  # a probe or an instruction test that ended meanwhile
                            continue
                        if child.pid not in self.before and name == "llama-server":
                            self.spawned = time.perf_counter() - self.started
                            server = child
                elif port is None:  # the daemon runs it with --port 0: the port it listens on
                    try:
                        listening = [c for c in server.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
                    except psutil.Error:
                        listening = []
                    port = str(listening[0].laddr.port) if listening else None
                elif self._healthy(client, port):
                    self.healthy = time.perf_counter() - self.started
                time.sleep(0.002)

    @staticmethod
    def _healthy(client: httpx.Client, port: str) -> bool:
        try:
            return client.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False


def time_daemon(d: DaemonProcess, model: Path | None = None) -> tuple[float, float | None, float | None]:
    """From the `up` request to the ready event on a subscriber, and (from the same run) when
    the engine was spawned and first healthy; with `model`, its mtime is moved first (a file the
    daemon has not seen in this state)."""
    if model is not None:
        st = model.stat()
        os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert d.proc is not None
    with ControlClient(d.paths.socket_path, timeout=120) as sub_client, d.client(timeout=120) as client:
        events = sub_client.subscribe()
        watch = EngineWatch(d.proc.pid, 0.0)
        started = watch.started = time.perf_counter()
        watch.start()
        client.call("up")
        for event in events:
            if event.get("topic") == "machine.launch.ready" and event.get("event") == "Ready":
                elapsed = time.perf_counter() - started
                break
        events.close()
        watch.stop.set()
        watch.join(5)
        client.call("down")
    return elapsed, watch.spawned, watch.healthy


STOKER = Path(sys.executable).with_name("stoker")


def cli(*args: str) -> list[str]:
    """The installed `stoker` script, as a user types it (else `python -m stoker.daemon`)."""
    return [str(STOKER), *args] if STOKER.exists() else [sys.executable, "-m", "stoker.daemon", *args]


def time_cli(d: DaemonProcess, model: Path | None = None) -> tuple[float, float]:
    """`stoker up --wait` from spawn to exit (the model's mtime moved first, as time_daemon
    does), and a `stoker status --json` run just before it (the CLI's own start and one round
    trip, through the full command line as `up` goes: plain `stoker status` takes a quicker path)."""
    if model is not None:
        st = model.stat()
        os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    started = time.perf_counter()
    subprocess.run(
        cli("status", "--json"), env=d.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
    )
    own = time.perf_counter() - started
    started = time.perf_counter()
    done = subprocess.run(cli("up", "--wait"), env=d.env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"stoker up --wait failed: {done.stdout}{done.stderr}")
    d.call("down")
    return took, own


def plan_memory_said(d: DaemonProcess) -> str:
    """Which estimate the daemon's first plan recorded: "stoker-bound" (Stoker's upper bound, no
    fitter run), "llama-fit-params", or "stoker" (its partial estimate where the fitter failed)."""
    rows = sorted(d.history(machine="launch", limit=50), key=lambda r: r["id"])
    plans = [(r.get("event_data") or {}).get("plan") or {} for r in rows if r["event"] == "PlanReady"]
    memory = (plans[0].get("memory") if plans else None) or {}
    return str(memory.get("source") or "none recorded")


def time_fresh(
    bundles: Path, config: dict, model: Path, said: list[str] | None = None
) -> tuple[float, float | None, float | None]:
    """A daemon in a fresh home (the bundles hard-linked in), from its spawn to its default
    model's ready (status polled every 5 ms), with when its engine was spawned and first healthy;
    `said` gets which estimate its plan recorded (`plan_memory_said`)."""
    import shutil

    home = Path(tempfile.mkdtemp(prefix="stoker-fresh-"))
    d = DaemonProcess(home)
    shutil.copytree(bundles, d.paths.bundles_dir, copy_function=os.link)
    write_config(d.paths, config)
    try:
        started = time.perf_counter()
        d.start(wait=False)
        assert d.proc is not None
        watch = EngineWatch(d.proc.pid, started)
        watch.before = set()
        watch.start()
        elapsed = None
        while elapsed is None:
            if d.proc.poll() is not None:
                raise RuntimeError(f"the fresh daemon exited: {d.log_text()[-2000:]}")
            try:
                with d.client(timeout=5) as client:
                    while elapsed is None:
                        if client.call("status")["state"] == "ready":
                            elapsed = time.perf_counter() - started
                        else:
                            time.sleep(0.005)
            except Exception:  # not listening yet
                time.sleep(0.005)
        watch.stop.set()
        watch.join(5)
        if said is not None:
            said.append(plan_memory_said(d))
        return elapsed, watch.spawned, watch.healthy
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


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


def run_rows(direct: list[float], runs: list[tuple[float, float | None, float | None]]) -> list[str]:
    """One table row per run: the direct start, the run (whole, and until its engine was spawned,
    the engine's own start, after it was healthy), against direct and against its own engine."""
    rows = []
    for i, (a, (b, sp, h)) in enumerate(zip(direct, runs)):
        inner = (
            "| - | - | - | - |"
            if sp is None or h is None
            else f"| {sp:.3f} | {h - sp:.3f} | {b - h:.3f} | {b / (h - sp):.3f} |"
        )
        rows.append(f"| {i + 1} | {a:.3f} | {b:.3f} | {b / a:.3f} " + inner)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--big-gib", type=float, default=None, help="write and use an 8B-shaped F16 model of N GiB")
    ap.add_argument("--bundle", type=Path, default=None, help="an engine bundle zip (default: build the CPU one)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--no-touch", action="store_true", help="leave the model's mtime alone (a model already seen)")
    ap.add_argument("--status-calls", type=int, default=2000)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--cli", action="store_true", help="add the `stoker up --wait` arm")
    ap.add_argument("--fresh", action="store_true", help="add a daemon started in a fresh home, spawn to ready")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="stoker-bench-"))
    env = {**os.environ, "STOKER_HOME": str(home)}
    paths = StokerPaths.from_env(env)
    bundle = engine_bundle(paths, args.bundle, progress=lambda line: print(line, file=sys.stderr))
    if args.big_gib:
        model = big_model(args.big_gib)
    else:
        model = model_file(args.model, paths)
    ctx = args.ctx
    size_gib = model.stat().st_size / 2**30
    print(
        f"engine {bundle.meta.version} ({bundle.meta.backend}/{bundle.meta.variant}), model {model.name}",
        file=sys.stderr,
    )

    d = DaemonProcess(home)
    # The daemon's defaults, snapshots included (on): what a user runs.
    config = tiny_config(model, snapshots=True, ctx_size=ctx, stall_timeout_s=120.0, ready_timeout_s=600.0)
    write_config(d.paths, config)
    d.start()
    rtts: dict[str, list[float]] = {}
    try:
        d.wait_state("ready", timeout=600)
        argv, server_env = daemon_server(d)
        d.call("down")
        work = home / "direct"
        work.mkdir()
        direct, via_daemon = [], []
        via_cli: list[tuple[float, float]] = []
        fresh: list[tuple[float, float | None, float | None]] = []
        fresh_said: list[str] = []
        for i in range(args.runs):
            # Both arms start from a model in the page cache (read whole before each), and take
            # turns going first.
            arms = [
                lambda: direct.append(time_direct(argv, server_env, work)),
                lambda: via_daemon.append(time_daemon(d, None if args.no_touch else model)),
            ]
            if args.cli:
                arms.append(lambda: via_cli.append(time_cli(d, None if args.no_touch else model)))
            if args.fresh:
                arms.append(lambda: fresh.append(time_fresh(paths.bundles_dir, config, model, fresh_said)))
            for arm in arms if i % 2 == 0 else arms[::-1]:
                warm(model)
                arm()
            print(
                f"run {i + 1}: direct {direct[-1]:.3f} s, daemon {via_daemon[-1]}, up --wait {via_cli[-1:]}, "
                f"fresh {fresh[-1:]} {fresh_said[-1:]}",
                file=sys.stderr,
            )
        ratios = [b[0] / a for a, b in zip(direct, via_daemon)]
        if not args.big_gib:
            d.call("up")
            d.wait_state("ready", timeout=600)
            rtts = status_rtt(d, args.status_calls)
    finally:
        d.stop()

    ratio = statistics.median(ratios)
    # Within each daemon run: the engine's own start-up (spawn -> healthy) against the whole.
    own = [(t, sp, h) for t, sp, h in via_daemon if sp is not None and h is not None]
    within = [t / (h - sp) for t, sp, h in own]
    added = [t - (h - sp) for t, sp, h in own]
    # What the daemon's ready path used to pay for the model's identity, against what it pays now.
    warm(model)
    started = time.perf_counter()
    sha256_file(model)
    full_s = time.perf_counter() - started
    model_identity_cache_clear()
    started = time.perf_counter()
    ident = model_identity(model)
    ident_s = time.perf_counter() - started
    touched = "" if args.no_touch else " (the model's mtime moved before each daemon run: a file it has not seen)"
    command = (
        "`.venv/bin/python tests/bench/daemon_ready.py "
        + (f"--big-gib {args.big_gib:g} " if args.big_gib else "")
        + f"--runs {args.runs}"
        + (" --cli" if args.cli else "")
        + (" --fresh" if args.fresh else "")
        + (" --no-touch" if args.no_touch else "")
        + "`"
    )
    lines = [
        f"Machine: {machine()}. Engine {bundle.meta.version}, {bundle.meta.backend} variant {bundle.meta.variant}; "
        f"model {model.name} ({size_gib:.2f} GiB), ctx {ctx}, snapshots on (the default). Command: {command}.",
        "",
        f"### Time to ready (daemon `up` -> ready event{touched}, against the same argv spawned -> first /health 200; "
        "the model read into the page cache before each run, the arms taking turns going first)",
        "",
        "| run | direct (s) | daemon (s) | ratio | daemon run: up -> spawn | spawn -> /health 200 (the engine) | "
        "/health 200 -> ready event | daemon / its own engine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += run_rows(direct, via_daemon)
    lines += [
        "",
        f"Median ratio daemon/direct over the pairs: {ratio:.3f}; medians {statistics.median(direct):.3f} s direct, "
        f"{statistics.median(b for b, _, _ in via_daemon):.3f} s daemon. The engine's own start-up swings from run to "
        "run on a shared machine, so the pairs are noisy; the column that is not is the last one: each daemon run "
        "against its own engine's spawn -> first /health 200, measured beside it (polled every 2 ms).",
        "",
        f"**Median ratio daemon / its own engine: {statistics.median(within):.3f}** (target <= 1.05: "
        f"{'met' if statistics.median(within) <= 1.05 else 'NOT met'}); what the daemon adds, median "
        f"{statistics.median(added) * 1000:.0f} ms (planning and spawning before, the ready hook after).",
        "",
    ]
    if via_cli:
        lines += [
            "### `stoker up --wait` against the same direct start (the CLI as its own process, spawn to exit)",
            "",
            "| run | direct (s) | `stoker up --wait` (s) | CLI's own start (s) | ratio, CLI start taken off | ratio, with it |",
            "|---|---|---|---|---|---|",
        ]
        for i, (a, (c, own_s)) in enumerate(zip(direct, via_cli)):
            lines.append(f"| {i + 1} | {a:.3f} | {c:.3f} | {own_s:.3f} | {(c - own_s) / a:.3f} | {c / a:.3f} |")
        off = statistics.median((c - own_s) / a for a, (c, own_s) in zip(direct, via_cli))
        on = statistics.median(c / a for a, (c, _) in zip(direct, via_cli))
        lines += [
            "",
            f"**Median ratio `stoker up --wait` / direct: {off:.3f} with the CLI's own start taken off, {on:.3f} "
            f"with it** (target <= 1.05 without it: {'met' if off <= 1.05 else 'NOT met'}). The CLI's own start is "
            "a `stoker status --json` run just before: the interpreter, the CLI's imports and one round trip.",
            "",
        ]
    if fresh:
        lines += [
            "### A daemon started in a fresh home, from its spawn to its model's ready",
            "",
            "| run | direct (s) | fresh daemon (s) | ratio | spawn -> engine spawned | the engine's own start | "
            "engine healthy -> ready seen | fresh daemon / its own engine |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += run_rows(direct, fresh)
        lines += [
            "",
            f"**Median ratio fresh daemon / direct: {statistics.median(b / a for a, (b, _, _) in zip(direct, fresh)):.3f}**; "
            "what comes before the engine's spawn is the daemon's own start (Python and its imports), the "
            "probes and the plan. The plan's memory in each fresh home: "
            + ", ".join(f"{said} ({n} of {len(fresh_said)})" for said, n in collections.Counter(fresh_said).items())
            + " (stoker-bound: a GPU plan that clearly fits, no fitter run; llama-fit-params: it ran once).",
            "",
        ]
    lines += [
        f"The model's identity for snapshots (daemon/models/identity.py): {ident_s * 1000:.1f} ms, reading "
        f"{ident.bytes_read / 2**10:.0f} KiB of the {size_gib:.2f} GiB file; the sha256 of the whole file that "
        f"the first ready used to wait for: {full_s:.2f} s (page cache warm).",
        "",
    ]
    if rtts:
        lines += [
            "### `status` round trips with a subscriber attached",
            "",
            "| connection | calls | p50 (ms) | p99 (ms) | max (ms) |",
            "|---|---|---|---|---|",
        ]
        for name, values in rtts.items():
            lines.append(
                f"| {name} | {len(values)} | {percentile(values, 50):.3f} | {percentile(values, 99):.3f} | "
                f"{max(values):.3f} |"
            )
        p99 = percentile(rtts["one connection"], 99)
        lines += ["", f"Target p99 < 5 ms on one connection: {'met' if p99 < 5 else 'NOT met'} ({p99:.3f} ms)."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        heading = "Daemon time-to-ready and status round trips"
        if args.big_gib:
            heading = f"Daemon time-to-ready on a multi-GB model ({args.big_gib:g} GiB, {bundle.meta.backend})"
        if args.cli:
            heading += ", and `stoker up --wait`"
        write_section(heading, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
