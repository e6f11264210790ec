"""Serve now, upgrade beside, on a real GPU: an empty home, an empty build cache but for the
engine's pinned source, no mirror. The daemon must answer on the CPU as soon as its CPU engine
is built (the CUDA engine building beside it, for this GPU's architecture only), then switch to
CUDA when that build is installed, holding requests and carrying the conversation across.

    tests/gpu/run.sh upgrade [--timeout 1500]

A client sends a chat request as the daemon starts and again whenever the last one was
answered (a 503 while nothing serves is retried after its Retry-After, as a script would);
every answer is timed from the daemon's start, with the backend status named at that moment.
Status is sampled every 0.5 s for the timeline: the state, the backend in use and planned, the
fallback reason, and each install's progress. Figures in $OUT/upgrade.json:

- first_answer_s: the first 200, against cpu_build_s (the CPU engine's build, from its install
  history) plus the load: goal, within the CPU build plus a load;
- cuda_answer_s: the first 200 while status says CUDA is in use, against the CUDA build's own
  seconds (`gpu_engine_built` evidence) plus the switch: goal, within the single-architecture
  build plus a switch;
- the built bundles are copied to $STOKER_GPU_WORK/carried-{cpu,cuda}.zip, so the benchmarks
  that follow in the same lease use them instead of building again.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx


def run(work: Path, out: Path, carry: Path, timeout: float, seed_builds: Path | None = None) -> dict[str, Any]:
    """The scenario; `seed_builds`: a build cache whose entries are copied in first (a dry run
    of this script on a machine where building would take too long)."""
    from stoker.daemon.bundles.tinymodel import write_tiny_model
    from stoker.daemon.core.digests import sha256_file
    from tests.integration.daemon_harness import DaemonProcess, free_port, tiny_config, write_config

    home, cache = work / "homes" / "upgrade", work / "cache-upgrade"
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    for sdist in sorted((carry / "src").glob("*.tar.gz")):  # the source "reachable": in the cache
        target = cache / "sources" / "downloads" / f"{sha256_file(sdist)}.tar.gz"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sdist, target)
    if seed_builds is not None:
        shutil.copytree(seed_builds, cache / "builds", dirs_exist_ok=True)
    tiny = write_tiny_model(work / "tiny.gguf")
    d = DaemonProcess(home, env={"STOKER_CACHE_DIR": str(cache)})
    d.env.pop("CUDA_VISIBLE_DEVICES", None)
    port = free_port()
    write_config(
        d.paths,
        tiny_config(tiny, snapshots=True, ctx_size=2048, ready_timeout_s=300.0)
        + f"[frontdoor]\nport = {port}\nhold_timeout_s = 60\n",
    )
    base = f"http://127.0.0.1:{port}/v1"
    answers: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []
    latest: dict[str, Any] = {}
    stop = threading.Event()
    started = time.monotonic()

    def client() -> None:
        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        while not stop.is_set():
            sent = time.monotonic() - started
            try:
                r = httpx.post(f"{base}/chat/completions", json=body, timeout=900, trust_env=False)
            except httpx.HTTPError as err:
                answers.append({"sent_s": round(sent, 2), "error": repr(err)[:200]})
                time.sleep(0.5)
                continue
            at = time.monotonic() - started
            answers.append(
                {
                    "sent_s": round(sent, 2),
                    "at_s": round(at, 2),
                    "status": r.status_code,
                    "backend": latest.get("backend"),
                    "state": latest.get("state"),
                    "code": None if r.status_code == 200 else r.text[:300],
                }
            )
            if r.status_code != 200:
                time.sleep(min(float(r.headers.get("retry-after") or 1), 5))
            else:
                time.sleep(1.0)

    d.start()
    sender = threading.Thread(target=client, daemon=True)
    sender.start()
    cuda_serving_at = None
    try:
        while time.monotonic() - started < timeout:
            try:
                st = d.call("status")
            except Exception as err:  # the socket may be busy: sampled again
                timeline.append({"t": round(time.monotonic() - started, 2), "error": repr(err)[:200]})
                time.sleep(0.5)
                continue
            latest.clear()
            latest.update(st)
            sample = {
                "t": round(time.monotonic() - started, 2),
                "state": st.get("state"),
                "backend": st.get("backend"),
                "planned": st.get("planned_backend"),
                "reason": st.get("fallback_reason"),
                "installs": [
                    {k: i.get(k) for k in ("backend", "variant", "state")}
                    | {"percent": (i.get("progress") or {}).get("percent")}
                    for i in st.get("installs") or []
                ],
            }
            if not timeline or {**timeline[-1], "t": sample["t"]} != sample:  # a change: kept
                timeline.append(sample)
                print(json.dumps(sample), flush=True)
            if st.get("state") == "ready" and st.get("backend") == "cuda" and cuda_serving_at is None:
                cuda_serving_at = sample["t"]
            if cuda_serving_at is not None and any(
                a.get("status") == 200 and a.get("backend") == "cuda" for a in answers
            ):
                break
            time.sleep(0.5)
        history = d.history(limit=400)
        final = d.call("status")
    finally:
        stop.set()
        d.stop()
    first = next((a for a in answers if a.get("status") == 200), None)
    on_cuda = next((a for a in answers if a.get("status") == 200 and a.get("backend") == "cuda"), None)
    builds = built_bundles(cache)
    for kind, zip_path in builds.items():
        shutil.copyfile(zip_path, work / f"carried-{kind}.zip")
    events = [
        {k: r.get(k) for k in ("machine_id", "from_state", "event", "to_state", "reason", "evidence", "at")}
        for r in reversed(history)
    ]
    cpu_build_s = build_seconds(events, "cpu")
    cuda_build_s = next(
        (e["evidence"].get("seconds") for e in events if e["event"] == "EngineBuilt" and e.get("evidence")), None
    )
    result = {
        "first_answer_s": first and first["at_s"],
        "first_answer_backend": first and first["backend"],
        "cuda_serving_s": cuda_serving_at,
        "cuda_answer_s": on_cuda and on_cuda["at_s"],
        "cpu_build_s": cpu_build_s,
        "cuda_build_s": cuda_build_s,
        "bundles": {k: str(v) for k, v in builds.items()},
        "bundle_meta": {k: json.loads((v.parent / "bundle.json").read_text()) for k, v in builds.items()},
        "answers": answers,
        "timeline": timeline,
        "history": events,
        "final_status": {k: final.get(k) for k in ("state", "backend", "planned_backend", "fallback_reason")},
        "snapshots": final.get("snapshots"),
        "daemon_log_tail": d.log_text()[-6000:],
    }
    (out / "upgrade.json").write_text(json.dumps(result, indent=2, default=str))
    summary = {
        k: result[k] for k in ("first_answer_s", "cuda_serving_s", "cuda_answer_s", "cpu_build_s", "cuda_build_s")
    }
    print(json.dumps(summary, indent=2), flush=True)
    return result


def built_bundles(cache: Path) -> dict[str, Path]:
    """The bundle zips the daemon's builds left in its cache, by backend."""
    found: dict[str, Path] = {}
    for meta in sorted(cache.glob("builds/*/bundle.json")):
        try:
            backend = json.loads(meta.read_text())["backend"]
        except (ValueError, KeyError):
            continue
        if (meta.parent / "bundle.zip").is_file():
            found[backend] = meta.parent / "bundle.zip"
    return found


def build_seconds(events: list[dict[str, Any]], backend: str) -> float | None:
    """A build's own seconds, from the install history's evidence (`build_seconds`)."""
    for e in events:
        ev = e.get("evidence") or {}
        if backend in str(e.get("machine_id", "")) and ev.get("build_seconds") is not None:
            return ev["build_seconds"]
    return None
