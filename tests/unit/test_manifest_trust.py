"""Signed mirror manifests: keys, envelopes, the trust policy, the rollback record, publishing.

The policy's every branch on bytes in memory (the hostile mirror over real HTTP, and the
daemon's refusals with the previous bundle intact, are tests/faults/test_hostile_mirror.py).
"""

from __future__ import annotations

import base64
import json
import stat

import pytest

from stoker.daemon.bundles.metadata import BundleManifest, format_timestamp
from stoker.daemon.bundles.mirror import MANIFEST_PAYLOAD_TYPE, publish_mirror
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.signing import (
    Envelope,
    SignatureError,
    generate_key,
    load_private_key,
    parse_public_key,
    sign_envelope,
)
from stoker.daemon.install.trust import ManifestTrust
from stoker.store import open_store
from stoker.store.manifests import ManifestVersions
from tests.bundlekit import make_bundle_zip

NOW = 1_800_000_000.0  # 2027-01-15
ENTRY = {
    "url": "bundles/aa.zip",
    "sha256": "a" * 64,
    "size": 10,
    "backend": "cpu",
    "variant": "avx2",
    "version": "b11434",
    "platform": "linux-x86_64",
}


@pytest.fixture
def key(tmp_path):
    return generate_key(tmp_path / "key")


@pytest.fixture
def other_key(tmp_path):
    return generate_key(tmp_path / "other")


def payload(version: int = 1, *, expires: float = NOW + 86400, channel: str = "stable", **extra) -> bytes:
    doc = {
        "schema_version": 1,
        "version": version,
        "expires": format_timestamp(expires),
        "channel": channel,
        "bundles": [ENTRY],
        **extra,
    }
    return json.dumps(doc, sort_keys=True).encode()


def signed(key, body: bytes) -> bytes:
    return sign_envelope(body, MANIFEST_PAYLOAD_TYPE, key).to_json()


def refused(trust: ManifestTrust, source: str, raw: bytes, channel: str = "stable") -> StokerError:
    with pytest.raises(StokerError) as err:
        trust.admit(source, raw, channel)
    return err.value


URL = "http://127.0.0.1:8000/mirror/manifest.json"


def test_keygen_writes_a_0600_key_never_over_another_and_its_public_text_round_trips(tmp_path, key):
    assert stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        generate_key(tmp_path / "key")
    again = load_private_key(tmp_path / "key")
    assert again.public == key.public and parse_public_key(key.public_text) == key.public
    assert key.public_text.startswith("ed25519:") and len(key.keyid) == 16
    for bad in ("ssh-ed25519 AAAA", "ed25519:not base64!", "ed25519:" + base64.b64encode(b"short").decode()):
        with pytest.raises(SignatureError):
            parse_public_key(bad)
    (tmp_path / "junk").write_text("not a key")
    with pytest.raises(SignatureError):
        load_private_key(tmp_path / "junk")


def test_a_signature_covers_the_exact_bytes_and_the_payload_type(key):
    body = payload()
    envelope = sign_envelope(body, MANIFEST_PAYLOAD_TYPE, key)
    trusted = {key.keyid: key.public}
    assert Envelope.from_document(json.loads(envelope.to_json())).signers(trusted) == (key.keyid,)
    # One byte more whitespace: the same JSON, other bytes; the signature no longer holds.
    assert Envelope(MANIFEST_PAYLOAD_TYPE, body + b" ", envelope.signatures).signers(trusted) == ()
    # The same bytes presented as another kind of document.
    assert Envelope("application/json", body, envelope.signatures).signers(trusted) == ()
    # A signature that names the trusted key id but was made by another key.
    assert Envelope(MANIFEST_PAYLOAD_TYPE, body, ((key.keyid, b"\0" * 64),)).signers(trusted) == ()


def test_no_keys_reads_a_local_manifest_but_refuses_one_from_the_network(tmp_path, key):
    trust = ManifestTrust()
    local = tmp_path / "m" / "manifest.json"
    admitted = trust.admit(str(local), payload())
    assert admitted.manifest.bundles[0].url == (tmp_path / "m" / "bundles" / "aa.zip").as_uri()
    assert "not checked" in admitted.provenance["trust"]
    assert trust.admit(str(local), signed(key, payload())).manifest.version == 1  # signed: read the same
    for raw in (payload(), signed(key, payload())):
        err = refused(trust, URL, raw)
        assert err.reason == "manifest_untrusted" and err.evidence["trusted_keys"] == []
        assert "no `[bundles] trusted_keys`" in err.message


