"""The front door and several models on a real GPU, a stage of verify_gpu.py.

One daemon serves two models at once through the front door: `gpu` on the best backend (CUDA
here) and `cpu`, forced onto the CPU. It checks what a user sees through the one address:
- each model answers by its name (the engine's answer names it);
- `/metrics` tells the truth per model: `gpu` planned and in use on CUDA, accelerated, every
  layer offloaded; `cpu` on the CPU, not accelerated; each figure the one status shows;
- NVML sees VRAM held by the CUDA server's process and none by the CPU one's;
- the CUDA server killed with -9 under a streaming client: every request that had not begun
  streaming is answered (held, then sent to the new server), nothing fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_models_config(model: Path, port: int) -> str:
    from tests.integration.daemon_harness import tiny_config

    return tiny_config(model) + (
        f"[frontdoor]\nport = {port}\n"
        "[placement]\nmax_loaded = 2\n"
        f'[models.gpu]\nmodel = "{model}"\npinned = true\ndefault = true\n'
        f'[models.cpu]\nmodel = "{model}"\nprefer = "cpu"\npinned = true\n'
    )


def metric_samples(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(found: dict, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def st_frontdoor(
    homes: Any, model: Path, scenario: Callable[..., Any], nvml: Callable[[int | None], dict[str, Any]]
) -> dict[str, Any]:
    import httpx

    home = homes.fresh("frontdoor", cpu=True, cuda=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    sc = scenario("frontdoor", home)
    sc.write_config(two_models_config(model, port))
    ev = sc.evidence
    try:
        sc.daemon.start()
        status = sc.daemon.wait_for(
            lambda s: len(s.get("models") or []) == 2 and all(m["state"] == "ready" for m in s["models"]),
            timeout=300,
            what="both models ready",
        )
        models = {m["name"]: m for m in status["models"]}
        ev["models"] = {
            n: {k: m.get(k) for k in ("state", "backend", "planned_backend", "layers", "pid", "reason", "memory")}
            for n, m in models.items()
        }
        answers = {}
        for name in ("gpu", "cpu"):
            reply = httpx.post(
                base + "/v1/completions",
                json={"model": name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
                timeout=120,
                trust_env=False,
            )
            body = reply.json()
            answers[name] = {"status": reply.status_code, "model": body.get("model"), "text": _text(body)}
        ev["answers"] = answers
        found = metric_samples(httpx.get(base + "/metrics", timeout=30, trust_env=False).text)
        ev["metrics"] = {
            f"{name}{dict(labels)}": v
            for (name, labels), v in found.items()
            if name.startswith(("stoker_backend_info", "stoker_accelerated", "stoker_offload", "stoker_server_state"))
            and v
        }
        ev["nvml"] = {n: nvml(m.get("pid")) for n, m in models.items()}
        ev["kill9"] = kill_under_stream(sc.daemon, base, models["gpu"]["pid"])
        after = sc.daemon.call("status")
        ev["after_kill"] = {m["name"]: {"state": m["state"], "backend": m["backend"]} for m in after["models"]}
    finally:
        sc.finish()
    gpu_layers = (models["gpu"].get("layers") or {}) if "models" in ev else {}
    checks = {
        "both ready": set(ev.get("models", {})) == {"gpu", "cpu"},
        "gpu model on cuda (status)": models["gpu"].get("backend") == "cuda",
        "cpu model on cpu (status)": models["cpu"].get("backend") == "cpu",
        "answers name their model": all(a["status"] == 200 and a["model"] == n for n, a in ev["answers"].items()),
        "metrics: gpu planned and in use cuda": metric(
            found, "stoker_backend_info", model="gpu", planned="cuda", in_use="cuda"
        )
        == 1,
        "metrics: cpu in use cpu": metric(found, "stoker_backend_info", model="cpu", planned="cpu", in_use="cpu") == 1,
        "metrics: gpu accelerated": metric(found, "stoker_accelerated", model="gpu") == 1,
        "metrics: cpu not accelerated": metric(found, "stoker_accelerated", model="cpu") == 0,
        "metrics: every layer offloaded": bool(gpu_layers.get("total"))
        and metric(found, "stoker_offloaded_layers", model="gpu") == gpu_layers.get("total"),
        "NVML: the CUDA server holds VRAM": (ev["nvml"]["gpu"].get("process_vram_mib") or 0) > 0,
        "NVML: the CPU server holds none": not (ev["nvml"]["cpu"].get("process_vram_mib") or 0),
        "kill -9: no request failed": ev["kill9"]["failed"] == 0 and ev["kill9"]["sent"] > 0,
        "kill -9: back on cuda": ev["after_kill"].get("gpu", {}).get("backend") == "cuda",
    }
    return {"status": "PASS" if all(checks.values()) else "FAIL", "checks": checks, **ev}


def _text(body: dict[str, Any]) -> str | None:
    choices = body.get("choices") or []
    return choices[0].get("text") if choices else None


def kill_under_stream(daemon: Any, base: str, pid: int) -> dict[str, Any]:
    """Two clients stream through the front door while the CUDA server is killed with -9 twice."""
    import httpx

    stop = threading.Event()
    tally = {"sent": 0, "ok": 0, "cut": 0, "failed": 0, "longest_s": 0.0, "errors": []}
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=120, trust_env=False) as http:
            while not stop.is_set():
                began, started_streaming = time.monotonic(), False
                body = {"model": "gpu", "prompt": "Once upon a time", "max_tokens": 64, "stream": True}
                try:
                    with http.stream("POST", base + "/v1/completions", json=body) as reply:
                        ok = reply.status_code == 200
                        cut = False
                        for line in reply.iter_lines():
                            if line.startswith("data: {") and '"error"' in line:
                                cut = True
                            elif line.startswith("data: "):
                                started_streaming = True
                        outcome = "cut" if cut and started_streaming else ("ok" if ok and not cut else "failed")
                        if outcome == "failed":
                            error = f"{reply.status_code}"
                except httpx.HTTPError as exc:
                    outcome = "cut" if started_streaming else "failed"
                    error = repr(exc)
                with lock:
                    tally["sent"] += 1
                    tally[outcome] += 1
                    tally["longest_s"] = max(tally["longest_s"], round(time.monotonic() - began, 3))
                    if outcome == "failed":
                        tally["errors"].append(error)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    kills = []
    try:
        for _ in range(2):
            time.sleep(1.5)
            os.kill(pid, signal.SIGKILL)
            kills.append(pid)
            status = daemon.wait_for(
                lambda s: any(
                    m["name"] == "gpu" and m["state"] == "ready" and m["pid"] != kills[-1] for m in s["models"]
                ),
                timeout=180,
                what="the gpu model ready again",
            )
            pid = next(m["pid"] for m in status["models"] if m["name"] == "gpu")
        time.sleep(1.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
    return {**tally, "kills": kills, "errors": tally["errors"][:5]}


if __name__ == "__main__":  # a dry look at the config this stage writes
    print(two_models_config(Path("/tmp/model.gguf"), 11436))
    print(json.dumps({"port": free_port()}))
