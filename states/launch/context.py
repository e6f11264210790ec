"""A request's context (Ollama's `options.num_ctx`, pure): whether its model's server must be
relaunched with a larger one, and with what.

Ollama's `num_ctx` is the context of one conversation: its runner allocates `num_ctx` for each of
its parallel sequences. Stoker's `ctx_size` (llama-server's `-c`) is the KV cells of every slot
together, which the server divides among its `parallel` slots; so a request asking `num_ctx`
needs `num_ctx x parallel` cells. With `ctx_size = 0` the engine gives each slot the trained
context, the most any request may have.

The front door asks with the facts of the moment (daemon/frontdoor/ollama.py): the launch
machine's state and data (the plan that runs, or the context its next plan gets:
`planned_ctx_size`), the model's config, and its trained context (the GGUF header's
`context_length`). A context at or below that is
served as it is; a larger one is bounded by the trained context and asked of the launch machine
(`ContextRequested`), which relaunches the server through a planned restart (drained, its slots
saved and restored, the requests held meanwhile), and keeps it for that server until it stops
for good (down, idle, evicted, the daemon's stop) or a plan with it fails.
"""

from __future__ import annotations

from typing import Any

import attrs

from stoker.states.launch.records import LaunchData, LaunchState
from stoker.states.launch.steps import RUNNING


def num_ctx_of(options: Any) -> int | None:
    """A request's `options.num_ctx` (None: not asked, or 0 and below: the model's own, as on
    Ollama); ValueError says what is wrong with it."""
    if not isinstance(options, dict) or options.get("num_ctx") is None:
        return None
    value = options["num_ctx"]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"options.num_ctx must be a whole number of tokens, got {value!r}")
    return value if value > 0 else None


def planned_ctx_size(config_ctx_size: int, asked: int | None) -> int:
    """The `-c` a plan gets: the config's `ctx_size`, or the context a request asked where that
    is larger (0, the trained context of each slot, is never made smaller)."""
    if asked is None or config_ctx_size == 0:
        return config_ctx_size
    return max(config_ctx_size, asked)


@attrs.frozen
class ContextAsk:
    """The answer: `ctx_size` the `-c` to relaunch with (None: serve as it is), and the figures
    that decided (recorded in the launch machine's history with the relaunch)."""

    ctx_size: int | None
    evidence: dict[str, Any] = attrs.field(factory=dict, hash=False)


def context_for(
    num_ctx: int,
    *,
    state: LaunchState,
    data: LaunchData,
    ctx_size: int,
    parallel: int,
    trained: int | None,
    loads: bool = True,
) -> ContextAsk:
    """What a request asking `num_ctx` tokens of context needs of its model's server: the launch
    machine's `state` and `data`, the model's config (`ctx_size`, `parallel`), what it was trained
    on (`trained`; None: not known), and whether a request loads it while it is down (`loads`)."""
    if state in (LaunchState.STOPPED, LaunchState.FAILED) and not loads:
        return ContextAsk(None, {"num_ctx": num_ctx, "state": state.value})  # refused by the hold; nothing to ask
    if state in RUNNING and data.plan is not None:  # the server that runs, or is on its way up
        return widen(num_ctx, ctx_size=data.plan.ctx_size, parallel=data.plan.parallel, trained=trained)
    # Down, planning, stopping or backing off: what its next plan gets.
    return widen(num_ctx, ctx_size=planned_ctx_size(ctx_size, data.ctx_size), parallel=parallel, trained=trained)


def widen(num_ctx: int, *, ctx_size: int, parallel: int, trained: int | None) -> ContextAsk:
    """What a request asking `num_ctx` tokens of context needs of a server with `ctx_size` cells
    over `parallel` slots (0: each slot the trained context), for a model trained on `trained`
    tokens (None: not known, no bound but the request's)."""
    slots = max(1, parallel)
    per_slot = (trained or 0) if ctx_size == 0 else ctx_size // slots
    wanted = num_ctx if trained is None else min(num_ctx, trained)
    evidence: dict[str, Any] = {"num_ctx": num_ctx, "slot_ctx": per_slot, "parallel": slots, "trained_ctx": trained}
    if ctx_size == 0 or wanted <= per_slot:
        return ContextAsk(None, evidence)
    if wanted < num_ctx:
        evidence["bounded_by"] = "trained_ctx"
    return ContextAsk(wanted * slots, {**evidence, "ctx_size": wanted * slots, "was_ctx_size": ctx_size})
