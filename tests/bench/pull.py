"""Pull throughput from the loopback Hub against curl of the same file.

    .venv/bin/python tests/bench/pull.py [--gib 3] [--runs 5] [--dir DIR] [--tree LABEL=PATH ...] [--no-write]

A multi-GB GGUF (tests/bench/bigmodel.py: 8B-shaped F16 layers, a seeded pool of values rolled
per tensor, so no run of repeated or sparse blocks) is served by the fake Hub
(tests/integration/model_sources.py: the Hub's API, the 302 to its "CDN", Range requests) in a
process of its own, over real loopback sockets, from an mmap of the file (in the page cache: the
server hashes it once at start). In each round, taking turns going first:

- curl: `curl -sS -L --fail -o FILE URL` of the file's resolve URL on the Hub (the redirect
  followed to the CDN, as huggingface_hub does); then, timed apart, the file's fsync (what
  Stoker does before it renames a pull into place; curl never does);
- stoker: `python -m daemon pull ORG/REPO:F16 --json` in a fresh STOKER_HOME with HF_ENDPOINT
  at the fake Hub and no daemon (the CLI runs the pull service itself: resolve through the Hub's
  API, download into the partial file with its sha256, fsync, the GGUF header, the rename, the
  catalog row). Timed as the whole command; its download phase is also timed from its --json
  progress lines (the first 'downloading' line to the one with every byte).

`--tree LABEL=PATH` adds an arm per source tree (e.g. a git worktree of an older commit): its
`python -m daemon pull` runs with that tree first on sys.path, so before and after are measured
in one run, on one machine state. Every written file is deleted after its arm (its dirty pages
with it), so each arm starts from the same page cache. Medians of the per-round ratios are the
figures to read on a shared machine. Results: docs/benchmarks.md "Pull throughput".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.report import machine, write_section  # noqa: E402

REPO = "stoker-bench/big-GGUF"
FILE = "big-F16.gguf"
SECTION = "Pull throughput"
TARGET = 0.8


def serve(path: Path) -> None:
    """The server process: the fake Hub serving `path` (mmap'd) until stdin closes."""
    from tests.integration.model_sources import FakeHub, HubRepo, _sha1, sha256

    with open(path, "rb") as fh:
        blob = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    digest, _ = sha256(blob), _sha1(blob)  # hashed once, here (the hub memoizes big blobs)
    hub = FakeHub({REPO: HubRepo({FILE: blob})}).start()  # type: ignore[dict-item]
    print(json.dumps({"endpoint": hub.endpoint, "sha256": digest, "size": len(blob)}), flush=True)
    sys.stdin.read()
    hub.stop()


def ensure_model(directory: Path, gib: float) -> Path:
    from tests.bench.bigmodel import write_big_model

    path = directory / f"big-{gib:g}g.gguf"
    marker = path.with_suffix(".done")
    if not (path.exists() and marker.exists()):
        started = time.perf_counter()
        write_big_model(path, gib)
        marker.write_text(str(path.stat().st_size))
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s")
    return path


def cpu_of_children() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


def run_curl(url: str, dest: Path) -> dict[str, float]:
    dest.unlink(missing_ok=True)
    cpu = cpu_of_children()
    started = time.perf_counter()
    subprocess.run(["curl", "-sS", "-L", "--fail", "-o", str(dest), url], check=True)
    wall = time.perf_counter() - started
    cpu = cpu_of_children() - cpu
    started = time.perf_counter()
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync = time.perf_counter() - started
    # What verifying those bytes alone takes here: one sha256 over the file, read from the page
    # cache in 1 MiB blocks (hashlib: OpenSSL's, with the CPU's SHA instructions). One stream
    # cannot be hashed in parallel, so no verifying pull can be faster than this.
    started = time.perf_counter()
    digest = hashlib.sha256()
    with open(dest, "rb", buffering=0) as fh:
        block = bytearray(1 << 20)
        view = memoryview(block)
        while got := fh.readinto(block):
            digest.update(view[:got])
    sha256 = time.perf_counter() - started
    size = dest.stat().st_size
    dest.unlink()
    return {"wall": wall, "fsync": fsync, "sha256": sha256, "size": size, "cpu": cpu}


def run_pull(tree: Path, home: Path, endpoint: str, sha: str) -> dict[str, float]:
    shutil.rmtree(home, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "PIP_INDEX_URL")}
    env.update(STOKER_HOME=str(home), HF_ENDPOINT=endpoint, HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(tree))
    cpu = cpu_of_children()
    started = time.perf_counter()
    first = done = None
    result: dict[str, Any] = {}
    with subprocess.Popen(
        [sys.executable, "-m", "stoker.daemon", "pull", f"{REPO}:F16", "--json"],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter()
            event = json.loads(line)
            progress = event.get("progress")
            if progress is None:
                result = event
                continue
            if progress.get("phase") == "downloading":
                first = first or now
                if progress.get("bytes_done") == progress.get("total"):
                    done = done or now
    wall = time.perf_counter() - started
    cpu = cpu_of_children() - cpu
    if proc.returncode != 0 or not result.get("ok"):
        raise SystemExit(f"stoker pull failed (exit {proc.returncode}): {result}")
    model = result["model"]
    if model["sha256"] != sha:
        raise SystemExit(f"stoker pull cataloged sha256 {model['sha256']}, the Hub states {sha}")
    size = model["size"]
    shutil.rmtree(home, ignore_errors=True)
    download = (done - first) if first and done else float("nan")
    return {"wall": wall, "download": download, "size": size, "cpu": cpu}


def mbps(size: float, seconds: float) -> float:
    return size / seconds / 1e6 if seconds > 0 else float("nan")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--gib", type=float, default=3.0, help="the model's size (at least 2 for a meaningful run)")
    ap.add_argument("--runs", type=int, default=5, help="rounds (each arm once per round)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/stoker-pullbench"), help="the model and the downloads")
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH: another source tree's pull, one more arm")
    ap.add_argument("--no-write", action="store_true", help="print the section, do not write docs/benchmarks.md")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return 0

    args.dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model(args.dir, args.gib)
    trees = [("stoker", ROOT)] + [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(model)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and server.stdin is not None
    hello = json.loads(server.stdout.readline())
    endpoint, sha, size = hello["endpoint"], hello["sha256"], hello["size"]
    url = f"{endpoint}/{REPO}/resolve/main/{FILE}"
    load_start = os.getloadavg()[0]
    arms = ["curl"] + [label for label, _ in trees]
    rows: list[dict[str, dict[str, float]]] = []
    try:
        for i in range(args.runs):
            order = arms[i % len(arms) :] + arms[: i % len(arms)]
            row: dict[str, dict[str, float]] = {}
            for arm in order:
                time.sleep(1.0)  # let the writeback of the last arm's (deleted) file settle
                if arm == "curl":
                    row[arm] = run_curl(url, args.dir / "curl.out")
                else:
                    tree = dict(trees)[arm]
                    row[arm] = run_pull(tree, args.dir / f"home-{arm}", endpoint, sha)
                assert row[arm]["size"] == size, (arm, row[arm]["size"], size)
            rows.append(row)
            print(
                f"round {i + 1} ({' '.join(order)}): curl {mbps(size, row['curl']['wall']):.0f} MB/s "
                f"(+fsync {mbps(size, row['curl']['wall'] + row['curl']['fsync']):.0f})"
                + "".join(
                    f", {label} {mbps(size, row[label]['wall']):.0f} MB/s "
                    f"(download {mbps(size, row[label]['download']):.0f}) = "
                    f"{row['curl']['wall'] / row[label]['wall']:.2f} of curl"
                    for label, _ in trees
                ),
                flush=True,
            )
    finally:
        server.stdin.close()
        server.wait(timeout=30)
        (args.dir / "curl.out").unlink(missing_ok=True)
    load_end = os.getloadavg()[0]
    body = report(rows, trees, size, args, load_start, load_end)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)
    return 0


