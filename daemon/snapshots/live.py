"""The ready server as the snapshot code sees it: where it answers, its identity in the
catalogue's terms, its KV layout's facts and what a token of it weighs.

Nothing here reads in proportion to the model's size: the model's identity is its header and
sampled blocks (daemon/models/identity.py), milliseconds for any model, so the first ready of
a 13.5 GiB model no longer waits 12-13 s for a sha256 of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from stoker.daemon.config.model import Config
from stoker.daemon.core.errors import StokerError
from stoker.daemon.engine.api import EngineClient
from stoker.daemon.models.facts import ModelFacts, model_facts
from stoker.daemon.models.identity import model_identity
from stoker.daemon.snapshots.layout import KVLog, engine_build_of, identity_of_server, last_launch_lines, swa_report
from stoker.states.snapshots import policy
from stoker.states.launch.records import LaunchPlan, LaunchState
from stoker.states.reasons import ReasonCode
from stoker.store.snapshots import INSTANCE_FIELD, SnapshotCatalog

PROPS_TIMEOUT = 30.0


class Instance(Protocol):
    """A server instance's name: the snapshots it saves are its own (daemon.launch.instance)."""

    @property
    def name(self) -> str: ...


class ServedPlan(Protocol):
    """A server instance as the snapshot code needs it: which instance it is, where it answers
    (base URL and key), its pid, the plan it runs, its log, and the launch machine's state for
    the evidence. The launch supervisor is one; this package never imports daemon.launch."""

    @property
    def instance(self) -> Instance: ...

    @property
    def plan(self) -> LaunchPlan | None: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def log_path(self) -> Path: ...

    @property
    def state(self) -> LaunchState: ...

    def endpoint(self) -> tuple[str | None, str | None]: ...


@attrs.frozen
class LiveServer:
    """One ready server as the snapshot code sees it."""

    key: tuple[Any, ...]  # pid and base URL: a new server gets a new key
    base_url: str
    api_key: str | None
    identity: dict[str, Any]  # the instance's name, its model's identity and its KV layout
    n_slots: int
    backend: str | None
    variant: str | None
    model_path: str
    swa: dict[str, Any]
    kv_bytes_per_token: int | None = None  # one KV cell, from the server's own KV buffers
    n_ctx_seq: int = 0  # cells per slot

    @property
    def instance(self) -> str:
        """The instance it serves: the only one whose snapshots it is offered."""
        return str(self.identity[INSTANCE_FIELD])


def _read_facts(plan: LaunchPlan, log_path: Path) -> tuple[str, KVLog, ModelFacts, str]:
    from stoker.daemon.bundles.metadata import BundleMeta

    try:
        engine = engine_build_of(BundleMeta.read(Path(plan.bundle_root)))
    except StokerError:
        engine = f"unknown engine at {plan.server_path}"
    kv = KVLog.parse(last_launch_lines(log_path))
    return engine, kv, model_facts(plan.model_path), model_identity(plan.model_path).model_id


async def inspect_server(supervisor: ServedPlan, catalog: SnapshotCatalog, config: Config) -> LiveServer:
    """Ask the ready server its props, read its log's KV lines and its model's identity."""
    base_url, api_key = supervisor.endpoint()
    plan = supervisor.plan
    if base_url is None or plan is None:
        raise StokerError(ReasonCode.SNAPSHOT_SERVER_NOT_READY, evidence={"state": supervisor.state.value})
    resp = None
    async with EngineClient.open(base_url, api_key, timeout=None) as engine:
        with trio.move_on_after(PROPS_TIMEOUT):
            resp = await engine.props()
    if resp is None or resp.status_code != 200:
        raise StokerError(
            ReasonCode.SNAPSHOT_SERVER_NOT_READY, evidence={"props": None if resp is None else resp.status_code}
        )
    props = resp.json()
    build, kv, facts, model_id = await trio.to_thread.run_sync(_read_facts, plan, supervisor.log_path)
    # A row written before model ids matches by the full sha256 that daemon cached for this
    # exact file (path, size, mtime); nothing is hashed now.
    st = Path(plan.model_path).stat()
    legacy_sha256 = catalog.cached_digest(str(plan.model_path), st.st_size, st.st_mtime_ns)
    swa_full = kv.swa_full if facts.swa else False
    # The flash attention the server was given: the plan's (what ran), not today's config.
    flash_attn = plan.flash_attn or config.server.flash_attn
    identity = identity_of_server(
        instance=supervisor.instance.name,
        model_id=model_id,
        model_sha256=legacy_sha256,
        engine_build=build,
        props=props,
        kv=kv,
        config_flash_attn=flash_attn,
        swa_full=swa_full,
    )
    per_token = policy.kv_bytes_per_token(
        kv_bytes=None if kv.kv_mib is None else kv.kv_mib * 2**20,
        kv_cells=kv.n_ctx,
        model_bytes_per_token=facts.kv_bytes_per_token_f16,
    )
    n_slots = int(props.get("total_slots") or 1)
    swa = swa_report(facts, kv, swa_full)
    swa["kv_bytes_per_token"] = per_token
    return LiveServer(
        key=(supervisor.pid, base_url),
        base_url=base_url,
        api_key=api_key,
        identity=identity,
        n_slots=n_slots,
        backend=plan.backend,
        variant=plan.variant,
        model_path=plan.model_path,
        swa=swa,
        kv_bytes_per_token=per_token,
        n_ctx_seq=int(identity.get("n_ctx") or 0),
    )
