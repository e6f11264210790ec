"""A GGUF header parsed once is not parsed again by a daemon started again (daemon/models/facts.py
keep_layouts_in): the layout is kept by path, size and mtime in a file under the data dir."""

from __future__ import annotations

import os

import pytest

from stoker.daemon.bundles.tinymodel import write_tiny_model
from stoker.daemon.models import facts


@pytest.fixture
def kept(tmp_path):
    facts.keep_layouts_in(tmp_path / "gguf-headers.json")
    facts._LAYOUTS.clear()
    yield tmp_path / "gguf-headers.json"
    facts.keep_layouts_in(None)
    facts._LAYOUTS.clear()


def test_a_layout_parsed_once_is_read_back_not_parsed(kept, tmp_path, monkeypatch):
    model = write_tiny_model(tmp_path / "tiny.gguf")
    first = facts.read_layout(model)
    assert oct(os.stat(kept).st_mode & 0o777) == "0o600"
    facts._LAYOUTS.clear()  # a daemon started again: nothing in memory

    def no_parse(path):
        raise AssertionError("parsed again")

    monkeypatch.setattr(facts, "_read_layout", no_parse)
    again = facts.read_layout(model)
    assert again == first and again.array_lengths == first.array_lengths
    assert facts.model_facts(model) == facts.facts_from_header(dict(first.meta))

    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # another mtime: parsed again
    with pytest.raises(AssertionError, match="parsed again"):
        facts.read_layout(model)


def test_a_kept_file_that_is_not_one_is_parsed_past(kept, tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf")
    st = model.stat()
    kept.write_text('{"%s|%d|%d": {"meta": 3}}' % (model, st.st_size, st.st_mtime_ns))
    assert facts.read_layout(model).tensor_offsets