def report(
    rows: list[dict[str, dict[str, float]]],
    trees: list[tuple[str, Path]],
    size: int,
    args: argparse.Namespace,
    load_start: float,
    load_end: float,
) -> str:
    labels = [label for label, _ in trees]
    extra = "".join(f" --tree {label}=..." for label in labels[1:])
    lines = [
        f"`.venv/bin/python tests/bench/pull.py --gib {args.gib:g} --runs {args.runs}{extra}` on {machine()}; "
        f"{subprocess.run(['curl', '--version'], capture_output=True, text=True).stdout.split(' (')[0]}. "
        f"The file: {size / 2**30:.2f} GiB ({size} bytes), served by the fake Hub in its own process from the page "
        f"cache, over loopback. Load average {load_start:.1f} at the start, {load_end:.1f} at the end "
        "(a shared machine: the ratios, medians of per-round ratios, are the figures to read).",
        "",
        "| round | curl -o MB/s | curl -o + fsync MB/s | sha256 alone MB/s | "
        + " | ".join(f"{label} pull MB/s (download phase) | {label} / curl" for label in labels)
        + " |",
        "|---:|---:|---:|---:|" + "---:|---:|" * len(labels),
    ]
    for i, row in enumerate(rows, 1):
        curl = row["curl"]
        cells = [
            f"{i}",
            f"{mbps(size, curl['wall']):.0f}",
            f"{mbps(size, curl['wall'] + curl['fsync']):.0f}",
            f"{mbps(size, curl['sha256']):.0f}",
        ]
        for label in labels:
            cells += [
                f"{mbps(size, row[label]['wall']):.0f} ({mbps(size, row[label]['download']):.0f})",
                f"{curl['wall'] / row[label]['wall']:.2f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    med = ["**median**"]
    med.append(f"**{median([mbps(size, r['curl']['wall']) for r in rows]):.0f}**")
    med.append(f"**{median([mbps(size, r['curl']['wall'] + r['curl']['fsync']) for r in rows]):.0f}**")
    med.append(f"**{median([mbps(size, r['curl']['sha256']) for r in rows]):.0f}**")
    for label in labels:
        med.append(
            f"**{median([mbps(size, r[label]['wall']) for r in rows]):.0f}** "
            f"({median([mbps(size, r[label]['download']) for r in rows]):.0f})"
        )
        med.append(f"**{median([r['curl']['wall'] / r[label]['wall'] for r in rows]):.2f}**")
    lines.append("| " + " | ".join(med) + " |")
    lines.append("")
    floor = median([r["curl"]["wall"] / r["curl"]["sha256"] for r in rows])
    lines.append(
        f"- The ceiling of any pull that verifies its sha256 as it downloads, here: `curl -o`'s time against "
        f"hashing the same bytes alone (one stream, one core, nothing else running) **{floor:.2f}**; "
        f"`curl -o` followed by that hash, against `curl -o`: "
        f"{median([r['curl']['wall'] / (r['curl']['wall'] + r['curl']['sha256']) for r in rows]):.2f}."
    )
    for label in labels:
        ratio = median([r["curl"]["wall"] / r[label]["wall"] for r in rows])
        synced = median([(r["curl"]["wall"] + r["curl"]["fsync"]) / r[label]["wall"] for r in rows])
        download = median([r["curl"]["wall"] / r[label]["download"] for r in rows])
        cpu = median([r[label]["cpu"] / (size / 2**30) for r in rows])
        verdict = "PASS" if ratio >= TARGET else "MISS"
        verified = median([(r["curl"]["wall"] + r["curl"]["sha256"]) / r[label]["wall"] for r in rows])
        lines.append(
            f"- {label}: the whole `pull` against `curl -o` **{ratio:.2f}** (target >= {TARGET}: {verdict}); "
            f"against curl -o + fsync {synced:.2f}; against curl -o + its sha256 {verified:.2f}; "
            f"its download phase alone against curl -o {download:.2f}; "
            f"CPU {cpu:.2f} s per GiB (curl {median([r['curl']['cpu'] / (size / 2**30) for r in rows]):.2f})."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
