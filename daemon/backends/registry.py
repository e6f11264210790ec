"""Finding backends: the `stoker.backends` entry-point group, a broken plugin isolated.

An entry point names a Backend subclass (or any zero-argument factory returning one):

    [project.entry-points."stoker.backends"]
    rpc = "stoker_rpc:RpcBackend"

A plugin that fails to import, to construct, or to look like a backend is recorded as a
`PluginFailure` and left out; the other backends load as usual. Loading a plugin registers
the reason codes it brings (`Backend.reason_messages`), so that every process that loads it
(the daemon, a probe child, `stoker bundle verify`) reads and stores them like Stoker's own.

This module also answers the core's questions about the loaded set: the order auto mode
tries them in (`try_order`, and a preference's candidates: `candidates_for`), a backend's code for a fallback step (`family_reason`), and
which names a config may prefer without importing any plugin (`registered_names`).
"""

from __future__ import annotations

import importlib
import logging
import traceback
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import attrs

from stoker.daemon.backends.base import Backend, ReasonKind
from stoker.states.reasons import ReasonCode, register_reasons

if TYPE_CHECKING:
    from importlib import metadata

GROUP = "stoker.backends"
BUILTIN = ("cpu", "cuda", "rocm", "vulkan", "metal")
# The built-ins' entry points (pyproject.toml; a test keeps the two equal). A built-in always
# wins over a plugin of the same name, so a probe child can load one straight from here and
# skip scanning every installed distribution's entry points (~0.1 s per probe).
BUILTIN_TARGETS = {
    "cpu": "stoker.daemon.backends.cpu:CpuBackend",
    "cuda": "stoker.daemon.backends.cuda:CudaBackend",
    "rocm": "stoker.daemon.backends.rocm:RocmBackend",
    "vulkan": "stoker.daemon.backends.vulkan:VulkanBackend",
    "metal": "stoker.daemon.backends.metal:MetalBackend",
}
_REQUIRED = ("name", "detect", "choose_variant", "device_signature", "launch_args", "check_bundle", "reason")

log = logging.getLogger(__name__)


@attrs.frozen
class PluginFailure:
    """A backend plugin that could not be loaded, and why."""

    name: str
    target: str  # the entry point's value, "module:attr"
    error: str
    traceback: str = ""

    def to_dict(self) -> dict[str, str]:
        return attrs.asdict(self)


@attrs.frozen
class BackendRegistry:
    backends: Mapping[str, Backend]
    failures: tuple[PluginFailure, ...] = ()


def _entry_points(group: str) -> list[metadata.EntryPoint]:
    from importlib import metadata

    return list(metadata.entry_points(group=group))


def instantiate(name: str, target: str, loaded: Any) -> Backend:
    """Turn what an entry point loaded into a checked backend instance (raises on misfit)."""
    backend = loaded() if isinstance(loaded, type) or (callable(loaded) and not hasattr(loaded, "detect")) else loaded
    missing = [attr for attr in _REQUIRED if not hasattr(backend, attr)]
    if missing:
        raise TypeError(f"{target} is not a backend: missing {', '.join(missing)}")
    if backend.name != name:
        raise ValueError(f"{target} calls itself {backend.name!r} but is registered as {name!r}")
    register_plugin_reasons(backend)
    return backend


def register_plugin_reasons(backend: Backend) -> None:
    """Register the codes a backend brings, after checking every code it names is known.

    Raises ValueError (the plugin is then not loaded, and nothing of it registered) for a
    family kind that is not a `ReasonKind`, or a code that is neither Stoker's nor declared
    with its sentence in `reason_messages`."""
    own = dict(getattr(backend, "reason_messages", None) or {})
    family = dict(getattr(backend, "reason_family", None) or {})
    for kind in family:
        try:
            ReasonKind(kind)
        except ValueError:
            raise ValueError(
                f"{backend.name}: reason_family names {kind!r}, not one of {[k.value for k in ReasonKind]}"
            ) from None
    for code in [*family.values(), *(getattr(backend, "reason_codes", None) or ())]:
        if code in own:
            continue
        try:
            ReasonCode(code)
        except ValueError:
            raise ValueError(
                f"{backend.name}: reason code {code!r} is neither Stoker's nor declared in "
                f"reason_messages with its sentence"
            ) from None
    register_reasons(backend.name, own)


