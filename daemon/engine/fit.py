"""The engine's own memory fitter: the bundle's `llama-fit-params`, run before a launch.

llama.cpp's `llama_params_fit` is what llama-server itself runs at start (`--fit on`, the
default) to shrink the context, then the GPU layers, until the projected memory fits the free
device memory. `llama-fit-params` runs the same code without loading the weights (the model
and a context are created with no_alloc: milliseconds for the tiny model, well under a second
for a 13 GiB one) and prints either

    --fit-print on:  one line per device, then the host, "NAME MODEL CONTEXT COMPUTE" in MiB
                     (`common_fit_print`), for the arguments as given; or
    the default:     the fitted arguments, "-c N -ngl N [-ts ...] [-ot "..."]", after fitting
                     them to the free device memory it reads now (exit 1 when nothing fits).

Stoker asks the first for every plan (the projection placement decides with) and, for a GPU
plan whose layers the engine fits (`-ngl auto`) and that does not fit whole, the second first,
so that the projection is for the layers the server will really place. Except a `-ngl auto` plan
that Stoker's own upper bound from the GGUF header clearly places in the free VRAM
(states/fallback/memory_bound.py, daemon/fallback/memory.py): the engine's own fit keeps every
layer there, so no fitter runs and the bound is the plan's figures. The program gets the
server's environment and an empty working directory (ggml loads backend libraries from the cwd), and only the arguments it
accepts that shape memory (the server's own, such as --alias or --metrics, would make it exit).
Figures are whole MiB, rounded down by the engine.

A projection for given arguments depends only on the program, the model file and the arguments
(not on the free memory: only fitting does); a fit depends on those and the free memory. Both
are kept (`FitCache`: in memory and in fit-cache.json under the daemon's data dir, so a daemon
started again has them) by the keys states/fallback/fit_reuse.py makes, and reused: a model
loaded again (an eviction swapped it out, an idle unload, a new daemon) runs no fitter. A
`-ngl auto` plan asks the projection of its own arguments first and runs the fit only when
those do not fit whole (`fits_whole`), so one plan runs the fitter once where the engine would
fit nothing away, and never where its answers are kept. Measured on this
2-core machine: 0.05 s for the tiny test model, 0.45 s for SmolLM2-135M, 2.0 s for Gemma 3 270M
(its 262k-token vocabulary); 0.4-0.5 s per run with CUDA on an H200 (its initialisation).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import attrs

from stoker.daemon.core.kept import KeptAnswers
from stoker.daemon.core.launch_records import launch_record
from stoker.states.fallback.fit_reuse import FileId as FitFileId
from stoker.states.fallback.fit_reuse import FitRoom, fit_key, fits_whole, projection_key

log = logging.getLogger(__name__)

# How long the fitter may take before Stoker gives up on it and estimates itself.
FIT_TIMEOUT_S = 30.0

# The arguments of a plan that shape memory and that llama-fit-params accepts (common ones, not
# llama-server's own), with how many values each takes.
MEMORY_FLAGS: Mapping[str, int] = {
    **dict.fromkeys(("-c", "--ctx-size", "-ngl", "--gpu-layers", "--n-gpu-layers"), 1),
    **dict.fromkeys(("-fa", "--flash-attn", "-ctk", "--cache-type-k", "-ctv", "--cache-type-v"), 1),
    **dict.fromkeys(("-b", "--batch-size", "-ub", "--ubatch-size"), 1),
    **dict.fromkeys(("-sm", "--split-mode", "-ts", "--tensor-split", "-mg", "--main-gpu"), 1),
    **dict.fromkeys(("-dev", "--device", "-ot", "--override-tensor", "-ncmoe", "--n-cpu-moe", "--rpc"), 1),
    **dict.fromkeys(("-fitt", "--fit-target", "-fitc", "--fit-ctx", "-fit", "--fit"), 1),
    **dict.fromkeys(("--swa-full", "-nkvo", "--no-kv-offload", "-cmoe", "--cpu-moe"), 0),
}

_PRINTED = re.compile(r"^(\S+) (\d+) (\d+) (\d+)\s*$")
_FITTED = re.compile(r"^-c \d+ -ngl -?\d+")
HOST = "Host"


class FitFailed(Exception):
    """The fitter did not answer: absent, timed out, exited non-zero, or printed nothing we read."""


@attrs.frozen
class FitProjection:
    """What the engine projects a server to hold, in MiB: each device's (and the host's, under
    "Host") model, context and compute figures; the fitted arguments when it fitted them."""

    parts: dict[str, dict[str, float]]
    fitted_args: tuple[str, ...] = ()
    argv: tuple[str, ...] = ()
    seconds: float = 0.0
    # Where it fitted (fitted_args): the projection of the arguments as given first, every
    # layer on the GPU for -ngl auto (what the whole model would take); None where not asked.
    whole: dict[str, dict[str, float]] | None = None

    @property
    def host_mib(self) -> float:
        return float(sum(self.parts.get(HOST, {}).values()))

    @property
    def devices(self) -> dict[str, float]:
        return {name: float(sum(p.values())) for name, p in self.parts.items() if name != HOST}


def memory_items(args: Iterable[str]) -> list[tuple[str, ...]]:
    """The memory-shaping arguments among `args`, each with its values (`("-c", "4096")`,
    `("--fit-target=2048",)`, `("--swa-full",)`), in order."""
    kept: list[tuple[str, ...]] = []
    items = list(args)
    i = 0
    while i < len(items):
        flag = items[i]
        name = flag.split("=", 1)[0]
        arity = MEMORY_FLAGS.get(name)
        if arity is None:
            i += 1
            continue
        if "=" in flag or arity == 0:
            kept.append((flag,))
            i += 1
            continue
        kept.append(tuple(items[i : i + 1 + arity]))
        i += 1 + arity
    return kept


def memory_args(args: Iterable[str]) -> list[str]:
    """The memory-shaping arguments among `args` (in order, with their values), the rest left out."""
    return [item for flag in memory_items(args) for item in flag]


def parse_printed(stdout: str) -> dict[str, dict[str, float]]:
    """`--fit-print on`'s lines as {device or "Host": {model, context, compute}}; FitFailed without a Host line."""
    parts: dict[str, dict[str, float]] = {}
    for line in stdout.splitlines():
        m = _PRINTED.match(line.strip())
        if m:
            parts[m.group(1)] = {"model": float(m.group(2)), "context": float(m.group(3)), "compute": float(m.group(4))}
    if HOST not in parts:
        raise FitFailed(f"no projection in its output: {stdout.strip()[-200:]!r}")
    return parts


