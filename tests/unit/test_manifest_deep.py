"""A manifest (or bundle.json) whose JSON nests 100,000 deep is refused with a manifest reason
code, as any malformed manifest is: never internal_error from a RecursionError, signed or not,
with trusted keys or without, and a mirror's own previous manifest the same."""

from __future__ import annotations

import pytest

from stoker.daemon.bundles.metadata import BundleManifest, BundleMeta
from stoker.daemon.bundles.mirror import MANIFEST_NAME, read_previous
from stoker.daemon.core.errors import StokerError
from stoker.daemon.install.trust import ManifestTrust
from stoker.states.reasons import ReasonCode
from tests.unit.test_manifest_trust import NOW, URL, key, signed  # noqa: F401 - `key` is a fixture

DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"bundles":' * 100_000 + b"1" + b"}" * 100_000


@pytest.mark.parametrize("raw", [DEEP, DEEP_OBJECT], ids=["arrays", "objects"])
def test_a_deep_manifest_is_malformed_not_an_internal_error(tmp_path, key, raw):  # noqa: F811
    with pytest.raises(StokerError) as local:
        ManifestTrust().admit(str(tmp_path / "manifest.json"), raw)
    assert local.value.reason is ReasonCode.BUNDLE_METADATA_MISMATCH and "not valid JSON" in local.value.message

    trust = ManifestTrust((key.public_text,), clock=lambda: NOW)
    with pytest.raises(StokerError) as unsigned:
        trust.admit(URL, raw)
    assert unsigned.value.reason is ReasonCode.MANIFEST_UNTRUSTED  # not a signed envelope: not believed
    with pytest.raises(StokerError) as in_envelope:
        trust.admit(URL, signed(key, raw))  # signed by the trusted key, and still no manifest
    assert in_envelope.value.reason is ReasonCode.BUNDLE_METADATA_MISMATCH

    for parse in (BundleManifest.from_json, BundleMeta.from_json):
        with pytest.raises(StokerError) as err:
            parse(raw)
        assert err.value.reason is ReasonCode.BUNDLE_METADATA_MISMATCH

    (tmp_path / MANIFEST_NAME).write_bytes(raw)
    with pytest.raises(StokerError) as previous:
        read_previous(tmp_path)
    assert previous.value.reason is ReasonCode.BUNDLE_METADATA_MISMATCH
