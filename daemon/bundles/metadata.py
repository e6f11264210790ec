"""The bundle contract: `bundle.json` (BundleMeta) and the manifest of published bundles.

`bundle.json` sits at the root of every bundle zip. It says what the bundle is (backend,
variant, version), where it came from (source pin, flags, toolchain), what it needs from the
host (CPU features, driver, system libraries), every file with its size, mode and sha256,
and the smoke reference: the greedy tokens this build generated from the tiny model.
Parsing is strict: a malformed document is a `bundle_metadata_mismatch`, never a KeyError.
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urljoin

import attrs

from stoker.daemon.core.confined import not_plain
from stoker.daemon.core.errors import StokerError
from stoker.states.convert import unstructure
from stoker.states.reasons import ReasonCode

SCHEMA_VERSION = 1
BUNDLE_JSON = "bundle.json"
MANIFEST_SCHEMA_VERSION = 1

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


def _bad(what: str, **evidence: Any) -> StokerError:
    return StokerError(ReasonCode.BUNDLE_METADATA_MISMATCH, f"Bundle metadata is malformed: {what}.", evidence)


def _get(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    if not isinstance(data, Mapping):
        raise _bad("expected an object", got=type(data).__name__)
    if key not in data or data[key] is None:
        if optional:
            return None
        raise _bad(f"missing field {key!r}")
    value = data[key]
    # bool is an int subclass; a size of `true` is still malformed.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _bad(f"field {key!r} has the wrong type", type=type(value).__name__)
    if not isinstance(value, kind):
        raise _bad(f"field {key!r} has the wrong type", type=type(value).__name__)
    return value


def _sha(data: Mapping[str, Any], key: str = "sha256") -> str:
    value = _get(data, key, str)
    if not _SHA256.match(value):
        raise _bad(f"{key!r} is not a lowercase sha256 hex digest", value=value)
    return value


def _name(data: Mapping[str, Any], key: str) -> str:
    value = _get(data, key, str)
    if not _NAME.match(value):
        raise _bad(f"{key!r} is not a plain lowercase name", value=value)
    return value


def _strs(data: Mapping[str, Any], key: str) -> tuple[str, ...]:
    values = _get(data, key, list, optional=True) or []
    if not all(isinstance(v, str) for v in values):
        raise _bad(f"{key!r} must be a list of strings")
    return tuple(values)


def _safe_relpath(path: str) -> str:
    """A bundle path is relative, forward-slashed and stays inside the bundle."""
    if not_plain(path) is not None:
        raise _bad("a file path escapes the bundle or is not normalised", path=path)
    return path


@attrs.frozen
class FileEntry:
    path: str
    size: int
    mode: int
    sha256: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FileEntry":
        size = _get(data, "size", int)
        mode = _get(data, "mode", int)
        if size < 0 or not 0 <= mode <= 0o777:
            raise _bad("a file entry has a negative size or a mode outside 0..0o777", entry=dict(data))
        return cls(_safe_relpath(_get(data, "path", str)), size, mode, _sha(data))


@attrs.frozen
class SmokeReference:
    """The greedy generation recorded at build time: the token-identical gate's reference."""

    model: Mapping[str, Any]  # write_tiny_model's arguments plus the file's sha256
    prompt: str
    n_predict: int
    tokens: tuple[int, ...] | None  # None: the build host could not run the engine

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SmokeReference":
        tokens = _get(data, "tokens", list, optional=True)
        if tokens is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise _bad("smoke tokens must be integers")
        return cls(
            dict(_get(data, "model", dict)),
            _get(data, "prompt", str),
            _get(data, "n_predict", int),
            None if tokens is None else tuple(tokens),
        )

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = unstructure(self)
        return result


