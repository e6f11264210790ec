"""GPU stages for signed mirrors, engine updates and the engine's memory fitter, called from
tests/gpu/verify_gpu.py (`verify --only mirror speed`):

  mirror   the first run from an empty home served by a signed mirror on loopback HTTP (NVML ->
           binary_missing_nvidia_detected -> signed manifest -> download -> verify -> ready on
           CUDA), the mirror listing a decoy CUDA bundle of another architecture family first;
           then engine updates on that daemon: a release whose server offloads nothing (rolled
           back by itself), a good release (switched, still offloading), `engine rollback`.
  speed    one model of realistic size (tests/bench/bigmodel.py, 8B-shaped F16 layers) served by
           each bundle's own llama-server with the same arguments: CUDA vs Vulkan vs CPU tokens/s
           and prompt tokens/s; then the same model through the daemon on CUDA, in a fresh home: the
           plan's memory (Stoker's upper bound: the model clearly fits, so no fitter runs) at or
           above what the engine reported loading, and the same plan through llama-fit-params on
           the GPU within 5 % of it.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# A release whose server offloads nothing: the real CUDA llama-server, but when it is launched to
# serve (the daemon always passes --metrics; the smoke run does not) it is told -ngl 0 last.
NO_OFFLOAD_WHEN_SERVING = """#!/bin/sh
here=$(dirname "$0")
case " $* " in
  *" --metrics "*) exec "$here/llama-server.real" "$@" -ngl 0 ;;
