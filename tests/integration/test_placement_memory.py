"""Memory-aware placement with the real engine and its own fitter: a real daemon, real
llama-servers, the bundle's llama-fit-params.

Expected figures are derived from the model files here, never written down: the projection by
running the installed bundle's llama-fit-params on the file ourselves (and reading its Host line
with a split, not Stoker's parser), the engine's reading from the buffer lines of the server's own
log, Stoker's estimate from the file's size and the KV geometry the model was written with.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.daemon.bundles.tinymodel import write_tiny_model
from tests.integration.daemon_harness import DaemonProcess, free_port, servers_for, tiny_config, write_config
from tests.integration.test_frontdoor import sdk
from tests.integration.test_several_models import models_of, wait_model

pytestmark = [pytest.mark.engine]

openai = pytest.importorskip("openai")

MIB = 2**20
CTX = 256  # tiny_config's ctx_size
_BUFFER = re.compile(r"(\S+)\s+(model|KV|compute|output|RS) buffer size =\s*([\d.]+) MiB")


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    """Two 22 MB models (n_embd 512): the same size, other weights."""
    alpha = write_tiny_model(tmp_path / "alpha" / "alpha.gguf", n_embd=512, n_head=4)
    beta = write_tiny_model(tmp_path / "beta" / "beta.gguf", n_embd=512, n_head=4, seed=7)
    return alpha, beta


@pytest.fixture
def no_server_left(daemon, pair):
    yield
    daemon.stop()
    leftovers = [proc for path in pair for proc in servers_for(path)]
    for proc in leftovers:
        proc.kill()
    assert not leftovers, f"servers left behind: {[p.pid for p in leftovers]}"


def fitter_projection(bundle_root: Path, model: Path) -> float:
    """The Host line of `llama-fit-params --fit-print on` for the model at the tests' context, summed."""
    done = subprocess.run(
        [str(bundle_root / "bin" / "llama-fit-params"), "-m", str(model), "-c", str(CTX), "-ngl", "0"]
        + ["--fit-print", "on"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=bundle_root,
    )
    host = [line.split() for line in done.stdout.splitlines() if line.startswith("Host ")]
    assert done.returncode == 0 and host, done.stdout + done.stderr
    return float(sum(int(x) for x in host[0][1:]))


def engine_buffers(log_path: str) -> float:
    """What the server's own log says it allocated (its last launch's buffer lines), in MiB."""
    text = Path(log_path).read_text(errors="replace")
    last = text[text.rfind("==== stoker: launch") :]
    return sum(float(m.group(3)) for m in _BUFFER.finditer(last))


def configure(
    daemon: DaemonProcess, alpha: Path, beta: Path, placement: str, port: int = 0, **frontdoor: object
) -> str:
    port = port or free_port()
    text = (
        tiny_config(alpha)
        + f"[placement]\nmax_loaded = 4\n{placement}"
        + f'[models.alpha]\nmodel = "{alpha}"\ndefault = true\n'
        + f'[models.beta]\nmodel = "{beta}"\n'
        + "[frontdoor]\n"
        + "\n".join(f"{k} = {v}" for k, v in {"port": port, **frontdoor}.items())
        + "\n"
    )
    write_config(daemon.paths, text)
    return f"http://127.0.0.1:{port}/v1"


def test_a_memory_cap_unloads_the_idle_model_with_the_figures_that_decided(
    daemon, installed_cpu_bundle, pair, no_server_left
):
    alpha, beta = pair
    need = fitter_projection(installed_cpu_bundle.root, beta)
    assert need == fitter_projection(installed_cpu_bundle.root, alpha) > 0
    cap = int(need * 1.5)  # one fits, two do not
    base = configure(daemon, alpha, beta, f"max_ram_mib = {cap}\n")
    daemon.start()
    wait_model(daemon, "alpha", "ready")
    client = sdk(base)
    client.completions.create(model="alpha", prompt="The", max_tokens=2)

    st = daemon.call("status", model="alpha")
    memory = models_of(daemon)["alpha"]["memory"]
    # Its plan's estimate is the fitter's, with the figures we read ourselves; once ready, what
    # placement counts is the engine's own buffers, as its log states them.
    assert memory["estimate"]["source"] == "llama-fit-params" and not memory["estimate"]["partial"]
    assert memory["estimate"]["ram_mib"] == need and memory["estimate"]["vram_mib"] == 0
    assert memory["placed"]["reading"] == "engine"
    used = engine_buffers(st["log_path"])
    assert memory["placed"]["ram_mib"] == pytest.approx(used, abs=0.11)
    assert used + need > cap  # so beta must evict alpha

    client.completions.create(model="beta", prompt="The", max_tokens=2)  # alpha is unloaded first
    models = models_of(daemon)
    assert models["beta"]["state"] == "ready"
    assert models["alpha"]["state"] == "stopped" and models["alpha"]["down_cause"] == "evicted"
    assert not servers_for(alpha)
    evicted = [r for r in daemon.history(machine="launch:alpha", limit=50) if r["reason"] == "placement_evicted"]
    assert len(evicted) == 1
    ev = evicted[0]["evidence"]
    assert ev["for"] == "beta" and ev["victims"] == ["alpha"] and ev["max_ram_mib"] == cap
    assert ev["need"] == {"ram_mib": need, "vram_mib": 0.0, "reading": "llama-fit-params", "partial": False}
    assert ev["used_ram_mib"] == pytest.approx(used, abs=0.11)
    assert ev["short"]["ram_cap"] == pytest.approx(used + need - cap, abs=0.11)
    (loaded,) = ev["loaded"]
    assert loaded["name"] == "alpha" and loaded["memory"]["reading"] == "engine"

    # The CLI says which estimate answered, and the cap.
    text = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "status"], env=daemon.env, capture_output=True, text=True, timeout=60
    ).stdout
    assert f"holding at most ram {cap} MiB" in text and f"fit {need:.0f} MiB" in text, text


