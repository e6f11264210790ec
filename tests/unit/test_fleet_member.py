"""A fleet member's answers about itself that status and the catalog read: which catalog entry it
serves, and its machines (daemon/fleet/member.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from stoker.daemon.config.model import Config
from stoker.daemon.config.instances import ServedModel
from stoker.daemon.fleet.member import Member
from stoker.daemon.fleet.usage import ChangeSignal, Usage
from stoker.daemon.launch.instance import ServerInstance
from stoker.states.launch import records as LR
from stoker.store.catalog import ModelRecord


@attrs.define
class Supervisor:
    """What `Member.serves` and `Member.machines` read of its supervisor."""

    instance: ServerInstance
    data: LR.LaunchData = attrs.field(factory=LR.LaunchData)


def member(name: str, spec: str, plan_path: str | None = None) -> Member:
    plan = LR.LaunchPlan("cpu", "x86-64", "/b", "/b/llama-server", plan_path) if plan_path else None
    supervisor: Any = Supervisor(ServerInstance(name), LR.LaunchData(plan=plan))
    config = Config()
    served = ServedModel(name, attrs.evolve(config, server=attrs.evolve(config.server, model=spec)))
    # Only what these answers read; any other service a member holds is not asked here.
    others = {f.name: None for f in attrs.fields(Member) if f.default is attrs.NOTHING}
    others.update(served=served, supervisor=supervisor, usage=Usage(), change_signal=ChangeSignal())
    return Member(**others)


def record(name: str, path: Path) -> ModelRecord:
    return ModelRecord(
        name=name,
        spec=str(path),
        source="local",
        origin=str(path),
        revision=None,
        path=str(path),
        size=1,
        sha256="0" * 64,
        owned=False,
        architecture=None,
        parameters=None,
        quantization=None,
        context_length=None,
        chat_template=None,
        facts={},
        pulled_at=0.0,
    )


def test_a_member_serves_the_entry_it_names_or_whose_file_it_runs(tmp_path, monkeypatch):
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF")
    link = tmp_path / "link.gguf"
    link.symlink_to(file)
    entry = record("smol", file)
    assert member("chat", "smol").serves(entry)  # configured by its catalog name
    assert not member("chat", "other-name").serves(entry)
    assert member("code", str(link)).serves(entry)  # the same file by another path
    monkeypatch.setenv("HOME", str(tmp_path))
    assert member("code", "~/m.gguf").serves(entry)
    # A name that resolved to the entry's file (a well-known name pulled under another name).
    assert member("chat", "smollm2-135m-instruct", plan_path=str(file)).serves(entry)
    assert not member("chat", str(tmp_path / "else.gguf")).serves(entry)


def test_a_members_machines_are_its_instances():
    assert member("default", "m").machines == ("launch", "fallback")
    assert member("chat", "m").machines == ("launch:chat", "fallback:chat")