def parse_fitted(stdout: str) -> list[str]:
    """The fitted arguments ("-c N -ngl N [-ts A,B] [-ot "..."]") as argv items."""
    for line in stdout.splitlines():
        line = line.strip()
        if _FITTED.match(line):
            items: list[str] = []
            head, quote, rest = line.partition(' -ot "')
            items.extend(head.split())
            if quote:
                items.extend(["-ot", rest.rstrip('"')])
            return items
    raise FitFailed(f"no fitted arguments in its output: {stdout.strip()[-200:]!r}")


def _run(argv: Sequence[str], env: Mapping[str, str], timeout: float) -> str:
    # Recorded before the spawn (daemon/core/launch_records.py): the timeout below is this
    # thread's, so a run a killed daemon left is ended by the next one.
    with launch_record("fit") as record:
        try:
            done = subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                cwd=record.cwd,
                env=record.env(env),
                timeout=timeout,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as err:
            raise FitFailed(f"it ran past {timeout:g} s") from err
        except OSError as err:
            raise FitFailed(f"it could not be run: {err}") from err
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise FitFailed(f"it exited with status {done.returncode}: {last}")
    return done.stdout


class FitCache(KeptAnswers):
    """The fitter's answers by their keys (states/fallback/fit_reuse.py), kept in the daemon's
    data dir (daemon/core/kept.py) so a restarted daemon reuses them."""

    KEPT = 256

    def __init__(self, path: Path | None = None) -> None:
        super().__init__(path, self.KEPT)
        self.runs = 0  # fitter runs made for this cache (tests and the benchmark read it)


