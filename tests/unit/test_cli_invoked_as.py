"""Hints name the command as the user installed it: `stoker` when PATH finds this one, else the path typed."""

from __future__ import annotations

import sys

from stoker.daemon.cli.output import invoked_as, invoked_path


def test_hints_say_stoker_only_when_path_finds_this_one(tmp_path, monkeypatch):
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "stoker"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["venv/bin/stoker", "run"])
    monkeypatch.setenv("PATH", "/usr/bin")
    assert invoked_path() == exe
    assert invoked_as() == "venv/bin/stoker"  # not on PATH: the path as the user typed it
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin")
    assert invoked_as() == "stoker"
    monkeypatch.setattr(sys, "argv", ["-m", "run"])  # python -m stoker.daemon
    assert invoked_as().endswith("-m stoker.daemon")
