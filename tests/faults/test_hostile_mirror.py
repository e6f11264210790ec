"""Hostile mirrors: a signed mirror (`publish_mirror`, what `stoker bundle publish` writes)
served by a real loopback HTTP server, and each way that mirror, or anyone between it and
the daemon, can lie: a manifest signed by another key, altered after signing, expired,
replayed older, unsigned; a bundle URL serving another file; a body longer or shorter than
the signed size. Each is refused with its reason code, recorded in the install history with
its evidence, and the installed bundle stays as it was. With a real daemon serving (`engine`),
it goes on serving throughout; and the happy path: a mirror published from the build cache
installs and serves.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import attrs
import httpx
import pytest
import trio

from stoker.daemon.bundles.installed import bundle_meta_of, find_installed, install_bundle
from stoker.daemon.bundles.mirror import MANIFEST_PAYLOAD_TYPE, publish_mirror
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.signing import Envelope, SigningKey, generate_key, sign_envelope
from stoker.daemon.install.manifest import load_manifest
from stoker.daemon.install.installer import InstallService
from stoker.states.install import table as I
from tests.bundlekit import make_bundle_zip
from tests.httpfault import Fault, FaultServer
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.waits import until


class Mirror:
    """A mirror directory published with `key` and served file by file by the fault server."""

    def __init__(self, root: Path, server: FaultServer, key: SigningKey) -> None:
        self.root, self.server, self.key = root, server, key

    def publish(self, zips: list[Path], **kwargs: Any) -> dict[str, Any]:
        result = publish_mirror(self.root, zips, self.key, **kwargs)
        for path in sorted(self.root.rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                self.server.add("/" + path.relative_to(self.root).as_posix(), path.read_bytes())
        return result.to_dict()

    @property
    def url(self) -> str:
        return self.server.url("/manifest.json")

    def manifest(self) -> bytes:
        return (self.root / "manifest.json").read_bytes()

    def payload(self) -> bytes:
        return Envelope.from_document(json.loads(self.manifest())).payload

    def serve_manifest(self, raw: bytes) -> None:
        self.server.add("/manifest.json", raw)

    def bundle_path(self, index: int = -1) -> str:
        return "/" + json.loads(self.payload())["bundles"][index]["url"]


def causes(rows: list[Any]) -> set[str]:
    """Every precise cause the install history's rows name: a failed step's `cause`, and each
    source's try (`tried`) where the install machine records sources."""
    found = set()
    for row in rows:
        evidence = (row["evidence"] if isinstance(row, dict) else row.evidence) or {}
        if evidence.get("cause"):
            found.add(evidence["cause"])
        found |= {t.get("reason") for t in evidence.get("tried") or () if t.get("reason")}
    return found


def mirror_only() -> dict[str, Any]:
    """Where the install machine tries sources in a chain, only the mirror: a refused mirror
    must not be papered over by this machine's build cache in these service-level cases."""
    return {"sources": (I.Source.MIRROR,)} if "sources" in attrs.fields_dict(InstallService) else {}


# --- the install service against the mirror (fake bundles: fast, every case) --------------


class Setup:
    """A STOKER_HOME with a good CPU bundle installed, a store, a key, another key, and a
    mirror signed by the first listing a newer bundle."""

    def __init__(self, tmp: Path, server: FaultServer) -> None:
        from stoker.store import open_store

        self.paths = StokerPaths.from_env()
        self.paths.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = open_store(self.paths.db_file)
        self.previous = install_bundle(make_bundle_zip(tmp, "old.zip"), self.paths)
        self.previous_json = (self.previous.root / "bundle.json").read_bytes()
        self.new_zip = make_bundle_zip(tmp, "new.zip")
        self.other_zip = make_bundle_zip(tmp, "other.zip")
        self.key, self.other_key = generate_key(tmp / "key"), generate_key(tmp / "other.key")
        self.server = server
        self.mirror = Mirror(tmp / "mirror", server, self.key)
        self.mirror.publish([self.new_zip])

    def service(self, keys: tuple[str, ...] | None = None) -> InstallService:
        keys = (self.key.public_text,) if keys is None else keys
        return InstallService(
            self.paths,
            self.store,
            manifest_source=lambda: self.mirror.url,
            trusted_keys=lambda: keys,
            smoke=False,
            **mirror_only(),
        )

    async def install_fails(self, service: InstallService | None = None) -> StokerError:
        with pytest.raises(StokerError) as err:
            with trio.fail_after(60):
                await (service or self.service()).install("cpu", variant="avx2")
        return err.value

    def assert_previous_intact(self) -> None:
        assert (self.paths.bundles_dir / "cpu-avx2" / "bundle.json").read_bytes() == self.previous_json
        assert find_installed(self.paths, "cpu", "avx2").root == self.paths.bundles_dir / "cpu-avx2"
        assert not [p for p in self.paths.bundles_dir.iterdir() if p.name.startswith(".install-")]
        assert not list((self.paths.data_dir / "downloads").glob("*.part*"))  # nothing half-fetched kept

    def history(self) -> list[Any]:
        return self.store.history(machine=I.INSTALL.machine_id("cpu", "avx2"))