def test_with_keys_only_a_valid_signature_by_one_of_them_is_believed(tmp_path, key, other_key):
    trust = ManifestTrust((key.public_text,), clock=lambda: NOW)
    admitted = trust.admit(URL, signed(key, payload()))
    assert admitted.manifest.bundles[0].url == "http://127.0.0.1:8000/mirror/bundles/aa.zip"
    assert admitted.provenance["trust"] == "signed" and admitted.provenance["key_id"] == key.keyid

    err = refused(trust, URL, payload())
    assert err.reason == "manifest_untrusted" and err.evidence["signed"] is False
    err = refused(trust, str(tmp_path / "manifest.json"), payload())  # a local file too, once keys are set
    assert err.reason == "manifest_untrusted"

    err = refused(trust, URL, signed(other_key, payload()))
    assert err.reason == "manifest_untrusted" and err.evidence["signed_by"] == [other_key.keyid]

    doc = json.loads(signed(key, payload()))
    doc["payload"] = base64.b64encode(payload(version=9)).decode()  # the bytes changed after signing
    err = refused(trust, URL, json.dumps(doc).encode())
    assert err.reason == "manifest_signature_invalid" and key.keyid in err.message

    err = refused(trust, URL, json.dumps({"payloadType": MANIFEST_PAYLOAD_TYPE, "signatures": "x"}).encode())
    assert err.reason == "manifest_signature_invalid"
    other_type = sign_envelope(payload(), "application/json", key).to_json()
    assert refused(trust, URL, other_type).reason == "manifest_signature_invalid"


def test_a_signed_manifest_must_carry_a_version_and_an_expiry_and_be_unexpired(key):
    trust = ManifestTrust((key.public_text,), clock=lambda: NOW)
    body = json.dumps({"schema_version": 1, "bundles": [ENTRY]}).encode()
    assert refused(trust, URL, signed(key, body)).reason == "bundle_metadata_mismatch"
    err = refused(trust, URL, signed(key, payload(expires=NOW - 1)))
    assert err.reason == "manifest_expired"
    assert err.evidence["expires"] == format_timestamp(NOW - 1) and err.evidence["now"] == format_timestamp(NOW)


def test_rollback_is_refused_per_key_and_channel_and_remembered_across_a_restart(tmp_path, key, other_key):
    db = tmp_path / "stoker.db"
    store = open_store(db)
    trust = ManifestTrust((key.public_text, other_key.public_text), store, clock=lambda: NOW)
    assert trust.admit(URL, signed(key, payload(2))).provenance["previous_version"] is None
    assert trust.admit(URL, signed(key, payload(2))).manifest.version == 2  # the same bytes again: fine
    err = refused(trust, URL, signed(key, payload(1)))
    assert err.reason == "manifest_rollback"
    assert err.evidence["accepted_version"] == 2 and err.evidence["version"] == 1
    # The same version with other contents is a fork, refused too.
    err = refused(trust, URL, signed(key, payload(2, note="other")))
    assert err.reason == "manifest_rollback" and "same version" in err.message
    # Another channel, another key: their own sequences.
    assert trust.admit(URL, signed(key, payload(1, channel="nightly")), "nightly").manifest.channel == "nightly"
    assert trust.admit(URL, signed(other_key, payload(1))).manifest.version == 1
    assert trust.admit(URL, signed(key, payload(3))).provenance["previous_version"] == 2
    store.close()

    store = open_store(db)  # a restarted daemon
    try:
        trust = ManifestTrust((key.public_text,), store, clock=lambda: NOW)
        assert refused(trust, URL, signed(key, payload(2))).reason == "manifest_rollback"
        rows = {(r.key_id, r.channel): r.version for r in ManifestVersions(store).all()}
        assert rows == {(key.keyid, "stable"): 3, (key.keyid, "nightly"): 1, (other_key.keyid, "stable"): 1}
    finally:
        store.close()


def test_another_channels_manifest_at_this_channels_url_is_refused_and_moves_no_sequence(tmp_path, key):
    """A nightly manifest signed by the trusted key, served where the stable one is read: refused
    with manifest_wrong_channel, neither channel's accepted version moves, so the stable channel
    is not frozen on it and its older releases are never offered as stable's."""
    store = open_store(tmp_path / "stoker.db")
    try:
        trust = ManifestTrust((key.public_text,), store, clock=lambda: NOW)
        assert trust.admit(URL, signed(key, payload(5))).manifest.version == 5
        err = refused(trust, URL, signed(key, payload(1, channel="nightly")))
        assert err.reason == "manifest_wrong_channel"
        assert err.evidence["channel"] == "nightly" and err.evidence["channel_asked"] == "stable"
        assert "nightly" in err.message and "stable" in err.message
        assert {(r.channel, r.version) for r in ManifestVersions(store).all()} == {("stable", 5)}
        # Asked as stable's, a stable manifest of a newer version is still accepted: nothing froze.
        assert trust.admit(URL, signed(key, payload(6))).provenance["previous_version"] == 5
        # And the stable manifest read as the nightly channel's is refused the same way.
        err = refused(trust, URL, signed(key, payload(7)), "nightly")
        assert err.reason == "manifest_wrong_channel" and err.evidence["channel_asked"] == "nightly"
        assert {(r.channel, r.version) for r in ManifestVersions(store).all()} == {("stable", 6)}
    finally:
        store.close()