# The daemon's cache (keep_answers_in points it at its data dir at start); in memory until then.
_CACHE = FitCache()
CACHE_FILE = "fit-cache.json"


def keep_answers_in(path: Path | None) -> FitCache:
    """Keep the fitter's answers in `path` from now on (None: in memory only); the cache."""
    global _CACHE
    _CACHE = FitCache(path)
    return _CACHE


def answers() -> FitCache:
    return _CACHE


def _file_id(path: str | Path, content_id: str | None = None) -> FitFileId:
    st = os.stat(path)
    return FitFileId(str(path), st.st_size, content_id or f"mtime:{st.st_mtime_ns}")


def _printed(
    argv: Sequence[str], ids: tuple[FitFileId, FitFileId], env: Mapping[str, str], timeout: float
) -> dict[str, dict[str, float]]:
    key = projection_key(*ids, argv[1:], env)
    found = _CACHE.get(key)
    if not isinstance(found, dict):
        _CACHE.runs += 1
        found = parse_printed(_run(argv, env, timeout))
        _CACHE.put(key, found)
    return {str(name): {k: float(v) for k, v in part.items()} for name, part in found.items()}


def _fitted(
    argv: Sequence[str], ids: tuple[FitFileId, FitFileId], env: Mapping[str, str], room: FitRoom | None, timeout: float
) -> list[str]:
    key = fit_key(*ids, argv[1:], env, room.free_mib if room else {})
    found = _CACHE.get(key) if room is not None else None  # no reading: no band to key it by
    if not isinstance(found, list):
        _CACHE.runs += 1
        found = parse_fitted(_run(argv, env, timeout))
        if room is not None:
            _CACHE.put(key, found)
    return [str(item) for item in found]


def project(
    tool: str | Path,
    model: str | Path,
    args: Sequence[str],
    env: Mapping[str, str],
    *,
    fit_first: bool = False,
    room: FitRoom | None = None,
    model_id: str | None = None,
    timeout: float = FIT_TIMEOUT_S,
) -> FitProjection:
    """The fitter's projection of `model` with `args` (the plan's memory-shaping arguments):
    with `fit_first`, of the arguments the engine would fit to `room` (the free device memory
    read for the plan): the projection of `args` themselves when they fit whole
    (states/fallback/fit_reuse.py `fits_whole`: one run, no fit), else of the fitted ones.
    Every answer is kept by its key (the model by `model_id`, its content id, where given; else
    by its mtime) and reused (`FitCache`). Blocking (run it in a thread);
    FitFailed when it does not answer within `timeout` seconds in all."""
    if not os.access(tool, os.X_OK):
        raise FitFailed(f"{tool} is not an executable file")
    started = time.monotonic()
    ids = (_file_id(tool), _file_id(model, model_id))
    base = [str(tool), "-m", str(model), *args]

    def left() -> float:
        return max(1.0, timeout - (time.monotonic() - started))

    fitted: list[str] = []
    whole: dict[str, dict[str, float]] | None = None
    if fit_first:
        whole_argv = [*base, "--fit-print", "on"]
        if room is not None:
            whole = _printed(whole_argv, ids, env, left())
            devices = {name: float(sum(p.values())) for name, p in whole.items() if name != HOST}
            if fits_whole(devices, room):
                return FitProjection(whole, (), tuple(whole_argv), round(time.monotonic() - started, 3))
        fitted = _fitted(base, ids, env, room, left())
    argv = [*base, *fitted, "--fit-print", "on"]
    parts = _printed(argv, ids, env, left())
    return FitProjection(parts, tuple(fitted), tuple(argv), round(time.monotonic() - started, 3), whole)