@pytest.fixture
def setup(tmp_path, fault_server):
    s = Setup(tmp_path, fault_server)
    yield s
    s.store.close()


async def test_a_signed_mirror_over_http_installs_and_history_says_how_it_was_trusted(setup):
    with trio.fail_after(60):
        bundle = await setup.service().install("cpu", variant="avx2")
    assert (bundle.root / "bundle.json").read_bytes() != setup.previous_json
    assert (setup.paths.bundles_dir / "cpu-avx2.previous" / "bundle.json").read_bytes() == setup.previous_json
    resolved = next(r for r in setup.history() if r.event == "Resolved")
    trusted = resolved.evidence["manifest"]
    assert trusted["trust"] == "signed" and trusted["key_id"] == setup.key.keyid
    assert trusted["version"] == 1 and trusted["channel"] == "stable" and trusted["previous_version"] is None
    assert resolved.evidence["url"] == setup.server.url(setup.mirror.bundle_path())  # relative to the manifest
    assert [r.path for r in setup.server.requests()] == ["/manifest.json", setup.mirror.bundle_path()]


async def _wrong_key(s: Setup) -> None:
    s.mirror.serve_manifest(sign_envelope(s.mirror.payload(), MANIFEST_PAYLOAD_TYPE, s.other_key).to_json())


async def _altered(s: Setup) -> None:
    # The signed entry's size and digest rewritten to the other zip's; the signature kept.
    doc = json.loads(s.mirror.payload())
    other = s.other_zip.read_bytes()
    import hashlib

    doc["bundles"][0].update(size=len(other), sha256=hashlib.sha256(other).hexdigest())
    envelope = json.loads(s.mirror.manifest())
    envelope["payload"] = base64.b64encode(json.dumps(doc).encode()).decode()
    s.mirror.serve_manifest(json.dumps(envelope).encode())
    s.server.add(s.mirror.bundle_path(), other)


async def _expired(s: Setup) -> None:
    s.mirror.publish([s.new_zip], expires_days=1, clock=lambda: time.time() - 2 * 86400)


async def _replayed(s: Setup) -> None:
    old = s.mirror.manifest()
    s.mirror.publish([s.other_zip])  # version 2, read (accepted) by the daemon:
    seen = len(s.server.requests())
    await load_manifest(s.mirror.url, s.service().trust)
    # The server logs a request after its last byte, which the client may have read already.
    await until(lambda: len(s.server.requests()) > seen, timeout=5, what="the server's record of that fetch")
    s.mirror.serve_manifest(old)  # then version 1 again


async def _accepted(s: Setup) -> None:
    """Have the daemon read (accept) the mirror's manifest as it is now."""
    seen = len(s.server.requests())
    await load_manifest(s.mirror.url, s.service().trust)
    await until(lambda: len(s.server.requests()) > seen, timeout=5, what="the server's record of that fetch")


async def _other_channel(s: Setup) -> None:
    await _accepted(s)  # stable version 1, listing the newer bundle
    # The same key's nightly channel, listing another bundle, served at the stable URL.
    Mirror(s.mirror.root.parent / "nightly", s.server, s.key).publish([s.other_zip], channel="nightly")