def test_publish_writes_a_content_addressed_mirror_and_raises_the_version(tmp_path, key):
    first, second = make_bundle_zip(tmp_path, "a.zip"), make_bundle_zip(tmp_path, "b.zip", variant="compat")
    mirror = tmp_path / "mirror"
    result = publish_mirror(mirror, [first], key, expires_days=2, clock=lambda: NOW)
    assert (
        result.version == 1 and result.previous_version is None and result.expires == format_timestamp(NOW + 2 * 86400)
    )
    trust = ManifestTrust((key.public_text,), clock=lambda: NOW)
    manifest = trust.admit(str(mirror / "manifest.json"), (mirror / "manifest.json").read_bytes()).manifest
    (entry,) = manifest.bundles
    assert entry.url == (mirror / "bundles" / f"{entry.sha256}.zip").as_uri()
    assert (mirror / "bundles" / f"{entry.sha256}.zip").read_bytes() == first.read_bytes()

    result = publish_mirror(mirror, [second], key, clock=lambda: NOW)  # the first entry stays
    assert result.version == 2 and [e["variant"] for e in result.entries] == ["avx2", "compat"]
    assert result.added == (f"bundles/{result.entries[1]['sha256']}.zip",)
    with pytest.raises(StokerError) as err:
        publish_mirror(mirror, [second], key, version=2, clock=lambda: NOW)
    assert err.value.reason == "manifest_rollback"
    assert publish_mirror(mirror, [second], key, version=10, clock=lambda: NOW).added == ()
    payload_doc = json.loads(Envelope.from_document(json.loads((mirror / "manifest.json").read_bytes())).payload)
    assert payload_doc["version"] == 10 and all(not e["url"].startswith("/") for e in payload_doc["bundles"])
    assert (
        BundleManifest.from_dict(payload_doc, "https://example.org/m/manifest.json")
        .bundles[0]
        .url.startswith("https://example.org/m/bundles/")
    )


def test_trusted_keys_are_checked_when_the_config_is_read(key):
    from stoker.daemon.config.model import ConfigError, parse_config

    config = parse_config(f'[bundles]\ntrusted_keys = ["{key.public_text}", "{key.public_text}"]\n')
    assert config.bundles.trusted_keys == (key.public_text,)
    with pytest.raises(ConfigError) as err:
        parse_config('[bundles]\ntrusted_keys = ["ed25519:AAAA"]\n')
    assert err.value.problems[0].startswith("bundles.trusted_keys:")
    with pytest.raises(ConfigError):
        parse_config(f'[bundles]\ntrusted_keys = "{key.public_text}"\n')


def test_a_mirror_offers_every_cuda_family_of_one_release_side_by_side(tmp_path, key):
    """Two CUDA bundles of one release, built for different architecture families, are two
    entries: a daemon picks the one that covers its GPU's compute capability. Republishing one
    family replaces only that family's entry."""
    families = {"turing-ampere": ("75-real", "80-real", "86-real"), "ada-hopper": ("89-real", "90-real")}
    zips = {
        name: make_bundle_zip(tmp_path, f"{name}.zip", backend="cuda", cuda_archs=archs, min_driver="580.65.06")
        for name, archs in families.items()
    }
    mirror = tmp_path / "mirror"
    result = publish_mirror(mirror, list(zips.values()), key, clock=lambda: NOW)
    assert [tuple(e["cuda_archs"]) for e in result.entries] == list(families.values())
    rebuilt = make_bundle_zip(tmp_path / "again", "ada.zip", backend="cuda", cuda_archs=families["ada-hopper"])
    result = publish_mirror(mirror, [rebuilt], key, clock=lambda: NOW)
    assert [tuple(e["cuda_archs"]) for e in result.entries] == list(families.values())
    assert result.entries[1]["sha256"] != result.entries[0]["sha256"] and result.added
    trust = ManifestTrust((key.public_text,), clock=lambda: NOW)
    manifest = trust.admit(str(mirror / "manifest.json"), (mirror / "manifest.json").read_bytes()).manifest
    assert [b.cuda_archs for b in manifest.bundles] == list(families.values())