esac
exec "$here/llama-server.real" "$@"
"""


class MirrorServer:
    """A static web server for a mirror directory on loopback, recording every request."""

    def __init__(self, directory: Path) -> None:
        requests: list[tuple[str, str, int]] = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(directory), **kwargs)

            def log_request(self, code: Any = "-", size: Any = "-") -> None:
                requests.append((self.command, self.path, int(code) if str(code).isdigit() else 0))

            def log_message(self, *args: Any) -> None:
                pass

        self.requests = requests
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _publish(V: Any, mirror: Path, key: Path, zips: list[Path]) -> tuple[int, Any, str]:
    args = ["bundle", "publish", str(mirror), "--key", str(key), "--json"]
    for z in zips:
        args += ["--bundle", str(z)]
    return V.stoker(*args, env=V.base_env(), timeout=300)


def _decoy(work: Path, cuda_meta: Any) -> Path:
    """A small CUDA bundle of the same release built for Turing-Ampere: listed first, it must be
    passed over on a compute capability 9.0 GPU (picked, it would fail its smoke test)."""
    from stoker.daemon.bundles.variants import CUDA_FAMILIES
    from tests.bundlekit import make_bundle_zip

    target = work / "decoy"
    target.mkdir(parents=True, exist_ok=True)
    return make_bundle_zip(
        target,
        "decoy-turing-ampere.zip",
        backend="cuda",
        variant=cuda_meta.variant,
        version=cuda_meta.version,
        cuda_archs=CUDA_FAMILIES["turing-ampere"],
        min_driver=cuda_meta.min_driver,
    )


def _status_json(env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "status", "--json"], env=env, cwd=ROOT, capture_output=True, text=True
    )
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        return {"error": proc.stdout[-2000:] + proc.stderr[-2000:]}
    if isinstance(doc, dict) and doc.get("api_key"):
        doc["api_key"] = "<redacted>"
    return doc


def _wait_ready(V: Any, sc: Any, timeout: float = 240) -> dict[str, Any]:
    return sc.daemon.wait_for(lambda s: V.settled(s), timeout=timeout, what="ready+settled or failed")


def st_mirror(homes: Any, cuda_zip: Path, cpu_zip: Path, model: Path) -> dict[str, Any]:
    from tests.gpu import verify_gpu as V
    from tests.integration.engine_repack import repack

    work = V.WORK / "mirror-stage"
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ev: dict[str, Any] = {}
    old = homes.cuda.meta
    # The two releases of the update part are repacked from the real CUDA zip meanwhile.
    releases: dict[str, Any] = {}

    def make(name: str, version: str, wrapper: str | None) -> None:
        started = time.monotonic()
        try:
            releases[name] = repack(cuda_zip, work / f"{name}.zip", version=version, wrapper=wrapper)
        except Exception as err:
            releases[name] = err
        releases[f"{name}_s"] = round(time.monotonic() - started, 1)

    makers = [
        threading.Thread(target=make, args=("no_offload", f"{old.version}.1", NO_OFFLOAD_WHEN_SERVING)),
        threading.Thread(target=make, args=("good", f"{old.version}.2", None)),
    ]
    for t in makers:
        t.start()

    key = work / "mirror.key"
    rc, doc, err = V.stoker("bundle", "keygen", str(key), "--json", env=V.base_env(), timeout=60)
    public = (key.with_name(key.name + ".pub")).read_text().strip() if rc == 0 else None
    ev["keygen"] = {"rc": rc, "public": public, "stderr": err[-500:]}
    mirror = work / "mirror"
    decoy = _decoy(work, old)
    rc, doc, err = _publish(V, mirror, key, [decoy, cuda_zip, cpu_zip])
    ev["publish_1"] = {"rc": rc, "doc": doc, "stderr": err[-1000:]}
    server = MirrorServer(mirror)
    home = homes.fresh("signed-mirror", cpu=False, cuda=False)
    sc = V.Scenario("signed-mirror", home)
    manifest_url = f"{server.url}/manifest.json"
    sc.write_config(V.config_text(model, manifest=manifest_url) + f'trusted_keys = ["{public}"]\n')
    update: dict[str, Any] = {}
    status: dict[str, Any] = {}
    try:
        status = sc.run(timeout=300)
        ev["fetches"] = list(server.requests)
        ev["install_history"] = V.safe(sc.history, f"install:{old.slot}")
        ev["offload_lines"] = V.grep(sc.server_log(), "offloaded", "using device CUDA0", "CUDA0 model buffer")
        ev["nvml"] = V.nvml_process_vram(status.get("pid"))
        ev["status_json"] = _status_json(sc.daemon.env)
        ev["status_human"] = V.safe(
            lambda: V.sh([sys.executable, "-m", "stoker.daemon", "status"], env=sc.daemon.env, cwd=ROOT).stdout
        )
        ev["first_run_status"] = {k: status.get(k) for k in ("state", "backend", "layers", "engine")}

        for t in makers:
            t.join()
        ev["repacks"] = {k: (str(v) if not isinstance(v, float) else v) for k, v in releases.items()}
        update = _updates(V, sc, mirror, key, releases, old)
    finally:
        ev["fetches"] = list(server.requests)
        server.close()
        sc.finish()
    ev.update(sc.evidence)
    steps = [(e, t, r) for _, e, t, r in ev["fallback_history"]] if isinstance(ev["fallback_history"], list) else []
    zip_sha = V.sha256_of(cuda_zip)
    decoy_sha = V.sha256_of(decoy)
    got = [p for m, p, c in ev["fetches"] if m == "GET" and c == 200]
    installs = ev["install_history"] if isinstance(ev.get("install_history"), list) else []
    layers = status.get("layers") or {}
    installs_json = (ev.get("status_json") or {}).get("installs") or []
    cuda_install = next((i for i in installs_json if i.get("machine") == f"install:{old.slot}"), {})
    checks = {
        "published and signed": ev["publish_1"]["rc"] == 0,
        "ready on cuda from an empty home": status.get("state") == "ready" and status.get("backend") == "cuda",
        "binary_missing_nvidia_detected": ("BundleMissing", "installing", "binary_missing_nvidia_detected") in steps,
        "signed manifest fetched": "/manifest.json" in got,
        "the ada-hopper zip downloaded": f"/bundles/{zip_sha}.zip" in got,
        "the decoy family passed over": f"/bundles/{decoy_sha}.zip" not in got,
        "install machine installed": bool(installs) and installs[-1][2] == "installed",
        "source says the mirror": "mirror" in str(cuda_install.get("source") or ""),
        "all layers offloaded": bool(layers.get("offloaded")) and layers.get("offloaded") == layers.get("total"),
        "server holds VRAM (NVML)": (ev["nvml"].get("process_vram_mib") or 0) > 0,
        **update.pop("checks", {"updates ran": False}),
    }
    return {"status": V.verdict(checks), "checks": checks, **ev, "update": update}


def _engine(V: Any, sc: Any, *args: str) -> tuple[int, Any, str]:
    return V.stoker("engine", *args, "--json", env=sc.daemon.env, timeout=600)


def _updates(V: Any, sc: Any, mirror: Path, key: Path, releases: dict[str, Any], old: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {}
    bad, good = releases.get("no_offload"), releases.get("good")
    if not isinstance(bad, Path) or not isinstance(good, Path):
        return {"checks": {"releases repacked": False}, "repacks": {k: str(v) for k, v in releases.items()}}
    before = sc.daemon.call("status")

    # 1. A release whose server offloads nothing: the update must roll itself back.
    rc, doc, err = _publish(V, mirror, key, [bad])
    ev["publish_no_offload"] = {"rc": rc, "version": (doc or {}).get("version") if isinstance(doc, dict) else None}
    started = time.monotonic()
    rc, doc, err = _engine(V, sc, "update")
    ev["update_no_offload"] = {
        "rc": rc,
        "doc": doc,
        "stderr": err[-1500:],
        "wall_s": round(time.monotonic() - started, 1),
    }
    after_bad = _wait_ready(V, sc)
    ev["after_no_offload"] = {k: after_bad.get(k) for k in ("state", "backend", "layers", "engine", "pid")}
    ev["history_no_offload"] = V.safe(sc.history, f"engine_update:{old.slot}")
    ev["offload_lines_after_rollback"] = V.grep(sc.server_log(), "offloaded")[-4:]

    # 2. A good release: switched, still on CUDA with every layer offloaded.
    rc, doc, err = _publish(V, mirror, key, [good])
    ev["publish_good"] = {"rc": rc, "version": (doc or {}).get("version") if isinstance(doc, dict) else None}
    started = time.monotonic()
    rc, doc, err = _engine(V, sc, "update")
    ev["update_good"] = {"rc": rc, "doc": doc, "stderr": err[-1500:], "wall_s": round(time.monotonic() - started, 1)}
    after_good = _wait_ready(V, sc)
    ev["after_good"] = {k: after_good.get(k) for k in ("state", "backend", "layers", "engine", "pid")}
    ev["nvml_after_good"] = V.nvml_process_vram(after_good.get("pid"))

    # 3. Back by hand.
    rc, doc, err = _engine(V, sc, "rollback")
    ev["rollback"] = {"rc": rc, "doc": doc, "stderr": err[-1500:]}
    after_back = _wait_ready(V, sc)
    ev["after_rollback"] = {k: after_back.get(k) for k in ("state", "backend", "layers", "engine", "pid")}
    ev["history"] = V.safe(sc.history, f"engine_update:{old.slot}")

    def on_cuda_full(st: dict[str, Any]) -> bool:
        lay = st.get("layers") or {}
        return (
            st.get("state") == "ready"
            and st.get("backend") == "cuda"
            and bool(lay.get("offloaded"))
            and (lay.get("offloaded") == lay.get("total"))
        )

    bad_err = ev["update_no_offload"]["doc"] if isinstance(ev["update_no_offload"]["doc"], dict) else {}
    bad_evidence = bad_err.get("evidence") or (bad_err.get("error") or {}).get("evidence") or {}
    engine = lambda st: st.get("engine") or {}  # noqa: E731
    ev["checks"] = {
        "no-offload release refused: rolled back": "engine_update_rolled_back" in json.dumps(bad_err),
        "by the layers gate": bad_evidence.get("gate") == "layers" or '"gate": "layers"' in json.dumps(bad_err),
        "back on the old engine, all layers on CUDA": engine(after_bad).get("version") == old.version
        and on_cuda_full(after_bad),
        "good release switched": ev["update_good"]["rc"] == 0
        and engine(after_good).get("version") == f"{old.version}.2",
        "on the new engine, all layers on CUDA": on_cuda_full(after_good),
        "rollback by hand": ev["rollback"]["rc"] == 0 and engine(after_back).get("version") == old.version,
        "after the rollback, all layers on CUDA": on_cuda_full(after_back),
        "serving engine offloaded before": on_cuda_full(before),
    }
    return ev


# --- speed ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, path: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    import httpx

    reply = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=timeout, trust_env=False)
    reply.raise_for_status()
    return reply.json()


def serve_and_time(
    server: Path, model: Path, log: Path, *, ngl: int, env: dict[str, str], rounds: int, n_predict: int
) -> dict[str, Any]:
    """One bundle's llama-server on `model`: load time, then `rounds` generations of `n_predict`
    tokens after a 256-token prompt; the engine's own timings."""
    import httpx

    port = _free_port()
    threads = str(os.cpu_count() or 4)
    args = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "2048", "-np", "1"]
    args += ["-ngl", str(ngl), "-t", threads, "--seed", "0", "-lv", "4"]
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    out_doc: dict[str, Any] = {"args": args[1:]}
    try:
        while time.monotonic() - started < 300:
            if proc.poll() is not None:
                out_doc["exit"] = proc.returncode
                return out_doc
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        out_doc["ready_s"] = round(time.monotonic() - started, 2)
        prompt = " ".join(["once upon a time there was a little model"] * 6)
        _post(port, "/completion", {"prompt": "hello", "n_predict": 4, "cache_prompt": False})
        rows = []
        for _ in range(rounds):
            body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "temperature": 0}
            body["cache_prompt"] = False
            t = _post(port, "/completion", body)["timings"]
            rows.append(
                {
                    k: round(float(t[k]), 2)
                    for k in ("prompt_n", "prompt_per_second", "predicted_n", "predicted_per_second")
                }
            )
        out_doc["rounds"] = rows
        gen = sorted(r["predicted_per_second"] for r in rows)
        pp = sorted(r["prompt_per_second"] for r in rows)
        out_doc["tok_s_median"] = gen[len(gen) // 2]
        out_doc["prompt_tok_s_median"] = pp[len(pp) // 2]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    lines = log.read_text(errors="replace").splitlines()
    out_doc["log"] = [
        ln for ln in lines if any(n in ln for n in ("offloaded", "using device", "model buffer size", "ggml_vulkan:"))
    ][:12]
    return out_doc


def st_speed(homes: Any, cuda_zip: Path, cpu_zip: Path, vulkan_zip: Path | None, gib: float) -> dict[str, Any]:
    from stoker.daemon.bundles.installed import install_bundle
    from stoker.daemon.core.paths import StokerPaths
    from tests.gpu import verify_gpu as V
    from tests.gpu.engines_stage import vulkan_env

    work = V.WORK / "speed"
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"big-{gib:g}g.gguf"
    ev: dict[str, Any] = {}
    if not model.exists():
        started = time.monotonic()
        V.sh(
            [sys.executable, str(ROOT / "tests/bench/bigmodel.py"), str(model), "--gib", str(gib)],
            timeout=600,
            check=True,
        )
        ev["model_written_s"] = round(time.monotonic() - started, 1)
    ev["model_bytes"] = model.stat().st_size
    arms: dict[str, Any] = {}
    plain = V.base_env()
    arms["cuda"] = serve_and_time(
        homes.cuda.root / homes.cuda.meta.server, model, work / "cuda.log", ngl=999, env=plain, rounds=5, n_predict=128
    )
    if vulkan_zip is not None:
        vk_home = StokerPaths.from_env({"STOKER_HOME": str(work / "vk-home")})
        vk = install_bundle(vulkan_zip, vk_home, expect_backend="vulkan")
        env = V.base_env(**vulkan_env(V.WORK, V.CARRY))
        arms["vulkan"] = serve_and_time(
            vk.root / vk.meta.server, model, work / "vulkan.log", ngl=999, env=env, rounds=5, n_predict=128
        )
    arms["cpu"] = serve_and_time(
        homes.cpu.root / homes.cpu.meta.server, model, work / "cpu.log", ngl=0, env=plain, rounds=3, n_predict=16
    )
    ev["arms"] = arms
    cuda = arms["cuda"].get("tok_s_median") or 0
    ev["ratios"] = {
        name: round((arm.get("tok_s_median") or 0) / cuda, 3) if cuda else None for name, arm in arms.items()
    }

    # The same model through the daemon on CUDA: which estimate answered, and what the engine loaded.
    home = homes.fresh("fitter-cuda", cpu=True, cuda=True)
    sc = V.Scenario("fitter-cuda", home)
    sc.write_config(V.config_text(model, prefer="cuda"))
    status: dict[str, Any] = {}
    try:
        status = sc.run(timeout=300)
        ev["daemon_status"] = _status_json(sc.daemon.env)
        ev["nvml"] = V.nvml_process_vram(status.get("pid"))
        ev["buffers"] = V.grep(
            sc.server_log(), "model buffer size", "KV buffer size", "compute buffer size", "offloaded"
        )
        ev["fitter"] = fitter_of_plan(sc.daemon, homes.cuda)
    finally:
        sc.finish()
    memory = _find(ev.get("daemon_status"), "memory") or {}  # the model's: models[0].memory
    estimate, placed = memory.get("estimate") or {}, memory.get("placed") or {}
    ev["estimate"], ev["placed"] = estimate, placed
    fitter = ev.get("fitter") or {}
    layers = status.get("layers") or {}
    checks = {
        "cuda served": bool(cuda),
        "cpu served": bool(arms["cpu"].get("tok_s_median")),
        "vulkan served": vulkan_zip is None or bool(arms.get("vulkan", {}).get("tok_s_median")),
        "daemon ready on cuda, all layers": status.get("state") == "ready"
        and status.get("backend") == "cuda"
        and bool(layers.get("offloaded"))
        and layers.get("offloaded") == layers.get("total"),
        "the plan's estimate is Stoker's upper bound (no fitter run)": estimate.get("source") == "stoker-bound"
        and "upper bound" in str(estimate.get("detail")),
        "the bound at or above what the engine loaded": placed.get("reading") == "engine"
        and (estimate.get("vram_mib") or 0) >= (placed.get("vram_mib") or 0) > 0,
        "the same plan through llama-fit-params": fitter.get("source") == "llama-fit-params",
        "its VRAM within 5 % of what the engine loaded": bool(fitter.get("vram_mib"))
        and placed.get("reading") == "engine"
        and abs(fitter["vram_mib"] - (placed.get("vram_mib") or 0)) <= 0.05 * fitter["vram_mib"],
    }
    return {"status": V.verdict(checks), "checks": checks, **ev}


def fitter_of_plan(daemon: Any, bundle: Any) -> dict[str, Any] | None:
    """The CUDA plan the daemon ran (its launch history), through the bundle's llama-fit-params
    (no reading given: it fits to the free VRAM it reads), as status shows an estimate."""
    from stoker.daemon.fallback.memory import estimate_json, estimate_memory
    from stoker.states.convert import structure
    from stoker.states.launch.records import LaunchPlan

    rows = sorted(daemon.history(machine="launch", limit=200), key=lambda r: r["id"])
    plans = [(r.get("event_data") or {}).get("plan") or {} for r in rows if r["event"] == "PlanReady"]
    cuda = [p for p in plans if p.get("backend") == "cuda"]
    return estimate_json(estimate_memory(structure(cuda[-1], LaunchPlan), bundle)) if cuda else None


def _find(doc: Any, key: str) -> Any:
    """The first value under `key` anywhere in a JSON document."""
    if isinstance(doc, dict):
        if key in doc and doc[key]:
            return doc[key]
        for value in doc.values():
            found = _find(value, key)
            if found:
                return found
    elif isinstance(doc, list):
        for value in doc:
            found = _find(value, key)
            if found:
                return found
    return None
