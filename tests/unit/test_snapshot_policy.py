"""stoker.states.snapshots.policy: restore or re-prefill, budgets that scale with the model (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stoker.states.snapshots import policy as P
from stoker.states.snapshots.policy import Figure, RestoreInputs

MIB = 1 << 20
# An 8B-shaped F16 model (32 layers, 8 KV heads of 128): 128 KiB of KV per token (measured on an H200).
LLAMA8B_PER_TOKEN = 32 * 8 * (128 + 128) * 2


def inputs(**kw):
    base = dict(
        n_tokens=4096,
        file_bytes=512 * MIB,
        resident=1.0,
        prefill_tok_s=None,
        restore_cache_mb_s=None,
        restore_disk_mb_s=None,
    )
    return RestoreInputs(**{**base, **kw})


def test_fold_averages_first_then_moves_by_a_quarter():
    f = P.fold(None, 10.0)
    assert f == Figure(10.0, 1)
    f = P.fold(f, 20.0)
    assert f == Figure(15.0, 2)  # mean of two
    f = P.fold(P.fold(f, 15.0), 15.0)
    assert f.samples == 4 and f.value == pytest.approx(15.0)
    f = P.fold(f, 35.0)  # now a quarter
    assert f.value == pytest.approx(20.0)


def test_without_figures_it_restores_and_says_why():
    d = P.decide_restore(inputs())
    assert d.choice == "restore" and "no prefill figure" in d.why
    d = P.decide_restore(inputs(prefill_tok_s=Figure(10_000, 3)))
    assert d.choice == "restore" and "no restore figure" in d.why and d.prefill_s == pytest.approx(0.4096)


def test_h200_short_conversation_from_disk_is_re_prefilled():
    """On an H200 at 4k tokens the engine prefills faster than a 512 MiB file comes off disk."""
    d = P.decide_restore(
        inputs(
            resident=0.0,
            prefill_tok_s=Figure(12_000, 5),
            restore_cache_mb_s=Figure(4000, 5),
            restore_disk_mb_s=Figure(700, 5),
        )
    )
    assert d.choice == "reprefill"
    assert d.prefill_s == pytest.approx(4096 / 12_000)
    assert d.restore_s == pytest.approx(512 * MIB / 700e6 + P.RESTORE_OVERHEAD_S)
    assert "re-prefilling 4096 tokens" in d.why


def test_the_same_file_in_the_page_cache_is_restored():
    d = P.decide_restore(
        inputs(
            resident=1.0,
            prefill_tok_s=Figure(12_000, 5),
            restore_cache_mb_s=Figure(4000, 5),
            restore_disk_mb_s=Figure(700, 5),
        )
    )
    assert d.choice == "restore" and d.restore_s < d.prefill_s


def test_a_cpu_restores_even_a_short_one():
    d = P.decide_restore(
        inputs(n_tokens=512, file_bytes=9 * MIB, prefill_tok_s=Figure(100, 2), restore_cache_mb_s=Figure(2000, 2))
    )
    assert d.choice == "restore"


def test_a_near_tie_is_a_restore():
    # prefill 0.30 s against restore 0.31 s: within the margin (10 %, at least 10 ms)
    d = P.decide_restore(
        inputs(
            n_tokens=3000,
            file_bytes=int(0.305 * 1e9),
            prefill_tok_s=Figure(10_000, 3),
            restore_cache_mb_s=Figure(1000, 3),
        )
    )
    assert d.choice == "restore"


def test_unknown_residency_counts_as_disk_where_known():
    both = dict(restore_cache_mb_s=Figure(4000, 1), restore_disk_mb_s=Figure(500, 1))
    assert P.restore_estimate(inputs(resident=None, **both)) == pytest.approx(512 * MIB / 500e6 + 0.005)
    only_cache = dict(restore_cache_mb_s=Figure(4000, 1))
    assert P.restore_estimate(inputs(resident=None, **only_cache)) == pytest.approx(512 * MIB / 4000e6 + 0.005)
    # half cached: the disk half has no figure, so no estimate (restore, which measures it)
    assert P.restore_estimate(inputs(resident=0.5, **only_cache)) is None


def test_prefill_rate_falls_back_on_the_slowest_band():
    bands = {"le1024": Figure(3000, 2), "le16384": Figure(9000, 2)}
    assert P.prefill_rate(900, bands) == Figure(3000, 2)
    assert P.prefill_rate(10_000, bands) == Figure(9000, 2)
    assert P.prefill_rate(100_000, bands) == Figure(3000, 2)  # unmeasured: the slowest, restore-leaning
    assert P.prefill_rate(100, {}) is None
    assert [P.prefill_band(n) for n in (1, 1024, 1025, 65536, 65537)] == [
        "le1024",
        "le1024",
        "le4096",
        "le65536",
        "gt65536",
    ]


def test_restore_band_by_residency():
    assert [P.restore_band(r) for r in (None, 0.0, 0.1, 0.5, 0.9, 1.0)] == [
        None,
        "disk",
        "disk",
        None,
        "cache",
        "cache",
    ]


@given(
    n_tokens=st.integers(1, 200_000),
    file_mib=st.integers(1, 20_000),
    resident=st.one_of(st.none(), st.floats(0, 1)),
    prefill=st.floats(1, 100_000),
    cache=st.floats(10, 20_000),
    disk=st.floats(10, 5_000),
)
def test_never_slower_than_the_better_estimate(n_tokens, file_mib, resident, prefill, cache, disk):
    """Where both estimates exist, the choice is the faster one, or a restore within the margin."""
    d = P.decide_restore(
        inputs(
            n_tokens=n_tokens,
            file_bytes=file_mib * MIB,
            resident=resident,
            prefill_tok_s=Figure(prefill, 3),
            restore_cache_mb_s=Figure(cache, 3),
            restore_disk_mb_s=Figure(disk, 3),
        )
    )
    assert d.restore_s is not None and d.prefill_s is not None
    margin = max(P.REPREFILL_MARGIN * d.restore_s, P.REPREFILL_MARGIN_S)
    if d.choice == "reprefill":
        assert d.prefill_s < d.restore_s
    else:
        assert d.restore_s <= d.prefill_s + margin


# --- budgets ----------------------------------------------------------------------------------


def test_kv_bytes_per_token_prefers_the_servers_own_buffers():
    assert P.kv_bytes_per_token(kv_bytes=153 * MIB, kv_cells=8704, model_bytes_per_token=1) == 18432
    assert P.kv_bytes_per_token(kv_bytes=None, kv_cells=8704, model_bytes_per_token=LLAMA8B_PER_TOKEN) == 131072
    assert P.kv_bytes_per_token() is None


def test_auto_retention_keeps_two_full_saves_of_an_8b_model():
    """Before: a fixed 2 GiB dropped every snapshot over ~16k tokens on an 8B model."""
    budget = P.retention_bytes("auto", bytes_per_token=LLAMA8B_PER_TOKEN, n_ctx=32768, n_slots=1)
    full = P.snapshot_bytes(32768, LLAMA8B_PER_TOKEN)
    assert budget == 2 * full and budget > 8 * 2**30
    assert P.retention_bytes("auto", bytes_per_token=18432, n_ctx=4096, n_slots=1) == P.DEFAULT_MAX_BYTES
    assert P.retention_bytes("auto", bytes_per_token=None, n_ctx=4096, n_slots=1) == P.DEFAULT_MAX_BYTES
    assert P.retention_bytes(123, bytes_per_token=LLAMA8B_PER_TOKEN, n_ctx=32768, n_slots=4) == 123


def test_auto_stop_budget_covers_a_130k_save():
    """Before: 130k tokens took 28 s to save; the fixed budget was 20 s."""
    expected = P.snapshot_bytes(130_000, LLAMA8B_PER_TOKEN)
    measured = Figure(expected / 1e6 / 28.0, 4)  # this machine saved at the rate that took 28 s
    budget = P.stop_budget("auto", expected_bytes=expected, save_mb_s=measured)
    assert budget == pytest.approx(5 + 2 * 28.0)
    assert P.stop_budget("auto", expected_bytes=1000, save_mb_s=measured) == P.DEFAULT_STOP_BUDGET_S
    assert P.stop_budget("auto", expected_bytes=None, save_mb_s=None) == P.DEFAULT_STOP_BUDGET_S
    unmeasured = P.stop_budget("auto", expected_bytes=expected, save_mb_s=None)
    assert unmeasured == pytest.approx(5 + 2 * expected / 100e6)  # 17 GB at an assumed slow disk's 100 MB/s
    huge = P.snapshot_bytes(1_000_000, LLAMA8B_PER_TOKEN)
    assert P.stop_budget("auto", expected_bytes=huge, save_mb_s=None) == P.MAX_AUTO_STOP_BUDGET_S
    assert P.stop_budget(2.5, expected_bytes=expected, save_mb_s=measured) == 2.5


def test_save_verdict_refuses_what_could_not_be_kept():
    assert P.save_verdict(expected_bytes=None, max_bytes=1, free_bytes=0).why is None
    assert P.save_verdict(expected_bytes=100, max_bytes=1000, free_bytes=10**10).why is None
    too_big = P.save_verdict(expected_bytes=2000, max_bytes=1000, free_bytes=10**10)
    assert too_big.why == "too_big" and too_big.figures["expected_bytes"] == 2000
    no_space = P.save_verdict(expected_bytes=100, max_bytes=1000, free_bytes=99)
    assert no_space.why == "no_space" and no_space.figures["free_bytes"] == 99


@pytest.mark.parametrize(
    "after, budget",
    [
        (P.AfterStop.STOP, float("inf")),  # the snapshot service's stop budget bounds it
        (P.AfterStop.RESTART, float("inf")),
        (P.AfterStop.FAIL, float("inf")),
        (P.AfterStop.HUNG, 10.0),  # a hung engine gets the grace period, no more
        (P.AfterStop.CRASH, None),  # a stall never got ready: nothing to save
    ],
)
def test_whether_a_stop_saves_the_slots_first_and_within_what(after, budget):
    assert P.save_before_stop(after, 10.0) == budget


def test_every_way_a_stop_can_end_has_a_save_rule():
    assert set(P.SAVE_BEFORE_STOP) == set(P.AfterStop)


# --- whether a planned stop saves ---------------------------------------------------------------


def test_the_h200s_32k_restart_skips_the_save_that_costs_more_than_a_re_prefill():
    """Measured on one H200: a 32k-token conversation saved in 4.6 s and restored in ~1.9 s,
    re-prefilled in 2.4 s. Saving then restoring it made the restart slower than having no
    snapshots at all: the stop skips the save and says why."""
    n_tokens, file_bytes = 32_768, 32_768 * (LLAMA8B_PER_TOKEN + 4)
    d = P.decide_save(
        inputs(
            n_tokens=n_tokens,
            file_bytes=file_bytes,
            prefill_tok_s=Figure(n_tokens / 2.4, 5),
            restore_cache_mb_s=Figure(file_bytes / 1.9e6, 5),
        ),
        save_mb_s=Figure(file_bytes / 4.6e6, 5),
    )
    assert d.choice == "skip"
    assert d.save_s == pytest.approx(4.6) and d.prefill_s == pytest.approx(2.4)
    assert "re-prefilling 32768 tokens later" in d.why and "beats saving" in d.why


def test_a_cpu_conversation_is_saved_where_re_prefilling_is_slow():
    d = P.decide_save(
        inputs(n_tokens=4096, file_bytes=100 * MIB, prefill_tok_s=Figure(300, 5), restore_cache_mb_s=Figure(2000, 5)),
        save_mb_s=Figure(500, 5),
    )
    assert d.choice == "save" and d.prefill_s == pytest.approx(4096 / 300)


def test_without_figures_a_stop_saves_which_measures_them():
    assert P.decide_save(inputs(), save_mb_s=Figure(500, 1)).why.startswith("no prefill figure")
    assert P.decide_save(inputs(prefill_tok_s=Figure(1e6, 1)), save_mb_s=None).why.startswith("no save figure")
    assert P.decide_save(inputs(prefill_tok_s=Figure(1e6, 1)), save_mb_s=Figure(500, 1)).why.startswith(
        "no restore figure"
    )


@given(
    n_tokens=st.integers(1, 200_000),
    file_mib=st.integers(1, 20_000),
    prefill=st.floats(1, 100_000),
    cache=st.floats(10, 20_000),
    save=st.floats(10, 10_000),
)
def test_a_stop_never_spends_more_than_the_better_way_back(n_tokens, file_mib, prefill, cache, save):
    """Skipped only where re-prefilling beats save + restore; saved only where it does not lose by more than the margin."""
    d = P.decide_save(
        inputs(
            n_tokens=n_tokens,
            file_bytes=file_mib * MIB,
            prefill_tok_s=Figure(prefill, 3),
            restore_cache_mb_s=Figure(cache, 3),
        ),
        save_mb_s=Figure(save, 3),
    )
    assert d.save_s is not None and d.restore_s is not None and d.prefill_s is not None
    both = d.save_s + d.restore_s
    if d.choice == "skip":
        assert d.prefill_s < both
    else:
        assert both <= d.prefill_s + max(P.REPREFILL_MARGIN * both, P.REPREFILL_MARGIN_S)


# --- the restore estimate learns from measured restores -------------------------------------

# An 8B-shaped model on an H200 (128 KiB of KV per token): what whole restores took on the
# daemon's side, where the engine's MB/s alone estimated 136 ms and 1559 ms.
H200_RESTORES = {4096: 0.209, 32768: 1.922}


def _learned(measured: list[tuple[int, float]], where: str = "cache") -> P.RestoreFit:
    """The fit after these (tokens, seconds) restores, folded as the store folds them."""
    moments: dict[str, Figure | None] = dict.fromkeys(P.FIT_MOMENTS)
    for n_tokens, seconds in measured:
        for name, sample in P.fit_samples(P.snapshot_bytes(n_tokens, LLAMA8B_PER_TOKEN), seconds).items():
            moments[name] = P.fold(moments[name], sample)
    fit = P.restore_fit({k: v for k, v in moments.items() if v is not None})
    assert fit is not None
    return fit


def _estimate(n_tokens: int, fit: P.RestoreFit | None, **kw) -> float | None:
    engine_rate = Figure(4000.0, 3)  # the engine's own MB/s: the estimate before the fit
    return P.restore_estimate(
        inputs(
            n_tokens=n_tokens,
            file_bytes=P.snapshot_bytes(n_tokens, LLAMA8B_PER_TOKEN),
            restore_cache_mb_s=engine_rate,
            restore_cache_fit=fit,
            **kw,
        )
    )


def test_one_measured_restore_makes_its_size_exact():
    fit = _learned([(4096, H200_RESTORES[4096])])
    assert _estimate(4096, fit) == pytest.approx(0.209, rel=0.01)
    # Without the fit, the engine's MB/s leaves out the fixed costs: a third short at 4k.
    assert _estimate(4096, None) < 0.209 * 0.9


@pytest.mark.parametrize("order", [(4096, 32768), (32768, 4096)])
def test_two_sizes_measured_put_every_estimate_within_ten_percent(order):
    fit = _learned([(n, H200_RESTORES[n]) for n in order])
    fixed, per_mb = fit.line()
    assert per_mb > 0
    for n, taken in H200_RESTORES.items():
        assert _estimate(n, fit) == pytest.approx(taken, rel=0.10), n
    # Sizes between the two measured: on the line between them.
    assert 0.209 < _estimate(16384, fit) < 1.922


def test_the_fit_follows_a_machine_that_got_slower():
    before = [(4096, 0.209), (32768, 1.922)] * 3
    slower = [(4096, 0.300), (32768, 2.600)] * 4
    fit = _learned(before + slower)
    assert _estimate(4096, fit) == pytest.approx(0.300, rel=0.10)
    assert _estimate(32768, fit) == pytest.approx(2.600, rel=0.10)


def test_a_fixed_cost_shows_where_the_engine_rate_cannot():
    """Restores that cost 50 ms plus 2 ms per MB: the fit finds both."""
    mb = lambda n: P.snapshot_bytes(n, LLAMA8B_PER_TOKEN) / P.MB  # noqa: E731
    fit = _learned([(n, 0.050 + 0.002 * mb(n)) for n in (1024, 8192, 1024, 8192)])
    fixed, per_mb = fit.line()
    assert fixed == pytest.approx(0.050, rel=0.01) and per_mb == pytest.approx(0.002, rel=0.01)
    assert _estimate(256, fit) == pytest.approx(0.050 + 0.002 * mb(256), rel=0.10)


def test_a_part_with_no_line_falls_back_to_the_engine_figures():
    fit = _learned([(4096, 0.209)])
    # Half on disk, and no disk line yet: the engine's figures (disk measured) decide.
    mixed = _estimate(4096, fit, resident=0.5, restore_disk_mb_s=Figure(1000.0, 2))
    file_mb = P.snapshot_bytes(4096, LLAMA8B_PER_TOKEN) / P.MB
    assert mixed == pytest.approx(P.RESTORE_OVERHEAD_S + file_mb / 2 / 4000 + file_mb / 2 / 1000)


def test_the_learned_estimate_drives_the_decision():
    # Prefill measured at 4k tokens/s: 1.0 s for 4096 tokens. The engine's MB/s says restore in
    # ~0.14 s; measured restores that take 1.5 s say re-prefill.
    slow = _learned([(4096, 1.5), (4096, 1.5)])
    decision = P.decide_restore(
        inputs(
            n_tokens=4096,
            file_bytes=P.snapshot_bytes(4096, LLAMA8B_PER_TOKEN),
            prefill_tok_s=Figure(4096.0, 3),
            restore_cache_mb_s=Figure(4000.0, 3),
            restore_cache_fit=slow,
        )
    )
    assert decision.choice == "reprefill" and decision.restore_s == pytest.approx(1.5)
