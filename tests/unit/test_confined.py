"""Paths named from outside stay under their root once resolved (daemon/core/confined.py)."""

from __future__ import annotations

import pytest

from stoker.daemon.core.confined import confined, inside, not_plain, strictly_inside
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode


@pytest.mark.parametrize(
    "name",
    [
        "../x.gguf",
        "a/../../x.gguf",
        "a/./x.gguf",
        "a//x.gguf",
        "/etc/x.gguf",
        "C:/x.gguf",
        "a\\x.gguf",
        "a\0b",
        "",
        "a/",
    ],
)
def test_names_that_are_not_plain_relative_paths_are_refused_before_any_join(tmp_path, name):
    assert not_plain(name) is not None
    with pytest.raises(StokerError) as err:
        confined(tmp_path, name, reason=ReasonCode.PULL_UNSAFE_PATH, what="The test")
    assert err.value.reason is ReasonCode.PULL_UNSAFE_PATH and "Nothing was written" in err.value.message
    assert err.value.evidence["root"] == str(tmp_path)


def test_a_plain_name_through_a_link_that_leads_out_is_refused_after_resolution(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "a" / "link").symlink_to(outside, target_is_directory=True)
    assert not_plain("a/link/x.gguf") is None  # the text alone looks fine
    with pytest.raises(StokerError) as err:
        confined(root, "a/link/x.gguf", reason=ReasonCode.BUNDLE_UNSAFE_ARCHIVE, what="The test")
    assert "symbolic link" in err.value.message


def test_a_plain_name_inside_is_joined_in_the_roots_own_spelling(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)  # a models dir reached through a link
    path = confined(tmp_path / "alias", "hf/org/repo/x.gguf", reason=ReasonCode.PULL_UNSAFE_PATH, what="The test")
    assert path == tmp_path / "alias" / "hf" / "org" / "repo" / "x.gguf"


def test_inside_compares_resolved_paths_not_text(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    climbing = root / "hf" / ".." / ".." / "victim.gguf"
    assert root in climbing.parents  # what the text comparison said
    assert not inside(root, climbing) and not strictly_inside(root, climbing)
    assert inside(root, root) and not strictly_inside(root, root)
    assert strictly_inside(root, root / "hf" / ".." / "x.gguf")
