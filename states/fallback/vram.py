"""Room on the GPUs (pure): from one free-VRAM reading, whether any GPU can take a layer and
which GPUs a server gets.

The fallback orchestrator reads free VRAM at the moment of a GPU check (daemon/fallback/vram.py:
through the plugin, the probe's figures only where that fails) and hands the reading here with
its check (`CheckPassed.vram`); the fallback table decides from it:

- no GPU has room for a single layer (with `-ngl auto`): the backend is skipped with its
  vram_full code instead of a server that fits for seconds, offloads nothing and holds its
  runtime's VRAM (`vram_full`);
- only some GPUs have room: the server gets those (`devices_for_plan`; the others would each
  lose ~520 MiB of VRAM to its runtime for nothing).

Room for a layer: the engine's fit (`-ngl auto`) keeps `margin` MiB free on each device after
its runtime has taken its own share (`Backend.runtime_reserve_mib`: 524 MiB for CUDA, measured
on an H200 where NVML said 1499 MiB free, the engine saw 975 MiB and offloaded 0 layers). A
device with less free than reserve + margin gets no layer. A fixed layer count is not fitted:
the engine loads what it is told, so nothing here decides for it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import attrs

from stoker.states.launch.records import GpuLayers
from stoker.states.reasons import ReasonCode

READ_NOW = "read now"
PROBE = "probe"


def _pairs(value: Mapping[int, Any] | Iterable[tuple[int, Any]]) -> tuple[tuple[int, Any], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((int(k), v) for k, v in items))


@attrs.frozen
class FreeVram:
    """Free VRAM per GPU (MiB, by the detection's device index) as one reading saw it."""

    mib: tuple[tuple[int, int], ...] = attrs.field(converter=_pairs)
    names: tuple[tuple[int, str], ...] = attrs.field(default=(), converter=_pairs)
    source: str = READ_NOW  # READ_NOW, or PROBE when the reading failed

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(index for index, _ in self.mib)

    def label(self, index: int) -> str:
        """'0: NVIDIA H200' (the index alone where the name is unknown)."""
        name = dict(self.names).get(index)
        return f"{index}: {name}" if name else str(index)

    def by_label(self, indices: Iterable[int] | None = None) -> dict[str, int]:
        """{label: MiB} for `indices` (all by default), in index order."""
        wanted = None if indices is None else set(indices)
        return {self.label(i): mib for i, mib in self.mib if wanted is None or i in wanted}

    def listed(self, indices: Iterable[int] | None = None) -> str:
        """'0: NVIDIA H200 699 MiB, 1: NVIDIA H200 139.8 GiB'."""
        return ", ".join(f"{label} {mib_text(mib)}" for label, mib in self.by_label(indices).items())

    def evidence(self) -> dict[str, Any]:
        """The reading as evidence: free MiB by device index, and where it came from."""
        return {"free_vram_mib": {str(i): mib for i, mib in self.mib}, "free_vram_source": self.source}


def mib_text(value: float | None) -> str:
    """1331 -> '1331 MiB', 143150 -> '139.8 GiB': MiB, as NVML and -fitt count, below 10 GiB."""
    if value is None:
        return "?"
    return f"{value / 1024:.1f} GiB" if value >= 10240 else f"{value:.0f} MiB"


@attrs.frozen
class VramCheck:
    """What a GPU check read and what fitting a layer takes there: the reading (None: nothing
    could be read), the margin the engine keeps (-fitt), the runtime's own share per GPU, the
    layers asked for, and the backend's vram_full code (None: it declares none, so the engine
    is left to fit)."""

    free: FreeVram | None
    margin_mib: int
    reserve_mib: int
    layers: GpuLayers
    full_reason: ReasonCode | None = None


def layer_room(free: FreeVram, margin_mib: int, reserve_mib: int) -> tuple[int, ...]:
    """The GPUs with room for at least one layer under the engine's fit: more free than the
    runtime's share plus the margin the engine keeps."""
    return tuple(index for index, mib in free.mib if mib >= reserve_mib + margin_mib)


def devices_for_plan(free: FreeVram | None, margin_mib: int, reserve_mib: int, layers: GpuLayers) -> tuple[int, ...]:
    """The GPUs to give the server when only some can take a layer; () for all of them (every
    one has room, none has, the count is fixed, or nothing was read)."""
    if layers != "auto" or free is None:
        return ()
    room = layer_room(free, margin_mib, reserve_mib)
    return room if 0 < len(room) < len(free.mib) else ()


def vram_full(
    backend: str, reason: ReasonCode | None, free: FreeVram | None, margin_mib: int, reserve_mib: int, layers: GpuLayers
) -> tuple[ReasonCode, dict[str, Any]] | None:
    """(`reason`, evidence) if no GPU has room for a layer under `-ngl auto`, else None.
    `reason` is the backend's vram_full code; a backend that declares none is left to the
    engine, as is a fixed layer count (the engine loads as told)."""
    if layers != "auto" or reason is None or free is None or not free.mib:
        return None
    if layer_room(free, margin_mib, reserve_mib):
        return None
    listed = free.listed()
    need = (
        f"the {reserve_mib} MiB its runtime takes plus the {margin_mib} MiB the engine keeps free (-fitt)"
        if reserve_mib
        else f"the {margin_mib} MiB the engine keeps free (-fitt)"
    )
    best = max(mib for _, mib in free.mib) - reserve_mib
    lower = ""
    if best > 256:
        lower = f', or lower the margin below {best} MiB: [server] extra_args = ["-fitt", "256"]'
    elif best > 0:
        # Measured on an H200 with 699 MiB free: a margin this small is real room for a small
        # model, and little for serving; say both rather than claim there is none.
        lower = (
            f", or lower the margin below {best} MiB (little left for serving): "
            f'[server] extra_args = ["-fitt", "{best // 2}"]'
        )
    elif reserve_mib:
        lower = f" (no margin leaves room: the runtime alone takes {reserve_mib} MiB of the {best + reserve_mib})"
    return reason, {
        **free.evidence(),
        "margin_mib": margin_mib,
        "runtime_reserve_mib": reserve_mib,
        "message": f"No {backend} GPU has room for a layer: free VRAM ({free.source}) {listed}, less than "
        f"{need}, so no {backend} server was started.",
        "hint": f"free VRAM held by other processes{lower}",
    }


def no_room(backend: str, check: VramCheck) -> tuple[ReasonCode, dict[str, Any]] | None:
    """`vram_full` for one check's reading: why the backend is skipped, or None."""
    return vram_full(backend, check.full_reason, check.free, check.margin_mib, check.reserve_mib, check.layers)


def devices_of(check: VramCheck) -> tuple[int, ...]:
    """`devices_for_plan` for one check's reading."""
    return devices_for_plan(check.free, check.margin_mib, check.reserve_mib, check.layers)
