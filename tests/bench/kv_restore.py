"""KV restore against a cold prefill on Gemma 3 270M, through the daemon, in one run.

    .venv/bin/python tests/bench/kv_restore.py [--lengths 512,1024,2048,4096,8192] [--ctx 8704]

One daemon on a temporary STOKER_HOME serves Gemma 3 270M with snapshots on (so Stoker adds
--swa-full itself). For each prompt length, in the same run and on the same server:
1. cold: the slot is erased, then one completion (n_predict 1) prefills the whole prompt;
2. `snapshot.save` through the daemon; the file is then read once from disk (a plain read);
3. warm: the slot is erased again, then the engine's own restore plus the same completion,
   and Stoker's full restore (identity, size and sha256 checks, then the engine) plus it.
The first token must be identical in every path, and the warm completion must have
processed at most a token or two. Results: docs/benchmarks.md "KV restore", docs/kv-restore.svg.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.model_files import model_file  # noqa: E402
from stoker.daemon.core.paths import StokerPaths  # noqa: E402
from tests.bench.report import engine_bundle, machine, write_section  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config  # noqa: E402

WORDS = (
    "the river engine kernel slot cache model token server window ready bundle prefill restore "
    "memory thread socket config quiet amber lantern orbit meadow copper signal harbor"
).split()
SVG = ROOT / "docs" / "kv-restore.svg"


class Engine:
    def __init__(self, status: dict) -> None:
        self.url = status["endpoint"]
        self.client = httpx.Client(
            timeout=900, trust_env=False, headers={"Authorization": f"Bearer {status['api_key']}"}
        )

    def post(self, path: str, body: dict) -> dict:
        resp = self.client.post(self.url + path, json=body)
        resp.raise_for_status()
        return resp.json()

    def first_token(self, tokens: list[int]) -> tuple[int, dict]:
        out = self.post(
            "/completion",
            {
                "prompt": tokens,
                "n_predict": 1,
                "temperature": 0,
                "cache_prompt": True,
                "return_tokens": True,
                "id_slot": 0,
            },
        )
        return out["tokens"][0], out["timings"]


def text_tokens(eng: Engine, n: int) -> list[int]:
    rng = random.Random(42)
    words = " ".join(rng.choice(WORDS) for _ in range(n * 2))
    tokens = eng.post("/tokenize", {"content": words})["tokens"]
    assert len(tokens) >= n, (len(tokens), n)
    return tokens[:n]


def long_call(d: DaemonProcess, method: str, **params):
    """A socket call that may take minutes (a 16 GiB snapshot on a GPU host)."""
    with d.client(timeout=900) as client:
        return client.call(method, **params)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def evict(path: Path) -> None:
    """Drop one file's pages from the page cache (nothing else's)."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_file(path: Path) -> int:
    with open(path, "rb", buffering=0) as fh:
        total = 0
        while chunk := fh.read(1 << 20):
            total += len(chunk)
    return total


def cli_restore(d: DaemonProcess, snapshot_id: int) -> tuple[float, dict]:
    """`stoker snapshot restore ID --json` as a user runs it: its wall time from spawn to exit
    (Python's start included) and its reply (the daemon's side: `daemon_ms`, `decision`)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "snapshot", "restore", str(snapshot_id), "--json"],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stdout + done.stderr
    return wall, json.loads(done.stdout)


def python_start_s() -> float:
    """What starting this Python and importing the CLI's entry costs, with nothing else done."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import stoker.daemon.cli"], check=True, timeout=120)
    return time.perf_counter() - start