def load_target(name: str, target: str) -> Backend:
    """Load one backend from a "module:attr" reference (tests and `probe_child --target`)."""
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return instantiate(name, target, obj)


def discover_backends(entry_points: Iterable[metadata.EntryPoint] | None = None) -> BackendRegistry:
    """Every registered backend, plus a record of each plugin that failed to load."""
    points = _entry_points(GROUP) if entry_points is None else list(entry_points)
    # Built-ins (from the stoker distribution) first, so a plugin cannot shadow one.
    points.sort(key=lambda ep: (getattr(getattr(ep, "dist", None), "name", None) != "stoker", ep.name))
    backends: dict[str, Backend] = {}
    failures: list[PluginFailure] = []
    for ep in points:
        if ep.name in backends:
            failures.append(PluginFailure(ep.name, ep.value, f"duplicate backend name; kept {backends[ep.name]!r}"))
            continue
        try:
            backends[ep.name] = instantiate(ep.name, ep.value, ep.load())
        except Exception as e:  # a third party's bug must not stop the daemon
            failures.append(PluginFailure(ep.name, ep.value, f"{type(e).__name__}: {e}", traceback.format_exc(limit=5)))
    for failure in failures:
        log.warning("backend plugin %s (%s) not loaded: %s", failure.name, failure.target, failure.error)
    return BackendRegistry(backends, tuple(failures))


def load_backends(entry_points: Iterable[metadata.EntryPoint] | None = None) -> dict[str, Backend]:
    """The backends that loaded, by name; failures are logged (see `discover_backends`)."""
    return dict(discover_backends(entry_points).backends)


def load_backend(name: str, entry_points: Iterable[metadata.EntryPoint] | None = None) -> Backend:
    """Load just one backend by name (the probe child: other plugins are never imported).

    A built-in is loaded straight from its module: it always wins over a plugin of its name,
    so the scan of every distribution's entry points is skipped."""
    if entry_points is None and name in BUILTIN_TARGETS:
        return load_target(name, BUILTIN_TARGETS[name])
    points = _entry_points(GROUP) if entry_points is None else list(entry_points)
    matches = [ep for ep in points if ep.name == name]
    if not matches:
        raise LookupError(f"no backend named {name!r} is registered under {GROUP!r}")
    matches.sort(key=lambda ep: getattr(getattr(ep, "dist", None), "name", None) != "stoker")
    return instantiate(name, matches[0].value, matches[0].load())


def try_order(backends: Mapping[str, Backend]) -> tuple[str, ...]:
    """The names in the order auto mode tries them: by each backend's `auto_rank`, then name."""
    return tuple(sorted(backends, key=lambda name: (backends[name].auto_rank, name)))


def candidates_for(prefer: str, backends: Mapping[str, Backend]) -> tuple[tuple[str, ...], bool]:
    """(backends to try in order, forced). Anything but "auto" is forced: exactly that one;
    auto tries every loaded backend in the order they declare (`auto_rank`: the CPU last)."""
    if prefer != "auto":
        return (prefer,), True
    return try_order(backends), False


def family_reason(backends: Mapping[str, Backend], name: str, kind: ReasonKind, default: ReasonCode) -> ReasonCode:
    """Backend `name`'s code for a fallback step, or `default` where it declares none or is not loaded."""
    backend = backends.get(name)
    code = None if backend is None else backend.reason(kind)
    return default if code is None else code


def registered_names(entry_points: Iterable[metadata.EntryPoint] | None = None) -> tuple[str, ...]:
    """Every backend name registered under the entry-point group, built-ins first, without
    importing any plugin (config validation asks this: a cheap, side-effect-free read)."""
    points = _entry_points(GROUP) if entry_points is None else list(entry_points)
    others = sorted({ep.name for ep in points} - set(BUILTIN))
    return (*BUILTIN, *others)