async def _unsigned(s: Setup) -> None:
    s.mirror.serve_manifest(s.mirror.payload())


MANIFEST_CASES: dict[str, tuple[Callable[[Setup], Awaitable[None]], str]] = {
    "signed by another key": (_wrong_key, "manifest_untrusted"),
    "altered after signing": (_altered, "manifest_signature_invalid"),
    "expired": (_expired, "manifest_expired"),
    "replayed older": (_replayed, "manifest_rollback"),
    "unsigned": (_unsigned, "manifest_untrusted"),
    "another channel's, same key": (_other_channel, "manifest_wrong_channel"),
}


@pytest.mark.parametrize("case", list(MANIFEST_CASES))
async def test_a_hostile_manifest_is_refused_before_any_bundle_is_fetched(setup, case):
    make, code = MANIFEST_CASES[case]
    await make(setup)
    before = len(setup.server.requests())
    err = await setup.install_fails()
    assert err.reason == "cpu_bundle_install_failed"
    assert err.evidence["cause"] == code, err.evidence
    assert err.evidence["manifest"] == setup.mirror.url and setup.key.keyid in err.evidence["trusted_keys"]
    assert [r.path for r in setup.server.requests()[before:]] == ["/manifest.json"]  # no bundle was fetched
    setup.assert_previous_intact()
    assert code in causes(setup.history()[:1])  # the failed transition carries it, with its evidence
    assert setup.store.machine(I.INSTALL.machine_id("cpu", "avx2")).state == "failed"


async def test_an_empty_slot_never_installs_another_channels_release_after_stable_was_accepted(setup):
    """Stable's manifest (version 3, the newer bundle) was accepted; then the trusted key's nightly
    manifest (version 1, an older bundle) is served at the stable URL and the slot is empty. The
    install is refused with manifest_wrong_channel, nothing is fetched or installed, and the
    accepted sequence is still stable's version 3 (no nightly sequence starts, nothing freezes)."""
    from stoker.store.manifests import ManifestVersions

    setup.mirror.publish([setup.new_zip], version=3)
    await _accepted(setup)
    Mirror(setup.mirror.root.parent / "nightly", setup.server, setup.key).publish([setup.other_zip], channel="nightly")
    for slot in setup.paths.bundles_dir.iterdir():
        shutil.rmtree(slot)
    before = len(setup.server.requests())
    err = await setup.install_fails()
    assert err.evidence["cause"] == "manifest_wrong_channel", err.evidence
    assert [r.path for r in setup.server.requests()[before:]] == ["/manifest.json"]
    assert find_installed(setup.paths, "cpu", "avx2") is None
    rows = {(r.channel, r.version) for r in ManifestVersions(setup.store).all()}
    assert rows == {("stable", 3)}


async def test_a_network_manifest_with_no_trusted_key_is_not_even_fetched(setup):
    err = await setup.install_fails(setup.service(keys=()))
    assert err.evidence["cause"] == "manifest_untrusted" and err.evidence["trusted_keys"] == []
    assert setup.server.requests() == []
    setup.assert_previous_intact()


BUNDLE_CASES: dict[str, tuple[Callable[[Setup, bytes], tuple[bytes, Fault]], set[str]]] = {
    # The signed entry's URL serves another bundle (another size): refused on the announced length.
    "another file": (lambda s, data: (s.other_zip.read_bytes(), Fault()), {"size_mismatch", "digest_mismatch"}),
    # The same length, one byte different: refused on the digest, after the last byte.
    "same size, other bytes": (lambda s, data: (data, Fault(corrupt=True)), {"digest_mismatch"}),
    # More bytes than signed, honestly announced: refused before a byte is written.
    "longer, announced": (lambda s, data: (data + b"\0" * 4096, Fault()), {"size_mismatch"}),
    # More bytes than signed, chunked (no length announced): cut off at the signed size.
    "longer, chunked": (lambda s, data: (data + b"\0" * 4096, Fault(chunked=True)), {"size_mismatch"}),
    # Fewer bytes than signed, chunked, ending cleanly: short at the end.
    "shorter, chunked": (lambda s, data: (data[:-100], Fault(chunked=True)), {"size_mismatch"}),
}


