"""Serve now, upgrade beside, through a real daemon: a GPU with no engine installed, no mirror
and no cached build is served on the CPU at once while its engine is built, then switched to.

The GPU is FakeGPU (tests/integration/fakegpu_plugin, installed by pip as a user installs a
plugin) and its "build" is the plugin's own builder child: it says `compile: 29%`, then waits
until the test creates the `go` file, and answers with a FakeGPU bundle (Stoker's CPU build
relabelled, the real llama-server underneath). Everything else is real: the install machine
runs the build as a child, copies, verifies and promotes the bundle, the front door holds the
request sent during the switch, and the conversation saved on the CPU is restored on FakeGPU.
"""

from __future__ import annotations

import os
import threading

import attrs
import httpx
import pytest

from stoker.daemon.bundles.archive import pack_bundle
from stoker.daemon.bundles.metadata import BUNDLE_JSON, BundleMeta
from tests.integration.daemon_harness import DaemonProcess, free_port, tiny_config, write_config
from tests.integration.test_snapshots import Engine, PROMPT, MORE
from tests.integration import test_third_party_backend as third_party
from tests.integration.test_third_party_backend import DEVICE, relabel_cpu_bundle, with_plugin
from tests.waits import wait_until

# The daemons that must not outlive the test (the FakeGPU plugin's site: tests/conftest.py).
daemons = third_party.daemons

pytestmark = [pytest.mark.engine]


def fakegpu_zip(cpu_root, where) -> None:
    """What the FakeGPU build makes: the relabelled CPU bundle as the variant a build makes."""
    bundle = where / "fakegpu-default"
    relabel_cpu_bundle(cpu_root, bundle, where / "never-lost")
    meta = attrs.evolve(BundleMeta.read(bundle), variant="default")
    (bundle / BUNDLE_JSON).write_text(meta.to_json())
    pack_bundle(bundle, where / "bundle.zip")


def chat(base: str, content: str) -> httpx.Response:
    body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(f"{base}/chat/completions", json=body, timeout=300, trust_env=False)


def building(st: dict) -> bool:
    return st["state"] == "ready" and st["fallback_state"] == "settled" and st["planned_backend"] == "cpu"


def on_fakegpu(st: dict) -> bool:
    return st["state"] == "ready" and st["fallback_state"] == "settled" and st["planned_backend"] == "fakegpu"


@pytest.mark.slow
def test_the_cpu_serves_while_the_gpu_engine_is_built_then_the_model_switches_with_its_conversation(
    stoker_home, installed_cpu_bundle, model, plugin_site, daemons, tmp_path
):
    build = tmp_path / "fakegpu-build"
    build.mkdir()
    fakegpu_zip(installed_cpu_bundle.root, build)
    d = DaemonProcess(stoker_home, env={**with_plugin(plugin_site, DEVICE), "FAKEGPU_BUILD": str(build)})
    port = free_port()
    write_config(d.paths, tiny_config(model, snapshots=True) + f"[frontdoor]\nport = {port}\n")
    base = f"http://127.0.0.1:{port}/v1"
    daemons.append(d.start())

    # At once on the CPU, while the FakeGPU build waits: the reason says a GPU engine is built.
    st = d.wait_for(building, timeout=180, what="the CPU serving while the FakeGPU engine is built")
    wait_until(lambda: (build / "started").exists(), timeout=60, what="the FakeGPU build to start")
    # The build yields the CPU to the engine that serves meanwhile.
    wait_until(lambda: (build / "started").read_text().strip(), timeout=10, what="the build's niceness")
    assert int((build / "started").read_text()) >= os.nice(0) + 10
    assert st["backend"] == "cpu" and st["fallback_reason"] == "gpu_engine_building"
    (fake,) = [f for f in st["fallbacks"] if f["backend"] == "fakegpu"]
    assert fake["reason"] == "gpu_engine_building" and fake["evidence"]["source"] == "local-build"
    answer = chat(base, "hi")
    assert answer.status_code == 200, answer.text
    st = d.wait_for(
        lambda s: any((i.get("progress") or {}).get("percent") == 29 for i in s["installs"]),
        timeout=60,
        what="the build's progress in status",
    )
    (install,) = [i for i in st["installs"] if i["backend"] == "fakegpu"]
    assert install["progress"]["phase"] == "building" and "fakegpu" in install["progress"]["line"]
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30, trust_env=False).text
    assert 'stoker_install_progress_percent{backend="fakegpu",phase="building",variant="default"} 29.0' in metrics

    # A conversation on the CPU (slot 0's cache) to be carried across the switch.
    eng = Engine(st)
    first = eng.tokenize(PROMPT)
    gen1, _ = eng.complete(first, 8)
    second = first + gen1 + eng.tokenize(MORE)
    cpu_pid = st["pid"]

    # The build ends: the planned restart; a request sent during it is held, then answered.
    (build / "go").touch()
    d.wait_for(lambda s: s["pid"] != cpu_pid or s["state"] != "ready", timeout=180, what="the switch to begin")
    held: dict = {}
    sender = threading.Thread(target=lambda: held.update(r=chat(base, "during the switch")))
    sender.start()
    st = d.wait_for(on_fakegpu, timeout=180, what="the model on FakeGPU")
    sender.join(timeout=300)
    assert held["r"].status_code == 200, held["r"].text
    assert st["fallback_reason"] != "gpu_engine_building"
    assert st["backend"] == "cpu"  # its engine is the CPU build: proven unaccelerated, truthfully
    assert st["fallback_reason"] == "fakegpu_gpu_layers_zero"
    assert "fakegpu" not in [f["backend"] for f in st["fallbacks"][:-1]]  # no longer "building"

    # The conversation saved on the CPU was restored on FakeGPU: only the new tokens are processed.
    report = st["snapshots"]
    assert len(report["restored"]) == 1 and report["restored"][0]["n_tokens"] >= len(first), report
    _, timings = Engine(st).complete(second, 4)
    assert timings["prompt_n"] <= len(second) - len(first), timings

    # History: the build's end and the switch, with its own reason and evidence.
    rows = d.history(machine="fallback")
    built = [r for r in rows if r["event"] == "EngineBuilt"]
    assert built and built[0]["reason"] == "gpu_engine_built", built
    assert any(r["event"] == "BundleMissing" and r["reason"] == "gpu_engine_building" for r in rows)
