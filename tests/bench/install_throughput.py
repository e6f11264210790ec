"""Install throughput: Stoker's download() against curl, from the same loopback server.

    .venv/bin/python tests/bench/install_throughput.py [--size-mb 300] [--runs 5] [--no-write]

Serves one random file from tests/httpfault.FaultServer (no faults; sendfile; its own process),
then times, alternately, `curl -s -o FILE URL && sha256sum FILE` (and, as stricter references,
curl + `openssl dgst -sha256` and curl alone) and `daemon.core.download.download()` (sha256 computed
while streaming, then fsync and rename). Prints the runs and the median ratio stoker/curl;
writes the table to docs/benchmarks.md under "## Install throughput", leaving other sections
alone. Exits 1 when the median ratio misses the 0.8 target.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Iterator

import attrs
import trio

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stoker.daemon.core.download import download  # noqa: E402
from tests.httpfault import FaultServer  # noqa: E402

from tests.bench import report  # noqa: E402

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


@attrs.frozen
class Run:
    """One round: wall and CPU seconds of each contestant."""

    curl: float
    sha256sum: float
    openssl: float
    stoker: float
    curl_cpu: float
    sha256sum_cpu: float
    openssl_cpu: float
    stoker_cpu: float


def timed_child(argv: list[str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of a child process, and its stdout."""
    cpu0, began = cpu_seconds(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - began, cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0, out


def time_curl(url: str, out: Path, digest: str) -> tuple[float, float, float, float, float, float]:
    """curl to a file, then its digest by sha256sum and by `openssl dgst` (wall, CPU each)."""
    out.unlink(missing_ok=True)
    curl, curl_cpu, _ = timed_child(["curl", "-s", "-o", str(out), url])
    sha, sha_cpu, printed = timed_child(["sha256sum", str(out)])
    assert printed.split()[0] == digest, "curl fetched the wrong bytes"
    ossl, ossl_cpu, printed = timed_child(["openssl", "dgst", "-sha256", "-r", str(out)])
    assert printed.split()[0] == digest
    out.unlink()
    return curl, sha, ossl, curl_cpu, sha_cpu, ossl_cpu


def time_stoker(url: str, out: Path, digest: str, size: int) -> tuple[float, float]:
    """Wall and CPU seconds (this process; the server runs in another) for download()."""
    out.unlink(missing_ok=True)
    cpu0, began = cpu_seconds(resource.RUSAGE_SELF), time.perf_counter()
    result = trio.run(lambda: download(url, out, expected_sha256=digest, expected_size=size, max_bytes=size))
    cpu1, elapsed = cpu_seconds(resource.RUSAGE_SELF), time.perf_counter() - began
    assert result.sha256 == digest and out.stat().st_size == size
    out.unlink()
    return elapsed, cpu1 - cpu0


def machine() -> str:
    """The shared machine line, plus the curl that is compared against."""
    curl = subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    return f"{report.machine()}; {curl.split(' (')[0]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=300)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    size = args.size_mb * 1024 * 1024
    load = os.getloadavg()[0]

    def mbps(seconds: float) -> float:
        return size / seconds / 1e6

    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as tmp:
        tmpdir = Path(tmp)
        src = tmpdir / "bundle.bin"
        digest = make_file(src, size)
        rows: list[Run] = []
        with server_process(src) as url:
            time_curl(url, tmpdir / "warm.bin", digest)  # page cache and connection warm-up
            for n in range(1, args.runs + 1):
                curl, sha, ossl, curl_cpu, sha_cpu, ossl_cpu = time_curl(url, tmpdir / "curl.bin", digest)
                stoker, stoker_cpu = time_stoker(url, tmpdir / "stoker.bin", digest, size)
                run = Run(curl, sha, ossl, stoker, curl_cpu, sha_cpu, ossl_cpu, stoker_cpu)
                rows.append(run)
                print(
                    f"run {n}: MB/s curl {mbps(curl):.1f}, curl+sha256sum {mbps(curl + sha):.1f}, "
                    f"curl+openssl {mbps(curl + ossl):.1f}, stoker {mbps(stoker):.1f}; CPU s: curl "
                    f"{curl_cpu:.2f}, sha256sum {sha_cpu:.2f}, openssl {ossl_cpu:.2f}, stoker {stoker_cpu:.2f}",
                    flush=True,
                )

    def median(f: Callable[[Run], float]) -> float:
        return statistics.median(f(r) for r in rows)

    med = {
        "curl": median(lambda r: mbps(r.curl)),
        "sha": median(lambda r: mbps(r.curl + r.sha256sum)),
        "ossl": median(lambda r: mbps(r.curl + r.openssl)),
        "stoker": median(lambda r: mbps(r.stoker)),
    }
    ratio = med["stoker"] / med["sha"]
    ratio_ossl = med["stoker"] / med["ossl"]
    ratio_curl = med["stoker"] / med["curl"]
    verdict = "meets" if ratio >= TARGET else "MISSES"
    print(
        f"median MB/s: stoker {med['stoker']:.1f}, curl+sha256sum {med['sha']:.1f}, "
        f"curl+openssl {med['ossl']:.1f}, curl alone {med['curl']:.1f}"
    )
    print(
        f"ratio stoker/(curl+sha256sum) = {ratio:.2f} ({verdict} the {TARGET} target); "
        f"stoker/(curl+openssl) = {ratio_ossl:.2f}; stoker/curl-alone = {ratio_curl:.2f}"
    )

    lines = [
        "`daemon.core.download.download()` (http.client into reused buffers, sha256 and O_DIRECT writes on threads of their own, fsync + rename) against",
        f"`curl -s -o FILE URL && sha256sum FILE`, fetching the same {args.size_mb} MiB random file from the",
        "loopback fault server (`tests/httpfault.py`, no faults, served with sendfile, in its own process),",
        f"alternating, {args.runs} runs each, one benchmark process. Target: at least {TARGET} of curl's",
        "throughput, digest included. Two stricter references beside it: curl followed by",
        "`openssl dgst -sha256` (the same OpenSSL code that Python's hashlib uses), and curl alone.",
        "",
        f"Command: `.venv/bin/python tests/bench/install_throughput.py --size-mb {args.size_mb} --runs {args.runs}`",
        "",
        f"Machine: {machine()}. Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"load average {load:.1f} at the start.",
        "",
        "| run | curl + sha256sum MB/s | curl + openssl MB/s | curl alone MB/s | **stoker MB/s** "
        "| CPU s: curl | sha256sum | openssl | stoker |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in enumerate(rows, 1):
        lines.append(
            f"| {n} | {mbps(r.curl + r.sha256sum):.1f} | {mbps(r.curl + r.openssl):.1f} | {mbps(r.curl):.1f} "
            f"| {mbps(r.stoker):.1f} | {r.curl_cpu:.2f} | {r.sha256sum_cpu:.2f} | {r.openssl_cpu:.2f} "
            f"| {r.stoker_cpu:.2f} |"
        )
    lines.append(
        f"| **median** | **{med['sha']:.1f}** | **{med['ossl']:.1f}** | **{med['curl']:.1f}** "
        f"| **{med['stoker']:.1f}** | {median(lambda r: r.curl_cpu):.2f} | {median(lambda r: r.sha256sum_cpu):.2f} "
        f"| {median(lambda r: r.openssl_cpu):.2f} | {median(lambda r: r.stoker_cpu):.2f} |"
    )
    lines += [
        "",
        f"Median ratio stoker / (curl + sha256sum): **{ratio:.2f}** ({verdict} the {TARGET} target). "
        f"Stoker / (curl + openssl dgst): {ratio_ossl:.2f}. Stoker / curl with no digest at all: "
        f"{ratio_curl:.2f}.",
        "",
        "Reading the figures:",
        "",
        '- Every column but "curl alone" includes the digest; Stoker\'s also includes what curl does '
        "not do: fsync of the file and of its directory before the atomic rename, and starting an "
        "event loop and an HTTP client.",
        "- Stoker hashes while it receives (a worker thread hashes and writes 1 MiB batches while the "
        "event loop reads the socket); the shell pipelines read the file again after the transfer. "
        "coreutils' `sha256sum` is several times slower than OpenSSL on this CPU (compare the CPU "
        "columns), which is why the target's baseline is easy to beat and the openssl column is the "
        "fairer one.",
        "- The CPU columns depend least on the other tenants of the machine. Stoker's CPU time is "
        "curl's, plus one pass of OpenSSL's sha256, plus about as much again for the buffer "
        "copies, the thread hand-offs and the fsync. Wall-clock figures on a shared 2-core machine "
        "swing by 2x from run to run (see the load average), and a process that needs more CPU "
        "suffers more from the contention; the medians are the figures to read.",
        "- What moved the needle: socket reads of 1 MiB instead of httpcore's 64 KiB (about 2x on the "
        "receive path alone: 190 against 420 MB/s; now http.client's `readinto` into reused buffers, "
        "the model pull's reader), hashing and writing on threads of their own, and one TLS context "
        "per process (loading the CA bundle cost 0.1 s per client). The server runs in its own process so that the client does not share a GIL with "
        "it, as it never does with a real CDN (and as curl never did).",
    ]
    if not args.no_write:
        report.write_section(HEADING, "\n".join(lines), args.doc)
        print(f"wrote {HEADING!r} in {args.doc}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