@pytest.mark.parametrize("case", list(BUNDLE_CASES))
async def test_a_bundle_that_is_not_the_signed_bytes_is_refused(setup, case):
    make, kinds = BUNDLE_CASES[case]
    body, fault = make(setup, setup.new_zip.read_bytes())
    setup.server.add(setup.mirror.bundle_path(), body, fault)
    err = await setup.install_fails()
    assert err.evidence["cause"] == "bundle_digest_mismatch" and err.evidence["kind"] in kinds, err.evidence
    assert err.evidence["step"] == "downloading"
    setup.assert_previous_intact()
    assert "bundle_digest_mismatch" in causes(setup.history()[:1])


# --- a real daemon, serving, against the mirror (the real CPU bundle from the build cache) --


def stoker(d: DaemonProcess, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker.daemon", *args], env=d.env, capture_output=True, text=True, timeout=timeout
    )


def _result(out: subprocess.CompletedProcess) -> dict[str, Any]:
    """`stoker install --json`'s result: the document after its one-line progress events."""
    return json.loads("\n".join(line for line in out.stdout.splitlines() if not line.startswith('{"progress"')))


def _complete(status: dict[str, Any]) -> int:
    reply = httpx.post(
        f"{status['endpoint']}/completion",
        json={"prompt": "hello", "n_predict": 4, "temperature": 0},
        headers={"Authorization": f"Bearer {status['api_key']}"},
        timeout=30,
    )
    assert reply.status_code == 200
    return int(reply.json()["tokens_predicted"])


