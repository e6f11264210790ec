"""The GGUF header reader reads only what the file holds: every hostile header of the corpus
(tests/hostile_gguf.py) is refused as no GGUF the engine can load, fast, with no exception but
that one, at each place that reads it: the reader, the pull's inspection (pull_not_gguf) and the
reload's pre-check (model_load_failed)."""

from __future__ import annotations

import time

import pytest

from stoker.daemon.core.errors import StokerError
from stoker.daemon.models.check import model_problem
from stoker.daemon.models.facts import GGUFError, read_layout
from stoker.daemon.models.header import header_facts
from stoker.states.reasons import ReasonCode
from stoker.store.catalog import ModelCatalog
from tests.hostile_gguf import ARCH, corpus, gguf, tensor, write_corpus

CASES = sorted(corpus())


def test_the_corpus_holds_at_least_fifteen_kinds_of_hostile_header():
    assert len(CASES) >= 15


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_header_is_refused_by_the_reader_in_bounded_time(tmp_path, case):
    path = write_corpus(tmp_path)[case]
    started = time.perf_counter()
    with pytest.raises(GGUFError):
        read_layout(path)
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_header_is_not_a_gguf_to_a_pull(tmp_path, case):
    path = write_corpus(tmp_path)[case]
    with pytest.raises(StokerError) as err:
        header_facts(path)
    assert err.value.reason is ReasonCode.PULL_NOT_GGUF


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_header_is_refused_by_the_reload_check(tmp_path, case, stoker_home):
    from stoker.daemon.core.paths import StokerPaths
    from stoker.store import open_store

    paths = StokerPaths.from_env()
    paths.make_private()
    store = open_store(paths.db_file)
    try:
        reason, sentence = model_problem(str(write_corpus(tmp_path)[case]), ModelCatalog(store))
    finally:
        store.close()
    assert reason is ReasonCode.MODEL_LOAD_FAILED
    assert sentence is not None and "not a GGUF file the engine can load" in sentence or "is not a GGUF" in sentence


def test_the_reload_check_turns_any_failure_into_a_refusal_not_a_crash(tmp_path, monkeypatch, stoker_home):
    from stoker.daemon.core.paths import StokerPaths
    from stoker.daemon.models import check
    from stoker.store import open_store

    def broken(path):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(check, "read_header", broken)
    good = tmp_path / "good.gguf"
    good.write_bytes(gguf([ARCH], [tensor("t", [4])]))
    paths = StokerPaths.from_env()
    paths.make_private()
    store = open_store(paths.db_file)
    try:
        reason, sentence = model_problem(str(good), ModelCatalog(store))
    finally:
        store.close()
    assert reason is ReasonCode.MODEL_LOAD_FAILED and "RecursionError" in (sentence or "")


def test_a_well_formed_header_still_reads(tmp_path):
    path = tmp_path / "fine.gguf"
    path.write_bytes(gguf([ARCH], [tensor("a", [4, 2]), tensor("b", [8], offset=32)]))
    layout = read_layout(path)
    assert layout.meta["general.architecture"] == "llama"
    assert layout.tensor_offsets == (0, 32) and layout.n_params == 16
