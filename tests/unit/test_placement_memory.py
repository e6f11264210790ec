"""Memory-aware placement (states/fleet/placement.py `place_memory`): pure, no daemon. Figures in MiB."""

from __future__ import annotations

import pytest

from stoker.states.launch.records import DownCause, LaunchState as S
from stoker.states.fleet.placement import Footprint, MemoryRoom, Resident, Verdict, loads_on_demand, place_memory
from stoker.states.reasons import ReasonCode


def fp(ram: float, vram: float = 0.0, reading: str = "engine") -> Footprint:
    return Footprint(ram, vram, reading)


NEED = Footprint(300.0, 0.0, "llama-fit-params")


def test_it_loads_when_it_fits_under_the_cap_and_in_the_ram_available():
    residents = [Resident("a", S.READY, footprint=fp(500)), Resident("b", S.PLANNING)]
    verdict = place_memory("b", NEED, residents, MemoryRoom(available_ram_mib=4000, max_ram_mib=800))
    assert verdict.verdict is Verdict.LOAD
    assert verdict.evidence["used_ram_mib"] == 500 and verdict.evidence["need"]["reading"] == "llama-fit-params"


def test_no_cap_and_no_reading_of_the_ram_never_refuses():
    residents = [Resident("a", S.READY, footprint=fp(10**6))]
    assert place_memory("b", NEED, residents, MemoryRoom(None)).verdict is Verdict.LOAD


def test_over_the_cap_the_least_recently_used_idle_models_go_first_and_no_more_than_needed():
    residents = [
        Resident("pinned", S.READY, pinned=True, idle_s=900, footprint=fp(100)),
        Resident("busy", S.READY, in_flight=1, idle_s=800, footprint=fp(100)),
        Resident("recent", S.READY, idle_s=5, footprint=fp(200)),
        Resident("old", S.READY, idle_s=60, footprint=fp(150)),
        Resident("older", S.READY, idle_s=120, footprint=fp(50)),
    ]
    # used 600 + need 300 against a cap of 750: 150 over; older (50) is not enough, older + old (200) is.
    verdict = place_memory("new", NEED, residents, MemoryRoom(4000, max_ram_mib=750))
    assert verdict.verdict is Verdict.EVICT
    assert verdict.victims == ("older", "old") and verdict.victim == "older"
    assert verdict.evidence["short"] == {"ram_cap": 150.0}
    assert verdict.evidence["freed"] == {"ram_mib": 200.0, "vram_mib": 0.0}


def test_the_ram_available_counts_what_arriving_models_will_take_and_what_evicting_frees():
    residents = [
        Resident("loading", S.LOADING, footprint=fp(250, reading="stoker")),  # not yet all taken
        Resident("idle", S.READY, idle_s=30, footprint=fp(200)),
    ]
    room = MemoryRoom(available_ram_mib=400)  # 400 - 250 arriving = 150 < 300
    verdict = place_memory("new", NEED, residents, room)
    assert verdict.verdict is Verdict.EVICT and verdict.victims == ("idle",)
    assert verdict.evidence["short"] == {"ram_available": 150.0}


def test_nothing_is_unloaded_when_unloading_every_idle_model_would_not_make_room():
    residents = [
        Resident("pinned", S.READY, pinned=True, footprint=fp(600)),
        Resident("idle", S.READY, idle_s=99, footprint=fp(100)),
    ]
    verdict = place_memory("new", NEED, residents, MemoryRoom(10_000, max_ram_mib=800))
    assert verdict.verdict is Verdict.NO_ROOM and verdict.victims == ()
    assert verdict.evidence["short"] == {"ram_cap": 200.0}
    assert verdict.evidence["short_after_evicting_all"] == {"ram_cap": 100.0}


def test_a_cap_smaller_than_the_model_alone_is_no_room_with_nothing_loaded():
    verdict = place_memory("new", NEED, [Resident("new", S.PLANNING)], MemoryRoom(10_000, max_ram_mib=299))
    assert verdict.verdict is Verdict.NO_ROOM
    assert verdict.evidence["short_after_evicting_all"] == {"ram_cap": 1.0}


def test_vram_has_its_own_cap_and_no_available_check():
    need = Footprint(50, 900, "llama-fit-params")
    residents = [Resident("gpu", S.READY, idle_s=10, footprint=fp(40, 700))]
    assert place_memory("new", need, residents, MemoryRoom(10_000)).verdict is Verdict.LOAD
    verdict = place_memory("new", need, residents, MemoryRoom(10_000, max_vram_mib=1024))
    assert verdict.verdict is Verdict.EVICT and verdict.victims == ("gpu",)
    assert verdict.evidence["short"] == {"vram_cap": 576.0}


def test_a_model_already_stopping_is_waited_for_rather_than_evicting_another():
    residents = [
        Resident("stopping", S.STOPPING, footprint=fp(500)),
        Resident("busy", S.READY, in_flight=2, footprint=fp(100)),
    ]
    verdict = place_memory("new", NEED, residents, MemoryRoom(10_000, max_ram_mib=850))  # 600 + 300 > 850
    assert verdict.verdict is Verdict.WAIT_STOP and verdict.victims == ()


@pytest.mark.parametrize(
    "reason, loads", [(ReasonCode.PLACEMENT_NO_ROOM, True), (ReasonCode.CRASH_LOOP, False), (None, False)]
)
def test_a_model_that_failed_only_for_want_of_room_loads_on_the_next_request(reason, loads):
    assert loads_on_demand(S.FAILED, None, reason) is loads
    assert loads_on_demand(S.STOPPED, DownCause.USER, ReasonCode.PLACEMENT_NO_ROOM) is False


def test_the_no_room_sentence_says_figures_that_add_up():
    import re

    from stoker.daemon.fleet.room import no_room_sentence

    residents = [
        Resident("pinned", S.READY, pinned=True, footprint=fp(600)),
        Resident("idle", S.READY, idle_s=99, footprint=fp(100)),
        Resident("loading", S.LOADING, footprint=fp(250)),
    ]
    verdict = place_memory("new", NEED, residents, MemoryRoom(available_ram_mib=700, max_ram_mib=1000))
    assert verdict.verdict is Verdict.NO_ROOM
    said = no_room_sentence("new", verdict)
    # The cap: what stays loaded (pinned 600 + loading 250) + the need 300 - the cap 1000 = 150.
    stays, cap, over = map(float, re.search(r"stays loaded \((\d+) MiB of RAM\).*= (\d+) by (\d+) MiB", said).groups())
    assert (stays, cap, over) == (850, 1000, 150) and stays + 300 - cap == over
    # The RAM available: 700 + 100 freed - 250 still to be taken = 550 against 300 needed: fits.
    assert "short by" not in said.split("max_ram_mib")[1]
    room = MemoryRoom(available_ram_mib=400)
    verdict = place_memory("new", NEED, residents, room)
    said = no_room_sentence("new", verdict)
    figures = re.search(
        r"only (\d+) MiB of RAM is available, (\d+) MiB more once.*, (\d+) MiB of it still.*short by (\d+) MiB", said
    )
    assert figures is not None, said
    available, freed, arriving, short = map(float, figures.groups())
    assert 300 - (available + freed - arriving) == short == 50