@pytest.mark.engine
def test_a_hostile_mirror_never_disturbs_the_serving_daemon(daemon, model, cpu_bundle, fault_server, tmp_path):
    """The daemon serves on the installed CPU bundle; its mirror (published from the build cache
    with `stoker bundle publish --from-cache`) is first good, then hostile in each way. Every
    `stoker install cpu` against the hostile mirror is refused with its code in the history,
    the slot keeps its bundle, and the same server answers completions throughout."""
    meta = bundle_meta_of(cpu_bundle)
    machine = I.INSTALL.machine_id("cpu", meta.variant)
    key, other = generate_key(tmp_path / "key"), generate_key(tmp_path / "other.key")
    root = tmp_path / "mirror"
    published = stoker(daemon, "bundle", "publish", str(root), "--from-cache", "--key", str(tmp_path / "key"), "--json")
    assert published.returncode == 0, published.stderr
    entries = json.loads(published.stdout)["entries"]
    assert any(e["sha256"] == _sha_file(cpu_bundle) for e in entries)  # the cache's newest CPU build
    mirror = Mirror(root, fault_server, key)
    mirror.publish([])  # serve it (and sign version 2 with the same entries)
    write_config(
        daemon.paths,
        tiny_config(model) + f'[bundles]\nmanifest = "{mirror.url}"\ntrusted_keys = ["{key.public_text}"]\n',
    )
    slot = daemon.paths.bundles_dir / f"cpu-{meta.variant}" / "bundle.json"
    daemon.start()
    daemon.wait_state("ready", timeout=120)

    good = stoker(daemon, "install", "cpu", "--variant", meta.variant, "--json")
    assert good.returncode == 0, good.stdout + good.stderr
    resolved = next(r for r in daemon.history(machine=machine) if r["event"] == "Resolved")
    assert resolved["evidence"]["manifest"]["trust"] == "signed" and resolved["evidence"]["manifest"]["version"] == 2
    st = daemon.wait_state("ready", timeout=120)
    pid, slot_json = st["pid"], slot.read_bytes()
    assert json.loads(slot_json)["version"] == meta.version

    newer = mirror.manifest()
    hostile: list[tuple[str, Callable[[], None], str]] = [
        (
            "signed by another key",
            lambda: mirror.serve_manifest(sign_envelope(mirror.payload(), MANIFEST_PAYLOAD_TYPE, other).to_json()),
            "manifest_untrusted",
        ),
        ("unsigned", lambda: mirror.serve_manifest(mirror.payload()), "manifest_untrusted"),
        (
            "altered after signing",
            lambda: mirror.serve_manifest(
                json.dumps(
                    {**json.loads(newer), "payload": base64.b64encode(mirror.payload() + b" ").decode()}
                ).encode()
            ),
            "manifest_signature_invalid",
        ),
        (
            "expired",
            lambda: mirror.publish([], expires_days=1, clock=lambda: time.time() - 2 * 86400),
            "manifest_expired",
        ),
        ("replayed older", lambda: mirror.serve_manifest(newer), "manifest_rollback"),
    ]
    # The expired case signs version 3; version 4 is accepted below, so the replay of 2 is older.
    for name, make, code in hostile:
        if name == "replayed older":
            mirror.publish([])  # version 4: a newer good manifest, accepted by one more install
            assert stoker(daemon, "install", "cpu", "--variant", meta.variant, "--json").returncode == 0
        make()
        seen = len(daemon.history(machine=machine, limit=1000))
        out = stoker(daemon, "install", "cpu", "--variant", meta.variant, "--json")
        rows = daemon.history(machine=machine, limit=1000)
        new_rows = rows[: len(rows) - seen]
        assert code in causes(new_rows), (name, out.returncode, out.stdout, out.stderr[-2000:], new_rows)
        if out.returncode != 0:  # refused (a chain of sources may also fall back to this machine's cache)
            assert _result(out)["error"]["reason"] == "cpu_bundle_install_failed"
        assert slot.read_bytes() == slot_json, name
        st = daemon.call("status")
        assert st["state"] == "ready" and st["pid"] == pid, (name, st)
        assert _complete(st) == 4

    # Bytes that are not the signed ones: a newer release's URL serving a shorter body (the release
    # the slot already holds would be `current`: nothing fetched).
    from tests.integration.engine_repack import repack

    newer = repack(cpu_bundle, tmp_path / "newer.zip", version=f"{meta.version}.9")
    release = Mirror(tmp_path / "mirror-newer", fault_server, key)
    release.publish([newer], version=50)
    data = newer.read_bytes()
    fault_server.add(release.bundle_path(), data[: len(data) // 2], Fault(chunked=True))
    out = stoker(daemon, "install", "cpu", "--variant", meta.variant, "--json")
    assert out.returncode == 1 and _result(out)["error"]["evidence"]["cause"] == "bundle_digest_mismatch"
    assert slot.read_bytes() == slot_json
    st = daemon.call("status")
    assert st["state"] == "ready" and st["pid"] == pid and _complete(st) == 4


@pytest.mark.engine
def test_a_fresh_home_installs_its_engine_from_a_signed_mirror_and_serves(
    stoker_home, model, cpu_bundle, fault_server, tmp_path
):
    """No bundle installed: the daemon's first run resolves the CPU bundle from the signed
    mirror over HTTP, verifies and smoke-tests it, and serves; history says it came signed."""
    key = generate_key(tmp_path / "key")
    mirror = Mirror(tmp_path / "mirror", fault_server, key)
    mirror.publish([cpu_bundle])
    meta = bundle_meta_of(cpu_bundle)
    d = DaemonProcess(stoker_home)
    write_config(
        d.paths, tiny_config(model) + f'[bundles]\nmanifest = "{mirror.url}"\ntrusted_keys = ["{key.public_text}"]\n'
    )
    d.start()
    try:
        st = d.wait_state("ready", timeout=300)
        assert st["backend"] == "cpu" and st["variant"] == meta.variant
        rows = list(reversed(d.history(machine=I.INSTALL.machine_id("cpu", meta.variant))))
        assert rows[-1]["to_state"] == "installed" and "smoke_testing" in [r["to_state"] for r in rows]
        resolved = next(r for r in rows if r["event"] == "Resolved")
        assert resolved["evidence"]["manifest"]["key_id"] == key.keyid
        assert [r.path for r in fault_server.requests()] == ["/manifest.json", mirror.bundle_path()]
        assert _complete(st) == 4
    finally:
        d.stop()
        for proc in servers_for(model):
            proc.kill()


def _sha_file(path: Path) -> str:
    from stoker.daemon.core.digests import sha256_file

    return sha256_file(path)