def measure(d: DaemonProcess, eng: Engine, n: int, repeats: int) -> dict:
    tokens = text_tokens(eng, n)
    eng.post("/slots/0?action=erase", {})
    cold_s, (tok_cold, t_cold) = timed(lambda: eng.first_token(tokens))
    assert t_cold["prompt_n"] >= n - 1, t_cold
    save_s, saved = timed(lambda: long_call(d, "snapshot.save")["saved"][0])
    path = d.paths.snapshots_dir / saved["filename"]
    runs: dict[str, list[float]] = {
        k: []
        for k in (
            "read_s",
            "restore_s",
            "restore_engine_ms",
            "first_s",
            "stoker_restore_s",
            "stoker_first_s",
            "read_disk_s",
            "restore_disk_s",
            "stoker_restore_disk_s",
            "cli_restore_s",
            "cli_first_s",
            "cli_daemon_ms",
            "python_start_s",
        )
    }
    decision: dict = {}
    # The warm paths are cheap: repeated, and the median taken (the machine is shared).
    for _ in range(repeats):
        # From disk: this file's pages are dropped from the page cache first (only this file's).
        evict(path)
        runs["read_disk_s"].append(timed(lambda: read_file(path))[0])
        eng.post("/slots/0?action=erase", {})
        evict(path)
        runs["restore_disk_s"].append(
            timed(lambda: eng.post("/slots/0?action=restore", {"filename": saved["filename"]}))[0]
        )
        eng.post("/slots/0?action=erase", {})
        evict(path)
        runs["stoker_restore_disk_s"].append(timed(lambda: long_call(d, "snapshot.restore", id=saved["id"]))[0])
        # From the page cache (where a file saved just before a restart is).
        read_s, size = timed(lambda: read_file(path))
        runs["read_s"].append(read_s)
        # The engine's restore alone, then the first token.
        eng.post("/slots/0?action=erase", {})
        restore_s, body = timed(lambda: eng.post("/slots/0?action=restore", {"filename": saved["filename"]}))
        first_s, (tok_engine, t_engine) = timed(lambda: eng.first_token(tokens))
        runs["restore_s"].append(restore_s)
        runs["restore_engine_ms"].append(body["timings"]["restore_ms"])
        runs["first_s"].append(first_s)
        # Stoker's restore (identity, then the file's size, inode, mtime and head/tail digest, then
        # the engine), then the first token.
        eng.post("/slots/0?action=erase", {})
        stoker_s, _ = timed(lambda: long_call(d, "snapshot.restore", id=saved["id"]))
        stoker_first_s, (tok_stoker, t_stoker) = timed(lambda: eng.first_token(tokens))
        runs["stoker_restore_s"].append(stoker_s)
        runs["stoker_first_s"].append(stoker_first_s)
        # `stoker snapshot restore` from a shell (page cache): the whole command, then the first token.
        eng.post("/slots/0?action=erase", {})
        cli_s, reply = cli_restore(d, saved["id"])
        cli_first_s, (tok_cli, t_cli) = timed(lambda: eng.first_token(tokens))
        runs["cli_restore_s"].append(cli_s)
        runs["cli_first_s"].append(cli_first_s)
        runs["cli_daemon_ms"].append(reply["daemon_ms"])
        runs["python_start_s"].append(python_start_s())
        decision = reply.get("decision") or {}
        assert tok_cold == tok_engine == tok_stoker == tok_cli, (tok_cold, tok_engine, tok_stoker, tok_cli)
        assert t_engine["prompt_n"] <= 2 and t_stoker["prompt_n"] <= 2 and t_cli["prompt_n"] <= 2, (t_engine, t_cli)
    row = {k: statistics.median(v) for k, v in runs.items()}
    row.update(tokens=n, cold_s=cold_s, size=size, save_ms=saved["save_ms"], save_s=save_s)
    row["warm_s"] = row["restore_s"] + row["first_s"]
    row["stoker_warm_s"] = row["stoker_restore_s"] + row["stoker_first_s"]
    row["cli_warm_s"] = row["cli_restore_s"] + row["cli_first_s"]
    row["cli_vs_cold"] = row["cli_warm_s"] / cold_s
    row["restore_s_est"] = decision.get("restore_s_est")
    row["prefill_s_est"] = decision.get("prefill_s_est")
    row["choice"] = decision.get("choice")
    row["ratio"] = cold_s / row["warm_s"]
    row["stoker_ratio"] = cold_s / row["stoker_warm_s"]
    row["restore_vs_read"] = row["restore_s"] / row["read_s"]
    row["restore_vs_read_disk"] = row["restore_disk_s"] / row["read_disk_s"]
    row["stoker_vs_engine"] = row["stoker_restore_s"] / row["restore_s"]
    row["stoker_vs_engine_disk"] = row["stoker_restore_disk_s"] / row["restore_disk_s"]
    return row


