"""The front door's promise (hold, don't fail): clients never see a restart.

Several clients of the official `openai` SDK (max_retries=0: the SDK's own retries must not
hide a failure of ours) send streamed and non-streamed chat requests in a loop through the
front door of a real daemon and llama-server, while:

  a) the engine is killed with SIGKILL, several times;
  b) the config changes the model's context size (a hot reload that relaunches the server);
  c) a GPU plan fails at start and the daemon falls back to the CPU (FakeGPU, the third-party
     backend of tests/integration/fakegpu_plugin, wins the plan and its engine dies loading);
  d) `stoker restart`, several times.

The promise: no request that had not started streaming fails (each gets its full answer; a
503 with Retry-After and a reason would be allowed only past the bound, and the hold time is
generous here so that none may happen); a stream cut midway ends with the SSE error event
naming `engine_stream_cut` and is counted apart, never a hang. Each scenario prints what it
measured: requests sent, succeeded, cut midway, failed, and the longest wait (send to first
byte of the answer). Reproduce the figures of docs/reliability.md with:

    .venv/bin/python -m pytest -p no:cacheprovider -s tests/faults/test_frontdoor_promise.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Callable

import attrs
import httpx
import pytest

from stoker.daemon.bundles.tinymodel import write_tiny_model
from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config
from tests.integration.daemon_harness import free_port
from tests.integration.test_frontdoor_client_leaves import busy_slots
from tests.integration.test_third_party_backend import (  # noqa: F401  (daemons: a fixture)
    daemons,
    relabel_cpu_bundle,
    settled,
    stoker,
    with_plugin,
)
from tests.waits import wait_until

pytestmark = [pytest.mark.engine]

openai = pytest.importorskip("openai")

CLIENTS = 4  # concurrent clients, each alternating streamed and non-streamed requests
MAX_TOKENS = 128
HOLD_TIMEOUT_S = 90  # generous: no request may reach it here
CLIENT_TIMEOUT_S = 150  # longer than the hold: a request still unanswered then is a hang
MESSAGES = [{"role": "user", "content": "Count from one to twenty."}]


@attrs.define
class Outcome:
    kind: str  # "stream" | "plain"
    result: str  # "ok" | "cut" | "failed"
    wait_s: float  # from send to the first byte of the answer (a plain request: its whole answer)
    detail: str = ""


@attrs.define
class Load:
    """CLIENTS threads sending requests through the front door until stopped."""

    base_url: str
    outcomes: list[Outcome] = attrs.Factory(list)
    stop: threading.Event = attrs.Factory(threading.Event)
    threads: list[threading.Thread] = attrs.Factory(list)
    lock: threading.Lock = attrs.Factory(threading.Lock)

    def start(self) -> "Load":
        for index in range(CLIENTS):
            thread = threading.Thread(target=self._client, args=(index,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def finish(self) -> list[Outcome]:
        self.stop.set()
        for thread in self.threads:
            thread.join(CLIENT_TIMEOUT_S + 10)
        hung = [t for t in self.threads if t.is_alive()]
        assert not hung, f"{len(hung)} clients never came back (a hang)"
        return list(self.outcomes)

    def succeeded(self) -> int:
        with self.lock:
            return sum(o.result == "ok" for o in self.outcomes)

    def wait_answers(self, count: int, timeout: float = 120.0) -> None:
        """Return once `count` more requests have succeeded (the load really runs)."""
        target = self.succeeded() + count
        wait_until(
            lambda: self.succeeded() >= target,
            timeout=timeout,
            what=f"{count} more answers",
            tick=0.02,
            detail=lambda: f"{self.summary()}",
        )

    def summary(self) -> Counter:
        with self.lock:
            return Counter(o.result for o in self.outcomes)

    def _client(self, index: int) -> None:
        client = openai.OpenAI(
            base_url=self.base_url,
            api_key="none",
            max_retries=0,
            timeout=CLIENT_TIMEOUT_S,
            http_client=openai.DefaultHttpxClient(trust_env=False),
        )
        sent = 0
        while not self.stop.is_set():
            stream = (index + sent) % 2 == 0
            outcome = self._streamed(client) if stream else self._plain(client)
            with self.lock:
                self.outcomes.append(outcome)
            sent += 1

    @staticmethod
    def _plain(client) -> Outcome:
        began = time.monotonic()
        try:
            reply = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=MAX_TOKENS)
        except openai.APIError as exc:
            return Outcome("plain", "failed", time.monotonic() - began, describe(exc))
        wait = time.monotonic() - began
        if not reply.choices or reply.choices[0].finish_reason is None:
            return Outcome("plain", "failed", wait, f"incomplete answer: {reply}")
        return Outcome("plain", "ok", wait)

    @staticmethod
    def _streamed(client) -> Outcome:
        began = time.monotonic()
        first: float | None = None
        finished = False
        try:
            for chunk in client.chat.completions.create(
                model="default", messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True
            ):
                first = time.monotonic() - began if first is None else first
                finished = finished or any(c.finish_reason for c in chunk.choices)
        except openai.APIError as exc:
            wait = first if first is not None else time.monotonic() - began
            if getattr(exc, "code", None) == "engine_stream_cut" and first is not None:
                return Outcome("stream", "cut", wait, describe(exc))
            return Outcome("stream", "failed", wait, describe(exc))
        wait = first if first is not None else time.monotonic() - began
        if not finished:  # ended without its finish_reason and without an error event: truncated
            return Outcome("stream", "failed", wait, "the stream ended without finish_reason or an error event")
        return Outcome("stream", "ok", wait)


def describe(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    code = getattr(exc, "code", None)
    return f"{type(exc).__name__} status={status} code={code}: {exc}"[:300]


def report(name: str, outcomes: list[Outcome]) -> dict[str, float]:
    """Print (and return) what the scenario measured."""
    counts = Counter(o.result for o in outcomes)
    figures = {
        "sent": len(outcomes),
        "succeeded": counts["ok"],
        "cut": counts["cut"],
        "failed": counts["failed"],
        "longest_wait_s": round(max((o.wait_s for o in outcomes), default=0.0), 2),
    }
    line = "  ".join(f"{k}={v}" for k, v in figures.items())
    sys.__stdout__.write(f"\n[frontdoor promise] {name}: {line}\n")
    for o in outcomes:
        if o.result != "ok":
            sys.__stdout__.write(f"    {o.kind} {o.result} after {o.wait_s:.2f} s: {o.detail}\n")
    sys.__stdout__.flush()
    return figures


def check_promise(name: str, outcomes: list[Outcome], *, planned: bool = False) -> dict[str, float]:
    """No request failed; where every stop was planned (a reload, a restart, a fallback's new
    plan), no stream was cut either: a planned stop lets the requests in flight finish first."""
    figures = report(name, outcomes)
    failed = [o for o in outcomes if o.result == "failed"]
    assert not failed, f"{name}: {len(failed)} failed requests: {[f.detail for f in failed][:5]}"
    assert figures["succeeded"] >= CLIENTS, figures
    if planned:
        assert figures["cut"] == 0, f"{name}: streams cut by a planned stop: {figures}"
    return figures


def frontdoor_section(port: int, **extra: object) -> str:
    """`[frontdoor]` on `port` with a generous hold, and `extra` keys."""
    keys = {"port": port, "hold_timeout_s": HOLD_TIMEOUT_S, **extra}
    return "[frontdoor]\n" + "".join(f"{key} = {value}\n" for key, value in keys.items())


def start_with_frontdoor(daemon: DaemonProcess, config: str, **frontdoor: object) -> str:
    """Write `config` with the front door on a free port and a generous hold (and `frontdoor`'s
    keys); start; its /v1 URL."""
    port = free_port()
    write_config(daemon.paths, config + frontdoor_section(port, **frontdoor))
    daemon.start()
    return f"http://127.0.0.1:{port}/v1"


def under_load(base_url: str, disturb: Callable[[Load], None]) -> list[Outcome]:
    load = Load(base_url).start()
    try:
        load.wait_answers(CLIENTS)
        disturb(load)
        load.wait_answers(2 * CLIENTS)  # served again after the last disturbance
    finally:
        outcomes = load.finish()
    return outcomes


def next_server(daemon: DaemonProcess, old_pid: int, timeout: float = 120.0) -> dict:
    return daemon.wait_for(
        lambda s: s["state"] == "ready" and s["pid"] not in (None, old_pid), timeout, "the next server ready"
    )


# --- a) SIGKILL ---------------------------------------------------------------------------------


def test_killed_engine(daemon, model):
    kills = 4
    config = tiny_config(model).replace("max_restarts = 3", f"max_restarts = {kills + 2}")
    base = start_with_frontdoor(daemon, config)
    pid = daemon.wait_state("ready")["pid"]

    def disturb(load: Load) -> None:
        nonlocal pid
        for _ in range(kills):
            load.wait_answers(CLIENTS)
            os.kill(pid, signal.SIGKILL)
            pid = next_server(daemon, pid)["pid"]

    check_promise("a) kill -9 x4", under_load(base, disturb))


def test_killed_again_before_the_held_requests_are_answered(daemon, model):
    """Killed 60 ms after each relaunch: requests held through one kill and sent to the next
    server die with it too. They were retried only once: 6 of 46 got 502 engine_unreachable
    while the daemon relaunched within a second each time. An engine killed from outside
    (SIGKILL) cannot have been killed by the request: such a request is sent again."""
    kills = 6
    config = tiny_config(model).replace("max_restarts = 3", f"max_restarts = {kills + 2}")
    base = start_with_frontdoor(daemon, config)
    pid = daemon.wait_state("ready")["pid"]

    def disturb(load: Load) -> None:
        nonlocal pid
        for _ in range(kills):
            time.sleep(0.06)
            os.kill(pid, signal.SIGKILL)
            pid = next_server(daemon, pid)["pid"]

    check_promise("a2) kill -9 x6, 60 ms after each ready", under_load(base, disturb))


# --- b) a hot reload that changes the context ----------------------------------------------------


def test_context_change_relaunch(daemon, model):
    base = start_with_frontdoor(daemon, tiny_config(model))
    pid = daemon.wait_state("ready")["pid"]
    port = base.split(":")[2].split("/")[0]

    def disturb(load: Load) -> None:
        nonlocal pid
        for ctx in (512, 1024, 256):
            load.wait_answers(CLIENTS)
            text = tiny_config(model, ctx_size=ctx) + f"[frontdoor]\nport = {port}\nhold_timeout_s = {HOLD_TIMEOUT_S}\n"
            write_config(daemon.paths, text)
            pid = next_server(daemon, pid)["pid"]
            assert daemon.call("status")["n_ctx"] == ctx

    check_promise("b) context change x3", under_load(base, disturb), planned=True)


# --- c) a GPU plan that fails at start, then the CPU ---------------------------------------------


def test_gpu_plan_fails_and_falls_back(
    stoker_home,
    installed_cpu_bundle,
    model,
    plugin_site,
    daemons,  # noqa: F811  (the imported fixture)
    tmp_path,
):
    lost = tmp_path / "fakegpu-device-lost"
    lost.touch()  # FakeGPU's engine dies while loading: its plan fails at start
    d = DaemonProcess(stoker_home, env=with_plugin(plugin_site, "FakeGPU 9000:8192"))
    relabel_cpu_bundle(installed_cpu_bundle.root, tmp_path / "fakegpu-bundle", lost)
    done = stoker(d.env, "bundle", "install", str(tmp_path / "fakegpu-bundle"), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    base = start_with_frontdoor(d, tiny_config(model))
    daemons.append(d)

    def disturb(load: Load) -> None:
        # The clients started with the daemon: held through FakeGPU's failed start and the fallback.
        st = d.wait_for(settled, 120, "the CPU after FakeGPU's failed start")
        for _ in range(2):  # a restart plans FakeGPU again: it fails again, the CPU serves again
            assert st["planned_backend"] == "cpu", st
            assert {f["backend"]: f["reason"] for f in st["fallbacks"]}.get("fakegpu") == "fakegpu_startup_failed"
            load.wait_answers(CLIENTS)
            d.call("restart")
            st = d.wait_for(lambda s: settled(s) and s["pid"] != st["pid"], 120, "the CPU again")
        failed_starts = [r for r in d.history(machine="fallback", limit=500) if r["reason"] == "fakegpu_startup_failed"]
        assert len(failed_starts) >= 3, "FakeGPU's plan failed at every start"

    load = Load(base).start()  # before the daemon has planned anything
    try:
        disturb(load)
        load.wait_answers(2 * CLIENTS)
    finally:
        outcomes = load.finish()
    check_promise("c) GPU plan fails, CPU fallback x3", outcomes, planned=True)


# --- d) a planned restart ----------------------------------------------------------------------


def test_planned_restart(daemon, model):
    base = start_with_frontdoor(daemon, tiny_config(model))
    pid = daemon.wait_state("ready")["pid"]

    def disturb(load: Load) -> None:
        nonlocal pid
        for _ in range(3):
            load.wait_answers(CLIENTS)
            done = subprocess.run(
                [sys.executable, "-m", "stoker.daemon", "restart", "--json"],
                env=daemon.env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            pid = next_server(daemon, pid)["pid"]

    check_promise("d) stoker restart x3", under_load(base, disturb), planned=True)


# --- the regressions the scenarios found ---------------------------------------------------------


def sdk(base_url: str):
    return openai.OpenAI(
        base_url=base_url,
        api_key="none",
        max_retries=0,
        timeout=CLIENT_TIMEOUT_S,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )


def test_a_request_sent_as_the_front_door_opens_is_held_not_refused(daemon, model):
    """The front door listened before the daemon asked for the first server: a client that
    connected at once (a UI retrying while the daemon starts) got 503 frontdoor_server_down
    and was told to come back in 30 s."""
    port = free_port()
    write_config(daemon.paths, tiny_config(model) + f"[frontdoor]\nport = {port}\n")
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 4}
    with httpx.Client(trust_env=False, timeout=CLIENT_TIMEOUT_S) as client:  # built first: the window is short
        daemon.start(wait=False)
        deadline = time.monotonic() + 30
        while True:  # as a client retrying its connection does, at once
            assert time.monotonic() < deadline, "the front door never opened"
            try:
                answer = client.post(url, json=body)
                break
            except httpx.ConnectError:
                time.sleep(0.001)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] is not None


@pytest.fixture
def long_model(tmp_path):
    """A tiny model with room for a long answer: a stream that lasts seconds on 2 cores."""
    return write_tiny_model(tmp_path / "long.gguf", n_layer=4, n_embd=512, n_head=8, n_ctx=4096)


def test_a_planned_restart_lets_the_stream_in_flight_finish(daemon, long_model):
    """`stoker restart` stopped the server under a stream: llama-server, given TERM with a
    request in flight, hangs until the KILL after stop_grace (3 s here, 10 s by default); the
    stream was cut and the requests held meanwhile waited that long. A planned stop now waits
    for the front door's requests in flight (bounded by [frontdoor] drain_timeout_s), then stops
    an idle server. The bound here is the client's own patience: the 300-token stream outlasted
    the default 30 s on a heavily loaded machine, and was cut by the bound, not by a bug."""
    base = start_with_frontdoor(daemon, tiny_config(long_model, ctx_size=4096), drain_timeout_s=CLIENT_TIMEOUT_S)
    first = daemon.wait_state("ready")
    stream = sdk(base).chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=300, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    assert next(chunks).choices  # the stream has started
    daemon.call("restart")
    finished = False
    for chunk in chunks:  # raises on the error event of a cut stream
        finished = finished or any(c.finish_reason for c in chunk.choices)
    assert finished, "the stream ended without its finish_reason"
    after = next_server(daemon, first["pid"])
    # The stop came while the answer was in flight, and waited for it: the daemon says so (a
    # fast machine writes the 300 tokens in under half a second, so the clock cannot tell).
    assert "the stop waited" in daemon.log_text() and "for 1 request(s) in flight" in daemon.log_text()
    stop = next(r for r in daemon.history(machine="launch", limit=50) if r["event"] == "StopCompleted")
    assert stop["evidence"].get("signal") != "SIGKILL", stop  # an idle server exits on TERM
    reply = sdk(base).chat.completions.create(model="default", messages=MESSAGES, max_tokens=4)
    assert reply.choices and daemon.call("status")["pid"] == after["pid"]


def test_a_request_whose_engine_crashes_under_it_twice_is_not_sent_a_third_time(daemon, long_model):
    """The other side of sending again: an engine that crashed by itself (SIGSEGV here) may have
    been crashed by the request, which is then sent once more only; the daemon serves on."""
    base = start_with_frontdoor(daemon, tiny_config(long_model, ctx_size=4096))
    st = daemon.wait_state("ready")
    answer: list[object] = []

    def ask() -> None:
        try:
            answer.append(
                sdk(base).chat.completions.create(
                    model="default", messages=MESSAGES, max_tokens=800, extra_body={"ignore_eos": True}
                )
            )
        except openai.APIError as exc:
            answer.append(exc)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    for _ in range(2):
        wait_until(  # the answer (seconds long) is being generated by this engine
            lambda: busy_slots(st["endpoint"], st["api_key"]), timeout=60, what=f"engine {st['pid']} generating"
        )
        assert not answer, answer
        os.kill(st["pid"], signal.SIGSEGV)
        st = next_server(daemon, st["pid"])
    asking.join(CLIENT_TIMEOUT_S)
    (refused,) = answer
    assert isinstance(refused, openai.APIStatusError), refused
    assert refused.status_code == 502 and refused.code == "engine_unreachable", refused
    assert "lost 2 times" in str(refused)
    reply = sdk(base).chat.completions.create(model="default", messages=MESSAGES, max_tokens=4)
    assert reply.choices and daemon.call("status")["pid"] == st["pid"]  # the daemon serves on


def test_the_drain_bound_is_the_configs_and_a_reload_changes_it(daemon, long_model):
    """[frontdoor] drain_timeout_s bounds how long a planned stop waits for a stream in flight,
    and a reload that changes only it applies to the next stop without relaunching the server:
    from 600 s to 1 s here, so `stoker restart` under a long stream cuts it (TERM after 1 s, the
    KILL after stop_grace 3 s; the stream ends with the engine_stream_cut event) instead of
    letting it finish."""
    config = tiny_config(long_model, ctx_size=4096)
    port = free_port()
    write_config(daemon.paths, config + frontdoor_section(port, drain_timeout_s=600))
    daemon.start()
    base = f"http://127.0.0.1:{port}/v1"
    first = daemon.wait_state("ready")
    reloads = len(daemon.history(machine="config", limit=1000))
    write_config(daemon.paths, config + frontdoor_section(port, drain_timeout_s=1))
    history = wait_until(
        lambda: len(rows := daemon.history(machine="config", limit=1000)) > reloads and rows,
        timeout=30,
        what="the config machine's row for the reload",
    )
    assert history[0]["to_state"] == "valid", history[0]
    assert daemon.call("status")["pid"] == first["pid"]  # no relaunch for a front-door key
    stream = sdk(base).chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    assert next(chunks).choices  # the stream has started
    began = time.monotonic()
    daemon.call("restart")
    with pytest.raises(openai.APIError) as cut:
        for _ in chunks:
            pass
    assert "engine_stream_cut" in str(cut.value.body or cut.value), cut.value
    assert time.monotonic() - began < 1 + 3 + 10, "the stop waited past the reloaded bound"
    next_server(daemon, first["pid"])
    assert "1 request(s) still in flight after drain_timeout_s (1.0 s) are cut by the stop" in daemon.log_text()
