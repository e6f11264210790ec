"""When the engine's fitter (llama-fit-params) must run for a plan, and when its answer is reused (pure).

The fitter answers two questions (daemon/engine/fit.py): what a server with given arguments
would hold (its projection: a function of the program, the model file and the arguments alone),
and, for `-ngl auto` on a GPU, which arguments fit the free device memory now (its fit: the
same, plus the free memory it reads). Each run starts the GPU runtime (0.4-0.5 s with CUDA on
an H200), so an answer is kept (daemon/engine/fit.py `FitCache`, in memory and in a file under
the daemon's data dir, so a restarted daemon has it too) by what decides it:

- a projection by `projection_key`: the fitter's identity (path, size, mtime: a new bundle
  is another fitter), the model's (path, size and content id, the one snapshots use: a file
  whose bytes changed is another model; one only touched is not), the arguments and the
  environment;
- a fit by `fit_key`: the same, plus the free memory of each device rounded down to
  `FREE_BAND_MIB` (another process taking or freeing a band's worth fits anew).

And one plan runs the fitter once where the engine would not fit anything: the projection of
the plan's own arguments (every layer on the GPU for `-ngl auto`) is asked first, and when it
leaves every device the engine's margin and its runtime's share (`fits_whole`), that is the
answer: the engine's own fit at start would change nothing, so no fit is run. Only a plan that
does not fit whole runs the fit (and projects what it fitted). A plan that fits with room to
spare is not even projected: Stoker's own upper bound places it (memory_bound.py).
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping, Sequence

import attrs

# Free memory is compared in bands of this many MiB: a reading a few MiB off the last one (the
# driver's own allocations move) reuses the fit; a band's worth taken or freed fits anew.
FREE_BAND_MIB = 512


@attrs.frozen
class FileId:
    """A file as the fitter's answer depends on it: where, how big, and which version: the
    model's content id where known (daemon/models/identity.py: its header and sampled blocks,
    so a file touched or copied over with the same bytes keeps its answers), else its mtime."""

    path: str
    size: int
    version: str


def free_bands(free_mib: Mapping[int, int]) -> tuple[tuple[int, int], ...]:
    """Each device's free MiB rounded down to its band, by device index."""
    return tuple(sorted((int(i), int(mib) // FREE_BAND_MIB * FREE_BAND_MIB) for i, mib in free_mib.items()))


def _digest(*parts: object) -> str:
    text = json.dumps(parts, sort_keys=True, default=lambda o: attrs.asdict(o) if attrs.has(type(o)) else str(o))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def projection_key(tool: FileId, model: FileId, argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The key a projection is kept by: the fitter, the model file, the arguments, the environment."""
    return "project:" + _digest(tool, model, list(argv), sorted(env.items()))


def fit_key(
    tool: FileId, model: FileId, argv: Sequence[str], env: Mapping[str, str], free_mib: Mapping[int, int]
) -> str:
    """The key a fit is kept by: what keys a projection, and the free memory in bands."""
    return "fit:" + _digest(tool, model, list(argv), sorted(env.items()), free_bands(free_mib))


def _by_device(value: Mapping[int, int]) -> dict[int, int]:
    return dict(sorted(dict(value).items()))


@attrs.frozen
class FitRoom:
    """What the engine's fit at start compares a projection with: the free MiB of each device
    the server may use (one reading), the margin it keeps free on each (-fitt), and the share
    the GPU runtime takes of each before any model (Backend.runtime_reserve_mib)."""

    free_mib: dict[int, int] = attrs.field(converter=_by_device)
    margin_mib: int = 1024
    reserve_mib: int = 0


def fits_whole(devices_mib: Mapping[str, float], room: FitRoom | None) -> bool:
    """Whether the projection of the plan's own arguments (`devices_mib`: MiB on each device)
    leaves every device its margin and its runtime's share, so the engine would fit nothing
    away and no fit needs running. Conservative: the largest device figure against the least
    free device; False with no reading, or fewer devices read than projected."""
    if room is None or not room.free_mib or not devices_mib or len(devices_mib) > len(room.free_mib):
        return False
    need = max(devices_mib.values()) + room.margin_mib + room.reserve_mib
    return need <= min(room.free_mib.values())