def decisions(d: DaemonProcess, rows: list[dict], backend: str) -> str:
    """What Stoker's policy chooses for each conversation with the figures this daemon measured
    (its own prefill lines and restores), from the page cache and from disk; the time of the
    path chosen against the better of the two measured paths."""
    import sqlite3

    from stoker.daemon.snapshots.figures import prefill_name, restore_name, restore_wall_name
    from stoker.states.snapshots.policy import (
        Figure,
        RestoreInputs,
        decide_restore,
        prefill_band,
        prefill_rate,
        restore_fit,
    )

    with sqlite3.connect(d.paths.db_file) as db:
        figures = {name: Figure(v, n) for name, v, n in db.execute("select name, value, samples from snapshot_figures")}
        model_id = db.execute("select model_id from snapshots order by id desc limit 1").fetchone()[0]
    prefix = prefill_name(backend, model_id, "")
    bands = {k[len(prefix) :]: f for k, f in figures.items() if k.startswith(prefix)}

    def fit(where: str):
        wall = restore_wall_name(backend, where)
        return restore_fit({k[len(wall) :]: f for k, f in figures.items() if k.startswith(wall)})

    out = [
        "| prompt tokens | where | prefill figure (tok/s) | restore figure (MB/s) | choice | chosen path | better measured path | chosen / better |",
        "|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        for where, resident, restore_path in (
            ("page cache", 1.0, r["stoker_warm_s"]),
            ("disk", 0.0, r["stoker_restore_disk_s"] + r["stoker_first_s"]),
        ):
            rate = restore_name(backend, "cache" if resident else "disk")
            inputs = RestoreInputs(
                n_tokens=r["tokens"],
                file_bytes=r["size"],
                resident=resident,
                prefill_tok_s=prefill_rate(r["tokens"], bands),
                restore_cache_mb_s=figures.get(restore_name(backend, "cache")),
                restore_disk_mb_s=figures.get(restore_name(backend, "disk")),
                restore_cache_fit=fit("cache"),
                restore_disk_fit=fit("disk"),
            )
            choice = decide_restore(inputs).choice
            chosen = restore_path if choice == "restore" else r["cold_s"]
            better = min(restore_path, r["cold_s"])
            pf = inputs.prefill_tok_s
            rf = figures.get(rate)
            shown = "-" if pf is None else f"{pf.value:.0f} (band {prefill_band(r['tokens'])})"
            out.append(
                f"| {r['tokens']} | {where} | {shown} | "
                f"{'-' if rf is None else f'{rf.value:.0f}'} | {choice} | {chosen * 1000:.1f} ms | {better * 1000:.1f} ms | "
                f"{chosen / better:.2f} |"
            )
    return "\n".join(out)


def stoker_table(rows: list[dict]) -> str:
    out = [
        "| prompt tokens | snapshot | engine save (save_ms) | Stoker save (socket call) | engine restore (cache) | Stoker restore (cache) | Stoker / engine | engine restore (disk) | Stoker restore (disk) | Stoker / engine |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['tokens']} | {r['size'] / 2**20:.1f} MiB | {r['save_ms']:.0f} ms | {r['save_s'] * 1000:.0f} ms | "
            f"{r['restore_s'] * 1000:.1f} ms | {r['stoker_restore_s'] * 1000:.1f} ms | **{r['stoker_vs_engine']:.2f}** | "
            f"{r['restore_disk_s'] * 1000:.1f} ms | {r['stoker_restore_disk_s'] * 1000:.1f} ms | "
            f"**{r['stoker_vs_engine_disk']:.2f}** |"
        )
    return "\n".join(out)


def cli_table(rows: list[dict]) -> str:
    """`stoker snapshot restore` from a shell against a re-prefill, side by side."""
    out = [
        "| prompt tokens | cold prefill + 1st token | `stoker snapshot restore` (wall, Python start included) + 1st token | CLI / cold | of it: Python start (bare `import stoker.daemon.cli`) | daemon's side (`daemon_ms`) | daemon's estimates: restore / re-prefill | daemon's choice |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        est = (
            "-"
            if r["restore_s_est"] is None or r["prefill_s_est"] is None
            else f"{r['restore_s_est'] * 1000:.1f} ms / {r['prefill_s_est'] * 1000:.0f} ms"
        )
        out.append(
            f"| {r['tokens']} | {r['cold_s'] * 1000:.0f} ms | {r['cli_warm_s'] * 1000:.0f} ms | "
            f"**{r['cli_vs_cold']:.3f}** | {r['python_start_s'] * 1000:.0f} ms | {r['cli_daemon_ms']:.1f} ms | {est} | "
            f"{r['choice'] or '-'} |"
        )
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    out = [
        "| prompt tokens | cold prefill + 1st token | restore + 1st token | ratio | Stoker restore (checks) + 1st token | ratio | snapshot | save | read file (cache) | restore request (cache; engine's own) | restore / read (cache) | read file (disk) | restore (disk) | restore / read (disk) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['tokens']} | {r['cold_s'] * 1000:.0f} ms | {r['warm_s'] * 1000:.1f} ms | **{r['ratio']:.0f}x** | "
            f"{r['stoker_warm_s'] * 1000:.1f} ms | {r['stoker_ratio']:.0f}x | {r['size'] / 2**20:.1f} MiB | "
            f"{r['save_ms']:.0f} ms | {r['read_s'] * 1000:.1f} ms | {r['restore_s'] * 1000:.1f} ms "
            f"({r['restore_engine_ms']:.1f} ms) | {r['restore_vs_read']:.2f} | {r['read_disk_s'] * 1000:.1f} ms | "
            f"{r['restore_disk_s'] * 1000:.1f} ms | {r['restore_vs_read_disk']:.2f} |"
        )
    return "\n".join(out)


