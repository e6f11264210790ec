"""resolve_model: what a user reads when server.model is not a loadable GGUF file (a path).

Catalog names: tests/unit/test_model_lookup.py."""

from __future__ import annotations

import os

import pytest

from stoker.daemon.core.errors import StokerError
from stoker.daemon.models.resolve import resolve_model
from stoker.states.reasons import ReasonCode


@pytest.fixture
def paths():
    return None  # paths are checked where they are: nothing of STOKER_HOME is read


def refused(spec, paths) -> StokerError:
    with pytest.raises(StokerError) as err:
        resolve_model(str(spec))
    return err.value


def test_a_gguf_file_resolves_to_its_absolute_path(tmp_path, paths):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    assert resolve_model(str(model)).path == model.absolute()


def test_nothing_there_is_model_missing(tmp_path, paths):
    err = refused(tmp_path / "absent.gguf", paths)
    assert err.reason == ReasonCode.MODEL_MISSING and "does not exist" in err.message


def test_a_dangling_link_names_its_target(tmp_path, paths):
    link = tmp_path / "m.gguf"
    link.symlink_to(tmp_path / "gone.gguf")
    err = refused(link, paths)
    assert err.reason == ReasonCode.MODEL_MISSING and "gone.gguf" in err.message


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda tmp: tmp, "directory"),
        (lambda tmp: "/dev/zero", "character device"),
        (lambda tmp: (os.mkfifo(tmp / "pipe.gguf"), tmp / "pipe.gguf")[1], "named pipe (FIFO)"),
    ],
    ids=["directory", "dev-zero", "fifo"],
)
def test_something_that_is_not_a_file_says_what_it_is(tmp_path, paths, make, kind):
    """These paths exist; "does not exist" sent users looking for a typo.
    The FIFO is refused without opening it (an open would block until a writer comes)."""
    err = refused(make(tmp_path), paths)
    assert err.reason == ReasonCode.MODEL_LOAD_FAILED
    assert f"is a {kind}, not a model file" in err.message and "does not exist" not in err.message
    assert err.evidence["kind"] == kind


def test_a_file_that_is_not_gguf_names_its_magic(tmp_path, paths):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"PK\x03\x04rest")
    err = refused(model, paths)
    assert err.reason == ReasonCode.MODEL_LOAD_FAILED and "not a GGUF file" in err.message
