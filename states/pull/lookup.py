"""Which file serves `server.model`: a path, a catalog name, or a well-known name pulled on first need.

`server.model` is a *path* when it looks like one (it starts with `/`, `.` or `~`, or ends in
`.gguf`: every value the config took before catalog names existed) and a *catalog name*
otherwise (what `stoker models` lists: `smollm2-135m-instruct`, `org/repo:Q4_K_M`, a name given
with `pull --name`). A path is checked where it is (daemon/models/resolve.py says what a bad
one is). A name is looked up in the catalog, and this table decides from what was found:

    the catalog's row     the name is          decision
    intact                anything             serve its file
    absent                well-known           pull it (the pull machine, states/pull/table.py), look again
    absent                not well-known       refuse: model_not_in_catalog
    missing | changed     well-known           pull it again (Stoker's own download of a known spec)
    missing | changed     not well-known, or   refuse: model_missing (the evidence says which file,
                          the user's own row   from which spec, and how to pull it again)

*Well-known* names are the ones Stoker knows a source for (the default model's included:
daemon/models/known.py); a row the user wrote under such a name from another spec (`stoker
pull ./mine.gguf --name gemma3-270m`) is theirs and is never replaced. *Intact* means the file
is there with the size that was verified when it was pulled (its sha256 was checked then; a
second full hash at every launch would cost seconds per GiB). A pull already made for this
lookup that still leaves no intact row refuses with model_missing, never pulls in a loop.

Pure (STYLE.md, Rule 1): daemon/models/resolve.py reads the facts (the row, a stat of its
file) and carries the decision out, for the daemon's planning and for `stoker run`, which
pulls before it starts the daemon so that the pull's progress bar is shown.
"""

from __future__ import annotations

import enum

import attrs

from stoker.states.reasons import ReasonCode


class ModelForm(enum.StrEnum):
    PATH = "path"
    NAME = "name"


def model_form(value: str) -> ModelForm:
    """Whether `server.model` names a file (a path) or a catalog entry (a name)."""
    text = value.strip()
    if text.startswith(("/", ".", "~")) or text.lower().endswith(".gguf"):
        return ModelForm.PATH
    return ModelForm.NAME


class CatalogFile(enum.StrEnum):
    """What the catalog has under the name, and what is on disk where its row points."""

    ABSENT = "absent"  # no row of that name
    INTACT = "intact"  # the row's file is there, with the size verified when it was pulled
    MISSING = "missing"  # the row's file is gone
    CHANGED = "changed"  # a file is there, but not the verified one (another size)


class Known(enum.StrEnum):
    """What Stoker knows of the name itself."""

    UNKNOWN = "unknown"  # not a well-known name
    WELL_KNOWN = "well_known"  # a well-known name, its row (if any) pulled from its spec
    USERS = "users"  # a well-known name the user cataloged from another spec: theirs


class Action(enum.StrEnum):
    SERVE = "serve"
    PULL = "pull"
    REFUSE = "refuse"


@attrs.frozen
class LookupFacts:
    """What was found for one name; `pulled`: a pull already ran for this lookup."""

    row: CatalogFile
    known: Known
    pulled: bool = False


@attrs.frozen
class Decision:
    action: Action
    reason: ReasonCode | None = None


SERVE = Decision(Action.SERVE)
PULL = Decision(Action.PULL)
NOT_IN_CATALOG = Decision(Action.REFUSE, ReasonCode.MODEL_NOT_IN_CATALOG)
MISSING = Decision(Action.REFUSE, ReasonCode.MODEL_MISSING)

C, K = CatalogFile, Known
DECISIONS: dict[tuple[CatalogFile, Known], Decision] = {
    (C.INTACT, K.UNKNOWN): SERVE,
    (C.INTACT, K.WELL_KNOWN): SERVE,
    (C.INTACT, K.USERS): SERVE,
    (C.ABSENT, K.UNKNOWN): NOT_IN_CATALOG,
    (C.ABSENT, K.WELL_KNOWN): PULL,
    (C.ABSENT, K.USERS): NOT_IN_CATALOG,  # no row cannot be the user's row; kept for exhaustiveness
    (C.MISSING, K.UNKNOWN): MISSING,
    (C.MISSING, K.WELL_KNOWN): PULL,
    (C.MISSING, K.USERS): MISSING,
    (C.CHANGED, K.UNKNOWN): MISSING,
    (C.CHANGED, K.WELL_KNOWN): PULL,
    (C.CHANGED, K.USERS): MISSING,
}
# A pull that ran and still left no intact row: say so rather than pull again.
AFTER_PULL = MISSING


def decide(facts: LookupFacts) -> Decision:
    """Serve, pull, or refuse (with its reason), for a catalog name."""
    decision = DECISIONS[(facts.row, facts.known)]
    if decision.action is Action.PULL and facts.pulled:
        return AFTER_PULL
    return decision
