"""Install throughput: Stoker's download() against curl, from the same loopback server.

    .venv/bin/python tests/bench/install_throughput.py [--size-mb 300] [--runs 5] [--no-write]

Serves one random file from tests/httpfault.FaultServer (no faults; sendfile), then times,
alternately, `curl -s -o FILE URL && sha256sum FILE` and `daemon.download.download()` (whose
sha256 is computed while streaming, then fsync and rename). The digest is included on both
sides. Prints the runs and the median ratio stoker/curl; writes the table to
docs/benchmarks.md under "## Install throughput", leaving other sections alone.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import multiprocessing
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Iterator

import trio

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from daemon.download import download  # noqa: E402
from tests.httpfault import FaultServer  # noqa: E402

HEADING = "## Install throughput"
TARGET = 0.8


def make_file(path: Path, size: int) -> str:
    """Write `size` random bytes; return their sha256."""
    hasher = hashlib.sha256()
    block = 8 * 1024 * 1024
    with open(path, "wb") as f:
        left = size
        while left:
            data = os.urandom(min(block, left))
            hasher.update(data)
            f.write(data)
            left -= len(data)
    return hasher.hexdigest()


def serve(path: Path, conn: Connection) -> None:
    """The server process: one file, no faults, until the parent says stop."""
    with FaultServer() as server:
        conn.send(server.add("/" + path.name, path))
        conn.recv()


@contextlib.contextmanager
def server_process(path: Path) -> Iterator[str]:
    """Run the loopback server in its own process: in ours it would fight the client for the
    GIL, a handicap that a real CDN never imposes (and that curl, a separate process, escapes)."""
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=serve, args=(path, child), daemon=True)
    proc.start()
    try:
        yield parent.recv()
    finally:
        parent.send("stop")
        proc.join(timeout=10)


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def time_curl(url: str, out: Path, digest: str) -> tuple[float, float, float, float]:
    """Wall and CPU seconds for curl alone, then for curl + sha256sum."""
    out.unlink(missing_ok=True)
    cpu0, began = cpu_seconds(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(["curl", "-s", "-o", str(out), url], check=True)
    cpu1, fetched = cpu_seconds(resource.RUSAGE_CHILDREN), time.perf_counter()
    got = subprocess.run(["sha256sum", str(out)], check=True, capture_output=True, text=True).stdout.split()[0]
    cpu2, done = cpu_seconds(resource.RUSAGE_CHILDREN), time.perf_counter()
    assert got == digest, "curl fetched the wrong bytes"
    out.unlink()
    return fetched - began, done - began, cpu1 - cpu0, cpu2 - cpu0


def time_stoker(url: str, out: Path, digest: str, size: int) -> tuple[float, float]:
    """Wall and CPU seconds (this process; the server runs in another) for download()."""
    out.unlink(missing_ok=True)
    cpu0, began = cpu_seconds(resource.RUSAGE_SELF), time.perf_counter()
    result = trio.run(
        lambda: download(url, out, expected_sha256=digest, expected_size=size, max_bytes=size)
    )
    cpu1, elapsed = cpu_seconds(resource.RUSAGE_SELF), time.perf_counter() - began
    assert result.sha256 == digest and out.stat().st_size == size
    out.unlink()
    return elapsed, cpu1 - cpu0


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    curl = subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    return f"{cpu}, {os.cpu_count()} cores (shared); Python {platform.python_version()}; {curl.split(' (')[0]}"


def write_section(doc: Path, body: str) -> None:
    """Replace (or append) the "Install throughput" section, keeping the rest intact."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    section = f"{HEADING}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    doc.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=300)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    size = args.size_mb * 1024 * 1024
    load = os.getloadavg()[0]

    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as tmp:
        tmpdir = Path(tmp)
        src = tmpdir / "bundle.bin"
        digest = make_file(src, size)
        rows = []
        with server_process(src) as url:
            time_curl(url, tmpdir / "warm.bin", digest)  # page cache and connection warm-up
            for run in range(1, args.runs + 1):
                curl_only, curl_total, curl_cpu, curl_total_cpu = time_curl(url, tmpdir / "curl.bin", digest)
                stoker, stoker_cpu = time_stoker(url, tmpdir / "stoker.bin", digest, size)
                rows.append((run, curl_only, curl_total, stoker, curl_cpu, curl_total_cpu, stoker_cpu))
                print(
                    f"run {run}: curl {size / curl_only / 1e6:7.1f} MB/s, curl+sha256sum "
                    f"{size / curl_total / 1e6:7.1f} MB/s, stoker {size / stoker / 1e6:7.1f} MB/s; "
                    f"CPU s: curl {curl_cpu:.2f}, curl+sha256sum {curl_total_cpu:.2f}, stoker {stoker_cpu:.2f}",
                    flush=True,
                )

    mbps = lambda s: size / s / 1e6  # noqa: E731
    med_curl = statistics.median(mbps(r[2]) for r in rows)
    med_curl_only = statistics.median(mbps(r[1]) for r in rows)
    med_stoker = statistics.median(mbps(r[3]) for r in rows)
    ratio = med_stoker / med_curl
    ratio_only = med_stoker / med_curl_only
    verdict = "meets" if ratio >= TARGET else "MISSES"
    print(f"median: stoker {med_stoker:.1f} MB/s, curl+sha256sum {med_curl:.1f} MB/s, curl alone {med_curl_only:.1f} MB/s")
    print(f"ratio stoker/(curl+sha256sum) = {ratio:.2f} ({verdict} the {TARGET} target); stoker/curl-alone = {ratio_only:.2f}")

    lines = [
        f"`daemon.download.download()` (httpx on trio, sha256 while streaming, fsync + rename) against",
        f"`curl -s -o FILE URL && sha256sum FILE`, fetching the same {args.size_mb} MiB random file from the",
        "loopback fault server (`tests/httpfault.py`, no faults, served with sendfile, in its own "
        "process), alternating, "
        f"{args.runs} runs each, one process. Target: at least {TARGET} of curl's throughput, digest included.",
        "",
        f"Command: `.venv/bin/python tests/bench/install_throughput.py --size-mb {args.size_mb} --runs {args.runs}`",
        "",
        f"Machine: {machine()}. Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"load average {load:.1f} at the start.",
        "",
        "| run | curl alone MB/s | curl + sha256sum MB/s | stoker MB/s "
        "| CPU s: curl | CPU s: curl + sha256sum | CPU s: stoker |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run, curl_only, curl_total, stoker, c_cpu, ct_cpu, s_cpu in rows:
        lines.append(
            f"| {run} | {mbps(curl_only):.1f} | {mbps(curl_total):.1f} | {mbps(stoker):.1f} "
            f"| {c_cpu:.2f} | {ct_cpu:.2f} | {s_cpu:.2f} |"
        )
    med_cpu = [statistics.median(r[i] for r in rows) for i in (4, 5, 6)]
    lines.append(
        f"| **median** | **{med_curl_only:.1f}** | **{med_curl:.1f}** | **{med_stoker:.1f}** "
        f"| **{med_cpu[0]:.2f}** | **{med_cpu[1]:.2f}** | **{med_cpu[2]:.2f}** |"
    )
    lines += [
        "",
        f"Median ratio stoker / (curl + sha256sum): **{ratio:.2f}** ({verdict} the {TARGET} target). "
        f"Against curl alone, with no digest at all: {ratio_only:.2f}.",
        "",
        "Reading the figures:",
        "",
        "- Both sides include the digest; Stoker also includes what curl does not do: fsync of the "
        "file and of its directory before the atomic rename, and starting an event loop and a client.",
        "- Stoker hashes while it receives (a writer thread hashes and writes 1 MiB batches while the "
        "event loop reads the socket); the shell pipeline reads the file again after the transfer, "
        "and coreutils' `sha256sum` is several times slower than Python's hashlib (OpenSSL) on this "
        "CPU: compare the CPU columns.",
        "- Against curl with no digest at all, the gap is what a Python HTTP stack costs. The CPU "
        "columns are the figure that depends least on the other tenants of the machine: Stoker's "
        "CPU time is curl's, plus one pass of OpenSSL's sha256 (about 0.35 s for 300 MiB), plus about "
        "as much again for httpx/h11's buffer copies, the thread hand-offs and the fsync. "
        "Wall-clock figures on a shared 2-core machine swing by 2x from run to run (see the load "
        "average above); the medians are the figures to read.",
        "- What moved the needle: socket reads of 1 MiB instead of httpcore's 64 KiB (through "
        "httpcore's network-backend hook, `daemon.download.download_client()`; about 2x on the "
        "receive path alone), hashing and writing in a worker thread in 1 MiB batches with `writev`, "
        "and one TLS context per process (loading the CA bundle cost 0.1 s per client). The server "
        "runs in its own process so that the client does not share its GIL with the server, as it "
        "never does with a real CDN (and as curl, a separate process, never did).",
    ]
    if not args.no_write:
        write_section(args.doc, "\n".join(lines))
        print(f"wrote {HEADING!r} in {args.doc}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
