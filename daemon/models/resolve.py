"""Which model file the server loads: a path, or a catalog name (a well-known one pulled first).

`server.model` is a path or a catalog name (states/pull/lookup.py tells them apart and decides
what a name's lookup means). A path is checked where it is: model_missing when nothing is
there, model_load_failed (saying what is there) when it is not a readable GGUF file. A name is
looked up in the catalog (`look_up`): its verified file is served; a well-known name the catalog
does not have yet (or whose downloaded file is gone) is pulled by the pull service and looked
up again (`locate_model`, the daemon's planning); anything else is refused with
model_not_in_catalog or model_missing, the sentence built from the row and the file found.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Protocol

import attrs
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.config.server_args import kind_args
from stoker.daemon.models.facts import model_kind
from stoker.daemon.models.known import KNOWN, WELL_KNOWN, WellKnown, kind_of, launch_args_for, well_known
from stoker.daemon.models.pull import PullOptions, PullService
from stoker.states.pull.lookup import Action, CatalogFile, Decision, Known, LookupFacts, ModelForm, decide, model_form
from stoker.states.reasons import ReasonCode
from stoker.store.catalog import ModelCatalog, ModelRecord

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


class CatalogView(Protocol):
    """What a lookup reads of the catalog: the store's (ModelCatalog), or the rows a CLI was sent."""

    def find(self, name: str) -> ModelRecord | None: ...

    def names(self) -> list[str]: ...


@attrs.frozen
class ModelFile:
    """The file that serves `server.model`, and the server arguments the model brings."""

    path: Path
    name: str | None = None  # the catalog name; None for a path
    launch_args: tuple[str, ...] = ()
    pulled: bool = False  # pulled for this lookup
    kind: str | None = None  # what its well-known name says it is for (None: read its header)

    def engine_mode(self, setting: str) -> tuple[str, ...]:
        """The flags of its kind: the config's `kind`, else its well-known name's, else its
        header's (an embedding model gets --embeddings by itself). Blocking (the header)."""
        kind = setting if setting != "auto" else self.kind or model_kind(self.path)
        return kind_args(kind)


@attrs.frozen
class Lookup:
    """One catalog name looked up: the facts found, the table's decision, the row behind them."""

    name: str
    facts: LookupFacts
    decision: Decision
    record: ModelRecord | None
    known: WellKnown | None
    actual_size: int | None = None  # the size found on disk, when it is not the verified one

    def served(self) -> ModelFile:
        """The row's file, checked like a path (Action.SERVE only)."""
        assert self.record is not None and self.decision.action is Action.SERVE
        path = checked_file(self.record.path)
        return ModelFile(path, self.name, launch_args_for(self.record), self.facts.pulled, kind_of(self.record))

    def refusal(self, catalog: CatalogView) -> StokerError:
        """Action.REFUSE as a StokerError whose sentence says what was found and what to do."""
        name, record = self.name, self.record
        if self.decision.reason is ReasonCode.MODEL_NOT_IN_CATALOG or record is None:
            names = catalog.names()
            have = f"the catalog has {', '.join(names)}" if names else "the catalog is empty"
            return StokerError(
                ReasonCode.MODEL_NOT_IN_CATALOG,
                f"server.model is {name!r}, and no model in the catalog has that name ({have}). "
                f"`stoker pull SPEC --name {name}` adds one; Stoker pulls the names `stoker pull --list` shows "
                f"({', '.join(KNOWN.families)}, ...) by itself; a path to a .gguf file works too.",
                {"model": name, "catalog": names, "well_known": sorted(WELL_KNOWN)},
            )
        if self.facts.row is CatalogFile.CHANGED:
            what = f"is not the file that was verified ({self.actual_size} bytes on disk, {record.size} pulled)"
        else:
            what = "is gone"
        again = (
            f"`stoker models add {record.path} --name {name}` once it is back"
            if record.source == "local"
            else f"`stoker pull {record.spec} --name {name}`"
        )
        pulled = " It was pulled again for this launch and still is not there." if self.facts.pulled else ""
        return StokerError(
            ReasonCode.MODEL_MISSING,
            f"The catalog's model {name!r} ({record.origin or record.spec}) has no file: {record.path} {what}.{pulled} "
            f"Add it again with {again}, or `stoker rm {name}`.",
            {
                "model": name,
                "path": record.path,
                "file": self.facts.row.value,
                "spec": record.spec,
                "source": record.source,
                "sha256": record.sha256,
                "size": record.size,
                "actual_size": self.actual_size,
            },
        )


def look_up(name: str, catalog: CatalogView, *, pulled: bool = False) -> Lookup:
    """What the catalog has under `name`, whether its file is the verified one, and the decision."""
    record = catalog.find(name)
    known = well_known(name)
    if known is None:
        kind = Known.UNKNOWN
    elif record is None or record.spec == known.spec:
        kind = Known.WELL_KNOWN
    else:
        kind = Known.USERS  # the user's own row under a well-known name: never replaced
    row, actual = _file_state(record)
    facts = LookupFacts(row, kind, pulled)
    return Lookup(name, facts, decide(facts), record, known, actual)


