"""The stoker.backends entry points: built-ins load, a broken plugin is recorded, not fatal."""

from __future__ import annotations

import json
import re
from importlib import metadata

import pytest

from stoker.daemon.backends import BUILTIN, Backend, Detection, Device, discover_backends, load_backend, load_backends
from stoker.daemon.backends.registry import load_target
from stoker.states.reasons import ReasonCode as R

GROUP = "stoker.backends"


class RpcBackend(Backend):
    """What a third-party plugin looks like (say, llama.cpp RPC workers)."""

    name = "rpc"
    device_signature = re.compile(r"^\s+(RPC\[[^\]]+\]): (.+) \((\d+) MiB, (\d+) MiB free\)$")
    reason_codes = frozenset({R.PROBE_FAILED})

    def detect(self) -> Detection:
        return Detection.available(self.name, [Device(0, "rpc://10.0.0.2:50052")], "one worker")

    def choose_variant(self, detection, available_variants):
        return "default"


class ExplodingBackend(RpcBackend):
    name = "exploding"

    def __init__(self) -> None:
        raise RuntimeError("vendor SDK not initialised")


def ep(name: str, value: str) -> metadata.EntryPoint:
    return metadata.EntryPoint(name=name, value=value, group=GROUP)


def test_the_five_builtins_are_registered():
    backends = load_backends()
    assert set(BUILTIN) <= set(backends)
    for name in BUILTIN:
        b = backends[name]
        assert isinstance(b, Backend) and b.name == name
        assert b.unavailable_reason in b.reason_codes
        assert set(b.reason_family.values()) <= b.reason_codes
    assert R.GPU_MISSING in backends["cuda"].reason_codes
    assert R.CPU_ILLEGAL_INSTRUCTION in backends["cpu"].reason_codes


def test_a_broken_plugin_is_recorded_and_the_rest_load():
    points = [
        ep("cpu", "stoker.daemon.backends.cpu:CpuBackend"),
        ep("rpc", "test_backends_registry:RpcBackend"),
        ep("missing", "no_such_module_for_stoker:Backend"),
        ep("exploding", "test_backends_registry:ExplodingBackend"),
        ep("notabackend", "builtins:object"),
        ep("gpu", "stoker.daemon.backends.cuda:CudaBackend"),  # calls itself "cuda"
    ]
    registry = discover_backends(points)
    assert sorted(registry.backends) == ["cpu", "rpc"]
    failures = {f.name: f for f in registry.failures}
    assert sorted(failures) == ["exploding", "gpu", "missing", "notabackend"]
    assert "ModuleNotFoundError" in failures["missing"].error
    assert "vendor SDK not initialised" in failures["exploding"].error
    assert "RuntimeError" in failures["exploding"].traceback
    assert "is not a backend: missing name, detect" in failures["notabackend"].error
    assert "calls itself 'cuda'" in failures["gpu"].error
    assert json.dumps([f.to_dict() for f in registry.failures])
    assert sorted(load_backends(points)) == ["cpu", "rpc"]


def test_duplicate_names_keep_the_first_and_record_the_second():
    registry = discover_backends([ep("rpc", "test_backends_registry:RpcBackend")] * 2)
    assert list(registry.backends) == ["rpc"]
    assert "duplicate" in registry.failures[0].error


def test_load_one_backend_without_importing_the_others():
    points = [ep("missing", "no_such_module_for_stoker:Backend"), ep("rpc", "test_backends_registry:RpcBackend")]
    assert load_backend("rpc", points).name == "rpc"
    with pytest.raises(LookupError):
        load_backend("nope", points)
    assert load_target("rpc", "test_backends_registry:RpcBackend").detect().usable


def test_plugin_list_devices_signature():
    listed = RpcBackend().parse_list_devices("  RPC[10.0.0.2:50052]: RPC0 (24000 MiB, 23000 MiB free)\n")
    assert listed[0].name == "RPC[10.0.0.2:50052]" and listed[0].memory_free_mib == 23000


def test_builtin_targets_are_the_entry_points():
    """A probe child loads a built-in straight from BUILTIN_TARGETS (no entry-point scan):
    the map must say exactly what pyproject.toml registers."""
    import sys
    from pathlib import Path

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    from stoker.daemon.backends.registry import BUILTIN, BUILTIN_TARGETS

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert BUILTIN_TARGETS == project["entry-points"]["stoker.backends"]
    assert tuple(BUILTIN_TARGETS) == BUILTIN