def svg(rows: list[dict]) -> str:
    """A log-scale chart of cold prefill against restore + first token, written by hand."""
    import math

    w, h, left, right, top, bottom = 640, 360, 70, 20, 40, 50
    lo, hi = -3, 2  # 1 ms .. 100 s
    xs = {r["tokens"]: left + i * (w - left - right) / max(1, len(rows) - 1) for i, r in enumerate(rows)}

    def y(seconds: float) -> float:
        v = min(max(math.log10(max(seconds, 1e-3)), lo), hi)
        return top + (hi - v) / (hi - lo) * (h - top - bottom)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">Gemma 3 270M, CPU: cold prefill vs KV restore (+ first token)</text>',
    ]
    for e in range(lo, hi + 1):
        yy = y(10.0**e)
        label = f"{10.0**e * 1000:g} ms" if e < 0 else f"{10.0**e:g} s"
        parts += [
            f'<line x1="{left}" x2="{w - right}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#ddd"/>',
            f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end">{label}</text>',
        ]
    for n, x in xs.items():
        parts.append(f'<text x="{x:.1f}" y="{h - bottom + 18}" text-anchor="middle">{n}</text>')
    parts.append(f'<text x="{w / 2}" y="{h - 10}" text-anchor="middle">prompt tokens</text>')
    for key, colour, name in (
        ("cold_s", "#c0392b", "cold prefill"),
        ("warm_s", "#2471a3", "restore + first token"),
        ("stoker_warm_s", "#27ae60", "Stoker restore (checks) + first token"),
    ):
        pts = " ".join(f"{xs[r['tokens']]:.1f},{y(r[key]):.1f}" for r in rows)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts += [f'<circle cx="{xs[r["tokens"]]:.1f}" cy="{y(r[key]):.1f}" r="3" fill="{colour}"/>' for r in rows]
    for i, (colour, name) in enumerate(
        (
            ("#c0392b", "cold prefill"),
            ("#2471a3", "engine restore + first token"),
            ("#27ae60", "Stoker restore (checks) + first token"),
        )
    ):
        yy = top + 10 + i * 16
        parts += [
            f'<line x1="{left + 10}" x2="{left + 30}" y1="{yy}" y2="{yy}" stroke="{colour}" stroke-width="2"/>',
            f'<text x="{left + 36}" y="{yy + 4}">{name}</text>',
        ]
    for r in rows:
        parts.append(
            f'<text x="{xs[r["tokens"]]:.1f}" y="{y(r["warm_s"]) + 16:.1f}" text-anchor="middle" '
            f'fill="#2471a3">{r["ratio"]:.0f}x</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--ctx", type=int, default=8704)
    parser.add_argument("--repeats", type=int, default=5, help="warm-path repeats (median)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    parser.add_argument("--model", default="gemma3-270m", help="a model name or GGUF path")
    parser.add_argument("--big-gib", type=float, default=None, help="write and use an 8B-shaped F16 model of N GiB")
    parser.add_argument("--bundle", type=Path, default=None, help="an engine bundle zip (default: build the CPU one)")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kv-bench-") as tmp:
        home = Path(tmp)
        os.environ["STOKER_HOME"] = str(home)
        paths = StokerPaths.from_env()
        bundle = engine_bundle(paths, args.bundle)
        if args.big_gib:
            from tests.bench.bigmodel import big_model

            model = big_model(args.big_gib, ctx=args.ctx)
        else:
            model = model_file(args.model, paths)
        d = DaemonProcess(home)
        write_config(
            d.paths, tiny_config(model, snapshots=True, ctx_size=args.ctx, stall_timeout_s=120.0, ready_timeout_s=600.0)
        )
        d.start()
        try:
            st = d.wait_state("ready", timeout=600)
            snap = st["snapshots"]
            assert snap["benefit"], snap
            eng = Engine(st)
            rows = []
            for n in lengths:
                row = measure(d, eng, n, args.repeats)
                rows.append(row)
                print(
                    f"{n:>6} tokens: cold {row['cold_s']:.3f} s, restore+first {row['warm_s'] * 1000:.1f} ms "
                    f"-> {row['ratio']:.0f}x (Stoker path {row['stoker_ratio']:.0f}x); restore/read "
                    f"{row['restore_vs_read']:.2f} (from disk {row['restore_vs_read_disk']:.2f}); "
                    f"`stoker snapshot restore` + first {row['cli_warm_s'] * 1000:.0f} ms = "
                    f"{row['cli_vs_cold']:.3f} of the cold prefill (Python start {row['python_start_s'] * 1000:.0f} ms, "
                    f"daemon {row['cli_daemon_ms']:.1f} ms)",
                    flush=True,
                )
        finally:
            d.stop()
        decision_table = decisions(d, rows, bundle.meta.backend)
    backend = bundle.meta.backend
    body = (
        f"`.venv/bin/python tests/bench/kv_restore.py {' '.join(sys.argv[1:])}` on {machine()}; engine "
        f"{bundle.meta.version} ({backend}); {model.name}, one slot, ctx {args.ctx}"
        + (
            f', `--swa-full` (added by Stoker: snapshots on, swa_full = "auto"); KV with --swa-full '
            f"{snap.get('kv_mib_with_swa_full')} MiB, without {snap.get('kv_mib_without_swa_full')} MiB"
            if snap.get("swa_full")
            else ""
        )
        + f"; {snap.get('kv_bytes_per_token')} bytes of KV per token.\n\n"
        "Per length, on one server in one run: the slot erased and the prompt prefilled cold (first token); "
        f"`stoker snapshot save`; then, {args.repeats} times (medians shown): the file read with a plain read and "
        "restored by the engine, each first from disk (this file's pages dropped with posix_fadvise) then from the "
        "page cache; the "
        "slot erased, restored by the engine and the same completion asked again (it processes one token); the "
        "same with Stoker's restore (`stoker snapshot restore`: identity, then the file's size, inode, mtime and a "
        "digest of its head and tail, then the engine; socket round trip included), from the page cache and from "
        "disk. The first token is identical on every path. The machine is shared with other work: load average "
        f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.\n\n"
        + table(rows)
        + "\n\n![KV restore](kv-restore.svg)\n\n"
        "### Stoker's save and restore against the engine's\n\n"
        "The save's fsync and full sha256 now run after the socket call returns (in the background); a restore "
        'reads 128 KiB of the file besides the engine\'s own read (docs/snapshots.md, "What a restore checks").\n\n'
        + stoker_table(rows)
        + "\n\n### `stoker snapshot restore` from a shell against a re-prefill\n\n"
        "The command as a user runs it (`stoker snapshot restore ID --json`, a fresh Python each time, from the "
        "page cache), wall time from spawn to exit plus the first token, against the cold prefill; a bare "
        "`python -c 'import stoker.daemon.cli'` beside it says what Python's start alone costs, and the reply's "
        "`daemon_ms` what the restore took on the daemon's side (its checks and the engine's restore), with the "
        "estimates the daemon's figures make for both paths (`--if-faster` lets the daemon choose by them).\n\n"
        + cli_table(rows)
        + "\n\n### Restore or re-prefill\n\n"
        "What Stoker's policy (states/snapshots/policy.py) chooses for each conversation with the figures the daemon "
        "measured during this run (its prefill figures from the engine's own `prompt eval time` lines, its restore "
        "figures from its restores, by page-cache residency), and the time of the chosen path (Stoker's restore + "
        "first token, or the cold prefill) against the better of the two measured paths.\n\n" + decision_table + "\n"
    )
    if not args.no_write:
        write_section(
            "KV restore" if backend == "cpu" and not args.big_gib else f"KV restore ({backend}, {model.name})", body
        )
        if backend == "cpu" and not args.big_gib:
            SVG.write_text(svg(rows))
    print(body)
    at = {r["tokens"]: r for r in rows}
    if 4096 in at:
        print(
            f"4096 tokens: {at[4096]['ratio']:.0f}x (target >= 200x); restore/read "
            f"{at[4096]['restore_vs_read']:.2f} from the page cache, {at[4096]['restore_vs_read_disk']:.2f} "
            f"from disk (target <= 2)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