def _file_state(record: ModelRecord | None) -> tuple[CatalogFile, int | None]:
    if record is None:
        return CatalogFile.ABSENT, None
    try:
        st = os.stat(record.path)
    except (FileNotFoundError, NotADirectoryError):
        return CatalogFile.MISSING, None
    except OSError:
        return CatalogFile.CHANGED, None  # there, but not readable as the verified file
    if not stat.S_ISREG(st.st_mode) or st.st_size != record.size:
        return CatalogFile.CHANGED, st.st_size
    return CatalogFile.INTACT, None


def resolve_model(value: str, catalog: CatalogView | None = None) -> ModelFile:
    """`server.model` to its file, without pulling: a path checked where it is, or a catalog
    name's verified file. A well-known name not pulled yet is model_not_in_catalog here (the
    daemon pulls it when it plans a launch: `locate_model`)."""
    if model_form(value) is ModelForm.PATH:
        return ModelFile(checked_file(value))
    if catalog is None:
        raise StokerError(ReasonCode.MODEL_NOT_IN_CATALOG, f"{value!r} is a model name, and no catalog was given.")
    found = look_up(value, catalog)
    if found.decision.action is Action.SERVE:
        return found.served()
    if found.decision.action is Action.PULL and found.known is not None:
        raise StokerError(
            ReasonCode.MODEL_NOT_IN_CATALOG,
            f"{value!r} is not pulled yet; the daemon pulls it when it starts the server, or "
            f"`stoker pull {found.known.spec} --name {value}` now.",
            {"model": value, "spec": found.known.spec},
        )
    raise found.refusal(catalog)


async def locate_model(
    value: str, catalog: ModelCatalog, pulls: PullService, options: PullOptions = PullOptions()
) -> ModelFile:
    """`server.model` to its file for a launch: a well-known name the catalog lacks is pulled
    first (by the pull machine; its failure is raised with the pull's reason), then looked up
    again. Blocking file checks run in a thread."""
    if model_form(value) is ModelForm.PATH:
        return ModelFile(await trio.to_thread.run_sync(checked_file, value))
    pulled = False
    while True:
        found = look_up(value, catalog, pulled=pulled)
        if found.decision.action is Action.SERVE:
            return await trio.to_thread.run_sync(found.served)
        if found.decision.action is Action.REFUSE or found.known is None:
            raise found.refusal(catalog)
        log.info("pulling %s (%s) for the launch: %s", value, found.known.spec, found.facts.row.value)
        await pulls.pull(found.known.spec, name=value, options=options)
        pulled = True


def checked_file(spec: str | Path) -> Path:
    """An existing, readable GGUF file at `spec`; model_missing when nothing is there,
    model_load_failed (saying what is there) when it is not a readable GGUF file."""
    path = Path(spec).expanduser()
    try:
        kind = file_kind(path)
    except OSError as err:
        raise _unreadable(path, err) from None
    if kind is None:
        what = f"{path} (a symbolic link to {os.readlink(path)})" if path.is_symlink() else str(path)
        raise StokerError(
            ReasonCode.MODEL_MISSING,
            f"Model file {what} does not exist; fix server.model in the config.",
            {"model": str(path)},
        )
    if kind != "regular file":
        # There, but not a file the engine can load (and a FIFO would block its open until
        # the stall timeout): say what it is, never "does not exist".
        raise StokerError(
            ReasonCode.MODEL_LOAD_FAILED,
            f"{path} is a {kind}, not a model file; point server.model at a .gguf model.",
            {"model": str(path), "kind": kind},
        )
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as err:
        raise _unreadable(path, err) from None
    if magic != GGUF_MAGIC:
        raise StokerError(
            ReasonCode.MODEL_LOAD_FAILED,
            f"{path} is not a GGUF file (magic {magic!r}); point server.model at a .gguf model.",
            {"model": str(path), "magic": magic.hex()},
        )
    return path.absolute()


def file_kind(path: Path) -> str | None:
    """What is at `path` ("regular file", "directory", "named pipe (FIFO)", ...); None if nothing.

    A symbolic link is followed (a dangling one is nothing). OSError when the path cannot be
    examined (a directory on the way is not searchable, say).
    """
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    for test, kind in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISFIFO, "named pipe (FIFO)"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return kind
    return "special file"


def _unreadable(path: Path, err: OSError) -> StokerError:
    return StokerError(
        ReasonCode.MODEL_LOAD_FAILED,
        f"{path} cannot be read ({err.strerror}); make it readable or point server.model elsewhere.",
        {"model": str(path), "error": f"{type(err).__name__}: {err.strerror}"},
    )