@attrs.frozen
class BundleMeta:
    """The parsed `bundle.json`."""

    schema_version: int
    backend: str
    variant: str
    version: str  # the bundle's version: llama.cpp's release tag, e.g. "b11434"
    platform: str  # e.g. "linux-x86_64"
    server: str  # path of llama-server inside the bundle
    source: Mapping[str, Any]  # the pin: kind, spec, sha256 (archive or tree digest)
    llama: Mapping[str, Any]  # version, build_number, commit as stamped into the binary
    build: Mapping[str, Any]  # flags, compiler, cmake, generator, toolkit, cache_key
    cuda_archs: tuple[str, ...]
    min_driver: str | None
    cpu_requires: tuple[str, ...]  # /proc/cpuinfo flags the variant was compiled for
    required_system_libs: tuple[str, ...]
    files: tuple[FileEntry, ...]
    smoke: SmokeReference | None
    # The engine's other programs inside the bundle, by role: "fit_params" (llama-fit-params,
    # the engine's own memory fitter) and "rpc_server" (ggml's rpc-server, for workers).
    # Absent from bundles built before they were packaged.
    tools: Mapping[str, str] = attrs.field(factory=dict)
    rpc_protocol: str | None = None  # ggml-rpc's RPC_PROTO version, "7.0.0"; head and workers must agree

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BundleMeta":
        """Parse and validate a decoded `bundle.json`."""
        schema = _get(data, "schema_version", int)
        if schema != SCHEMA_VERSION:
            raise _bad("unsupported schema version", schema_version=schema, supported=SCHEMA_VERSION)
        files = tuple(FileEntry.from_dict(f) for f in _get(data, "files", list))
        paths = [f.path for f in files]
        if len(set(paths)) != len(paths):
            raise _bad("a file is listed twice")
        server = _safe_relpath(_get(data, "server", str))
        if server not in paths:
            raise _bad("the server binary is not among the listed files", server=server)
        source = dict(_get(data, "source", dict))
        _sha(source)
        smoke = _get(data, "smoke", dict, optional=True)
        tools = dict(_get(data, "tools", dict, optional=True) or {})
        for role, path in tools.items():
            if not isinstance(path, str) or _safe_relpath(path) not in paths:
                raise _bad("a tool is not among the listed files", tool=role, path=path)
        return cls(
            schema_version=schema,
            backend=_name(data, "backend"),
            variant=_name(data, "variant"),
            version=_get(data, "version", str),
            platform=_get(data, "platform", str),
            server=server,
            source=source,
            llama=dict(_get(data, "llama", dict)),
            build=dict(_get(data, "build", dict)),
            cuda_archs=_strs(data, "cuda_archs"),
            min_driver=_get(data, "min_driver", str, optional=True),
            cpu_requires=_strs(data, "cpu_requires"),
            required_system_libs=_strs(data, "required_system_libs"),
            files=files,
            smoke=None if smoke is None else SmokeReference.from_dict(smoke),
            tools=tools,
            rpc_protocol=_get(data, "rpc_protocol", str, optional=True),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "BundleMeta":
        """Parse the text of a `bundle.json`."""
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:  # nested past Python's stack
            raise _bad("not valid JSON", error=str(err)) from None
        return cls.from_dict(data)

    @classmethod
    def read(cls, bundle_dir: Path) -> "BundleMeta":
        """Read `bundle.json` from an unpacked bundle directory."""
        path = Path(bundle_dir) / BUNDLE_JSON
        if not path.is_file():
            raise StokerError(ReasonCode.BUNDLE_VERIFY_FAILED, "The bundle has no bundle.json.", {"path": str(path)})
        return cls.from_json(path.read_bytes())

    def to_dict(self) -> dict[str, Any]:
        """The `bundle.json` document (its files and smoke reference as theirs)."""
        result: dict[str, Any] = unstructure(self)
        return result

    def to_json(self) -> str:
        # Sorted keys and a trailing newline: the same build writes the same bytes.
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def file(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)

    @property
    def slot(self) -> str:
        """The install slot name: one installed bundle per backend and variant."""
        return f"{self.backend}-{self.variant}"


@attrs.frozen
class ManifestEntry:
    """One published bundle: where to fetch it and what it must be."""

    url: str
    sha256: str
    size: int
    backend: str
    variant: str
    version: str
    platform: str
    min_driver: str | None = None
    cuda_archs: tuple[str, ...] = ()
    # How the manifest that lists it was trusted (daemon/install/trust.py): key, version, channel,
    # expiry. Not part of the entry: what the install's history records about where it came from.
    origin: Mapping[str, Any] = attrs.field(factory=dict, eq=False, hash=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: str | None = None) -> "ManifestEntry":
        """Parse one entry; a relative `url` is resolved against `base`, the manifest's own URL."""
        url = _get(data, "url", str)
        if base is not None and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url):
            url = urljoin(base, url)  # a mirror lists its zips beside the manifest
        # Plain http only on loopback: a local mirror (and the tests' fault server).
        if not re.match(r"^(https://|file://|http://(127\.0\.0\.1|localhost|\[::1\])[:/])", url):
            raise _bad("a manifest URL must be https:// or file:// (http:// only on loopback)", url=url)
        size = _get(data, "size", int)
        if size <= 0:
            raise _bad("a manifest size must be positive", size=size)
        return cls(
            url=url,
            sha256=_sha(data),
            size=size,
            backend=_name(data, "backend"),
            variant=_name(data, "variant"),
            version=_get(data, "version", str),
            platform=_get(data, "platform", str),
            min_driver=_get(data, "min_driver", str, optional=True),
            cuda_archs=_strs(data, "cuda_archs"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "url": self.url,
            "sha256": self.sha256,
            "size": self.size,
            "backend": self.backend,
            "variant": self.variant,
            "version": self.version,
            "platform": self.platform,
        }
        if self.min_driver is not None:
            out["min_driver"] = self.min_driver
        if self.cuda_archs:
            out["cuda_archs"] = list(self.cuda_archs)
        return out


def _timestamp(data: Mapping[str, Any], key: str) -> str | None:
    """An RFC 3339 UTC time, `2026-01-31T12:00:00Z`, or None when absent."""
    value = _get(data, key, str, optional=True)
    if value is not None:
        try:
            parse_timestamp(value)
        except ValueError:
            raise _bad(f"{key!r} is not an RFC 3339 UTC time like 2026-01-31T12:00:00Z", value=value) from None
    return value


def parse_timestamp(text: str) -> float:
    """Unix seconds of an RFC 3339 UTC time (`...Z` or `+00:00`); ValueError otherwise."""
    when = datetime.datetime.fromisoformat(text)
    if when.utcoffset() != datetime.timedelta(0):
        raise ValueError(f"{text} is not in UTC")
    return when.timestamp()


def format_timestamp(at: float) -> str:
    """The RFC 3339 UTC form of unix seconds, to the second: `2026-01-31T12:00:00Z`."""
    return datetime.datetime.fromtimestamp(int(at), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def release_key(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """What one manifest entry stands for: a release of one backend, variant and platform, and
    for CUDA its architecture family (each family is its own bundle of the same release, so that
    a daemon picks the one covering its GPU). A manifest lists each once; publishing one again
    replaces it."""
    archs = entry.get("cuda_archs") or ()
    return (entry.get("backend"), entry.get("variant"), entry.get("platform"), entry.get("version"), tuple(archs))


@attrs.frozen
class BundleManifest:
    """The list of published bundles that the downloader resolves against.

    A mirror's signed manifest (docs/mirror.md) also carries `version` (a monotonic integer per
    signing key and channel), `expires` (RFC 3339 UTC) and `channel`; daemon/install/trust.py
    requires them of every signed manifest. A local unsigned manifest may leave them out."""

    schema_version: int
    bundles: tuple[ManifestEntry, ...]
    version: int | None = None
    expires: str | None = None
    channel: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: str | None = None) -> "BundleManifest":
        """Parse a decoded manifest; relative entry URLs resolve against `base` (its URL)."""
        schema = _get(data, "schema_version", int)
        if schema != MANIFEST_SCHEMA_VERSION:
            raise _bad("unsupported manifest schema version", schema_version=schema)
        bundles = tuple(ManifestEntry.from_dict(b, base) for b in _get(data, "bundles", list))
        seen = set()
        for b in bundles:
            key = release_key(attrs.asdict(b, recurse=False))
            if key in seen:
                raise _bad("the manifest lists the same bundle twice", bundle=list(key))
            seen.add(key)
        version = _get(data, "version", int, optional=True)
        if version is not None and version < 1:
            raise _bad("a manifest version is a positive integer", version=version)
        channel = None if data.get("channel") is None else _name(data, "channel")
        return cls(schema, bundles, version, _timestamp(data, "expires"), channel)

    @classmethod
    def from_json(cls, text: str | bytes, base: str | None = None) -> "BundleManifest":
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:  # nested past Python's stack
            raise _bad("the manifest is not valid JSON", error=str(err)) from None
        return cls.from_dict(data, base)

    def to_json(self) -> str:
        doc: dict[str, Any] = {"schema_version": self.schema_version, "bundles": [b.to_dict() for b in self.bundles]}
        for key in ("version", "expires", "channel"):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    def select(
        self, backend: str, platform: str, variant: str | None = None, version: str | None = None
    ) -> tuple[ManifestEntry, ...]:
        """The entries that fit, in manifest order (the publisher lists preferred ones first)."""
        return tuple(
            b
            for b in self.bundles
            if b.backend == backend
            and b.platform == platform
            and (variant is None or b.variant == variant)
            and (version is None or b.version == version)
        )
