"""`stoker use` writes `[backend] prefer` into the config file and keeps the rest of it."""

from __future__ import annotations

import pytest

from stoker.daemon.config.model import ConfigError, load_config
from stoker.daemon.config.edit import set_backend_prefer, write_preference


def test_replaces_the_key_in_place_and_keeps_comments():
    text = '# mine\n[server]\nport = 8123 # keep\n\n[backend]\n# why\nprefer = "auto"\ncpu_variant = "compat"\n'
    out = set_backend_prefer(text, "cuda")
    assert out == text.replace('prefer = "auto"', 'prefer = "cuda"')


def test_adds_the_key_or_the_section():
    assert set_backend_prefer('[backend]\ncpu_variant = "avx2"\n[server]\nport = 1\n', "cpu") == (
        '[backend]\nprefer = "cpu"\ncpu_variant = "avx2"\n[server]\nport = 1\n'
    )
    assert set_backend_prefer("[server]\nport = 1\n", "metal") == '[server]\nport = 1\n\n[backend]\nprefer = "metal"\n'
    assert set_backend_prefer("", "auto") == '[backend]\nprefer = "auto"\n'


def test_write_is_atomic_and_validated(tmp_path):
    path = tmp_path / "config.toml"
    write_preference(path, "rocm")
    assert load_config(path).backend.prefer == "rocm"
    path.write_text("[server]\nport = 99999\n")  # already invalid: never rewritten
    with pytest.raises(ConfigError):
        write_preference(path, "cpu")
    assert path.read_text() == "[server]\nport = 99999\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]
