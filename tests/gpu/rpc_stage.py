"""RPC workers on two GPUs: one `stoker worker` per H200 (rpc-server on CUDA0 / CUDA1), a head
daemon on the CPU bundle with both as `[[workers]]`, the tiny model split across them.

    python3 tests/gpu/rpc_stage.py CUDA_ZIP CPU_ZIP OUT_JSON

Checks: the placement confirmed from the engine's own `RPCn[host:port] model buffer` lines, each
worker's rpc-server holding memory on its own GPU (nvidia-smi's per-process list), and the greedy
tokens of the split equal to the head's local CPU run. Each worker and the head keep their logs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Each worker's [worker] lines; STOKER_RPC_STAGE_CPU=1 runs the script on CPU workers (a dry run).
WORKER_EXTRA = 'backend = "cuda"\ndevices = ["CUDA{i}"]\n'
if __import__("os").environ.get("STOKER_RPC_STAGE_CPU"):
    WORKER_EXTRA = 'backend = "cpu"\n'

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def gpu_processes() -> list[dict[str, Any]]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory,gpu_uuid", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout
    uuids = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout
    index = {u.strip(): int(i) for i, u in (line.split(",") for line in uuids.strip().splitlines())}
    rows = []
    for line in out.strip().splitlines():
        pid, mib, uuid = (p.strip() for p in line.split(","))
        rows.append({"pid": int(pid), "mib": int(mib), "gpu": index.get(uuid)})
    return rows


def main(cuda_zip: Path, cpu_zip: Path, out_json: Path) -> int:
    from stoker.daemon.bundles.installed import install_bundle
    from stoker.daemon.bundles.tinymodel import write_tiny_model
    from stoker.daemon.core.paths import StokerPaths
    from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config
    from tests.integration.rpc_workers import WorkerProcess, complete, workers_config

    work = Path("/tmp/stoker-rpc")
    work.mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(work / "tiny.gguf")
    ev: dict[str, Any] = {}
    workers = [WorkerProcess(work / f"worker{i}", cuda_zip, extra=WORKER_EXTRA.format(i=i)) for i in (0, 1)]
    head_home = work / "head"
    install_bundle(cpu_zip, StokerPaths.from_env({"STOKER_HOME": str(head_home)}))
    head = DaemonProcess(head_home)
    status: dict[str, Any] = {}
    try:
        for w in workers:
            w.start()
        ev["rpc_server_pids"] = [w.wait_serving(timeout=90) for w in workers]
        write_config(head.paths, tiny_config(model) + '[backend]\nprefer = "cpu"\n')
        head.start()
        local_status = head.wait_state("ready", 120)
        t0 = time.monotonic()
        ev["local_tokens"] = complete(local_status, n=64)
        ev["local_s"] = round(time.monotonic() - t0, 3)
        write_config(
            head.paths,
            workers_config(tiny_config(model) + '[backend]\nprefer = "cpu"\n', *(w.address for w in workers)),
        )
        status = head.wait_for(
            lambda s: s["state"] == "ready" and (s.get("workers") or {}).get("confirmed") is True,
            180,
            "the split placement confirmed",
        )
        t0 = time.monotonic()
        ev["split_tokens"] = complete(status, n=64)
        ev["split_s"] = round(time.monotonic() - t0, 3)
        ev["placement"] = status.get("workers")
        ev["gpu_processes"] = gpu_processes()
        ev["status_human"] = subprocess.run(
            [sys.executable, "-m", "stoker.daemon", "status"], env=head.env, cwd=ROOT, capture_output=True, text=True
        ).stdout
        log = (head.paths.logs_dir / "llama-server.log").read_text(errors="replace")
        ev["rpc_lines"] = [
            line for line in log.splitlines() if "RPC" in line and ("buffer" in line or "offloaded" in line)
        ][-12:]
    except Exception as err:  # the evidence so far is the result
        ev["error"] = f"{type(err).__name__}: {err}"
    finally:
        head.stop()
        for w in workers:
            ev.setdefault("worker_logs", []).append(w.text()[-3000:])
            w.stop()
    pids = ev.get("rpc_server_pids") or []
    on_gpu = {row["pid"]: row for row in ev.get("gpu_processes") or []}
    placement = ev.get("placement") or {}
    checks = {
        "both workers serving on CUDA": len(pids) == 2,
        "placement confirmed from the engine's log": placement.get("confirmed") is True,
        "both workers used": len(placement.get("used") or []) == 2,
        "worker 0's rpc-server holds memory on GPU 0": bool(pids) and on_gpu.get(pids[0], {}).get("gpu") == 0,
        "worker 1's rpc-server holds memory on GPU 1": len(pids) > 1 and on_gpu.get(pids[1], {}).get("gpu") == 1,
        "split tokens == local CPU tokens": bool(ev.get("split_tokens"))
        and ev.get("split_tokens") == ev.get("local_tokens"),
    }
    result = {"status": "PASS" if all(checks.values()) else "FAIL", "checks": checks, **ev}
    out_json.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({"status": result["status"], "checks": checks, "error": ev.get("error")}, indent=2))
    return 0 if result["status"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