def test_a_cap_too_small_for_any_model_refuses_with_the_figures_and_loses_nothing(
    daemon, installed_cpu_bundle, pair, no_server_left
):
    alpha, beta = pair
    need = fitter_projection(installed_cpu_bundle.root, alpha)
    cap = int(need) - 1
    base = configure(daemon, alpha, beta, f"max_ram_mib = {cap}\n", hold_timeout_s=10)
    daemon.start()
    st = wait_model(daemon, "alpha", "failed")  # the default's autostart: no room even alone
    alpha_row = next(m for m in st["models"] if m["name"] == "alpha")
    assert alpha_row["reason"] == "placement_no_room" and alpha_row["loads_on_demand"]
    assert f"max_ram_mib = {cap}" in alpha_row["message"] and f"{need:.0f} MiB of RAM" in alpha_row["message"]
    assert not servers_for(alpha)

    client = sdk(base)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="beta", prompt="The", max_tokens=2)
    assert refused.value.status_code == 503 and refused.value.code == "placement_no_room"
    assert refused.value.response.headers["retry-after"] == "5"
    assert f"max_ram_mib = {cap}" in refused.value.message
    failed = [r for r in daemon.history(machine="launch:beta", limit=20) if r["reason"] == "placement_no_room"]
    assert failed and failed[0]["evidence"]["need"]["ram_mib"] == need
    assert failed[0]["evidence"]["short_after_evicting_all"] == {"ram_cap": need - cap}

    # Nothing was lost: with the cap raised (hot reload), the same request is answered.
    configure(daemon, alpha, beta, f"max_ram_mib = {int(need) + 1}\n", int(base.split(":")[-1].split("/")[0]))
    daemon.wait_for(lambda s: s.get("memory_caps", {}).get("max_ram_mib") == int(need) + 1, 30, "the new cap")
    reply = client.completions.create(model="beta", prompt="The", max_tokens=2)
    assert reply.model == "beta"


def test_without_the_fitter_stoker_estimates_and_says_so(daemon, installed_cpu_bundle, model):
    # A bundle built before the fitter was bundled: no tools in bundle.json, no program.
    root = installed_cpu_bundle.root
    meta_path = root / "bundle.json"
    meta = json.loads(meta_path.read_text())
    tool = meta.pop("tools")["fit_params"]
    meta["files"] = [f for f in meta["files"] if f["path"] != tool]
    meta.pop("rpc_protocol", None)
    meta_path.write_text(json.dumps(meta))
    (root / tool).unlink()

    daemon.start()
    daemon.wait_state("ready")
    (row,) = models_of(daemon).values()
    estimate = row["memory"]["estimate"]
    assert estimate["source"] == "stoker" and estimate["partial"]
    assert "has no llama-fit-params" in estimate["detail"]
    # The file's size plus the f16 KV cache the tiny model was written with: 2 layers x 2 KV heads
    # x (64 + 64) x 2 bytes per token, at the context.
    kv = 2 * 2 * (64 + 64) * 2 * CTX / MIB
    assert estimate["ram_mib"] == round(model.stat().st_size / MIB + kv, 1)
    assert row["memory"]["placed"]["reading"] == "engine"  # once ready, the engine's own figures count
