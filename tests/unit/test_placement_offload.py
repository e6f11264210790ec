"""A GPU plan fitted short of every layer because idle models hold the VRAM: they are unloaded
first when that makes it whole (states/fleet/placement.py `place_offload`, daemon/fleet/room.py), and
its memory is estimated again once they are gone. Pure policy, then the room maker's loop with
stand-in members (the engine's side is run on an H200: docs/gpu-verification.md)."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from stoker.daemon.config.placement import PlacementConfig
from stoker.daemon.fleet.room import RoomMaker
from stoker.daemon.fleet.usage import ChangeSignal
from stoker.states.launch import records as LR
from stoker.states.launch.records import LaunchState as S, MemoryEstimate
from stoker.states.fleet.placement import FULL_OFFLOAD, Footprint, Resident, Verdict, place_offload


def gpu(vram: float, ram: float = 100.0) -> Footprint:
    return Footprint(ram, vram, "engine")


def test_the_least_recently_used_idle_models_holding_vram_go_first_and_no_more_than_it_lacks():
    residents = [
        Resident("pinned", S.READY, pinned=True, idle_s=900, footprint=gpu(5000)),
        Resident("busy", S.READY, in_flight=1, idle_s=800, footprint=gpu(5000)),
        Resident("cpu-only", S.READY, idle_s=700, footprint=gpu(0)),  # frees no VRAM
        Resident("recent", S.READY, idle_s=5, footprint=gpu(3000)),
        Resident("old", S.READY, idle_s=60, footprint=gpu(1500)),
        Resident("older", S.READY, idle_s=120, footprint=gpu(1000)),
    ]
    # fitted 4000 of the 6000 every layer takes: 2000 short; older (1000) is not enough, + old is.
    verdict = place_offload("new", 4000, 6000, residents)
    assert verdict.verdict is Verdict.EVICT
    assert verdict.victims == ("older", "old")
    assert verdict.evidence["why"] == FULL_OFFLOAD and verdict.evidence["short_mib"] == 2000
    assert verdict.evidence["freed_vram_mib"] == 2500


def test_nothing_is_unloaded_for_a_partial_gain_or_when_nothing_is_short():
    residents = [Resident("idle", S.READY, idle_s=60, footprint=gpu(1000))]
    assert place_offload("new", 4000, 6000, residents).verdict is Verdict.LOAD  # 1000 of the 2000 lacking
    assert place_offload("new", 6000, 6000, residents).verdict is Verdict.LOAD
    said = place_offload("new", 4000, 6000, residents).evidence
    assert said["short_mib"] == 2000 and said["idle_vram_mib"] == 1000


# --- the room maker's loop -----------------------------------------------------------------


@attrs.define(eq=False)
class StandInSupervisor:
    member: "StandIn"
    fired: list[Any] = attrs.field(factory=list)

    def fire(self, event: Any) -> None:
        self.fired.append(event)
        self.member.state = S.STOPPED  # an idle server stops at once here
        self.member.change_signal.fire()


@attrs.define(eq=False)
class StandIn:
    """What RoomMaker reads of a member: its name, state, facts, footprint and supervisor."""

    name: str
    state: S
    vram: float
    change_signal: ChangeSignal
    idle_s: float = 60.0
    supervisor: StandInSupervisor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.supervisor = StandInSupervisor(self)

    def resident(self, now: float) -> Resident:
        return Resident(self.name, self.state, idle_s=self.idle_s, footprint=self.footprint())

    def footprint(self) -> Footprint:
        return gpu(self.vram) if self.state is S.READY else Footprint()

    async def wait_state(self, states: Any) -> None:
        while self.state not in set(states):
            await self.change_signal.wait()


def short_plan(fitted: float, whole: float) -> LR.LaunchPlan:
    memory = MemoryEstimate(LR.FITTER, host_mib=200, devices={"CUDA0": fitted}, whole={"CUDA0": whole} if whole else {})
    return LR.LaunchPlan("cuda", "cuda-avx2", "/b", "/b/llama-server", "/m.gguf", port=8099, memory=memory)


def room_with(members: list[StandIn], **settings: Any) -> RoomMaker:
    change_signal = members[0].change_signal
    return RoomMaker(
        lambda: members, lambda: PlacementConfig(**settings), trio.Lock(), change_signal, available=lambda: 10**6
    )


async def test_an_idle_model_is_unloaded_and_the_plan_estimated_again_with_the_vram_it_freed():
    change_signal = ChangeSignal()
    idle = StandIn("a", S.READY, vram=3000, change_signal=change_signal)
    new = StandIn("b", S.PLANNING, vram=0, change_signal=change_signal)
    estimated: list[S] = []

    async def replan() -> LR.LaunchPlan:
        estimated.append(idle.state)
        return short_plan(5000, 0)  # planned again, the fitter now places every layer

    placed = await room_with([idle, new]).make_room(new, short_plan(2500, 5000), replan)  # type: ignore[arg-type]
    assert placed.memory is not None and placed.memory.vram_mib == 5000 and not placed.memory.whole
    assert estimated == [S.STOPPED]  # planned again once the idle model was gone
    (down,) = idle.supervisor.fired
    assert down.cause is LR.DownCause.EVICTED and down.evidence["why"] == FULL_OFFLOAD
    assert down.evidence["for"] == "b" and down.evidence["short_mib"] == 2500


async def test_switched_off_or_not_enough_to_free_it_loads_as_fitted_and_unloads_nothing():
    for setting, vram in ((False, 3000), (True, 1000)):
        change_signal = ChangeSignal()
        idle = StandIn("a", S.READY, vram=vram, change_signal=change_signal)
        new = StandIn("b", S.PLANNING, vram=0, change_signal=change_signal)

        async def replan() -> LR.LaunchPlan:
            raise AssertionError("not planned again")

        room = room_with([idle, new], unload_for_full_offload=setting)
        placed = await room.make_room(new, short_plan(2500, 5000), replan)  # type: ignore[arg-type]
        assert placed.memory is not None and placed.memory.vram_mib == 2500
        assert idle.state is S.READY and not idle.supervisor.fired


# --- when a fit is short --------------------------------------------------------------------


def test_a_fit_is_short_with_fewer_layers_than_the_model_a_smaller_context_or_tensors_kept_on_the_host(tmp_path):
    from stoker.daemon.bundles.tinymodel import write_tiny_model
    from stoker.daemon.fallback.memory import fitted_short

    path = write_tiny_model(tmp_path / "m.gguf", n_layer=4)  # 4 blocks and the output layer: -ngl 5 is all
    plan = attrs.evolve(short_plan(0, 0), model_path=str(path), ctx_size=4096)
    assert not fitted_short(plan, ("-c", "4096", "-ngl", "5"), 4096)
    assert fitted_short(plan, ("-c", "4096", "-ngl", "4"), 4096)
    assert fitted_short(plan, ("-c", "2048", "-ngl", "5"), 4096)
    assert fitted_short(plan, ("-c", "4096", "-ngl", "5", "-ot", "blk\\.3\\.ffn=CPU"), 4096)
