"""ed25519 keys and signed envelopes: how a mirror's manifest is signed, and checked.

The envelope is DSSE's (the in-toto / sigstore "Dead Simple Signing Envelope"):

    {"payloadType": T, "payload": base64(BYTES), "signatures": [{"keyid": K, "sig": base64(SIG)}]}

with SIG = ed25519 over PAE(T, BYTES) = b"DSSEv1 <len T> T <len BYTES> BYTES". The signature
covers the exact bytes carried, never a re-serialisation: the payload is parsed only after a
signature on those bytes was verified, so no JSON canonicalisation can differ between the signer
and the checker, and the payload type is signed with it (a signature the same key made over
something else cannot pass for a manifest).

Keys: the private key is a PKCS#8 PEM file (`openssl pkey` reads it), written 0600; the public
key's one-line form, what `[bundles] trusted_keys` takes, is `ed25519:` and base64 of its 32 raw
bytes. A key id is the first 16 hex digits of the raw public key's sha256: a hint for which key
signed (every trusted key is tried anyway), never trusted on its own.

The `cryptography` package does the ed25519 arithmetic (docs/mirror.md says why that one); it is
imported only where a key is made, loaded or checked, so parsing a key's text costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import attrs

PUBLIC_KEY_PREFIX = "ed25519:"
PAE_PREFIX = b"DSSEv1"
RAW_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class SignatureError(ValueError):
    """A key's text, a key file or an envelope is malformed; the message says which and how."""


def parse_public_key(text: str) -> bytes:
    """The 32 raw bytes of a public key written `ed25519:BASE64`; SignatureError otherwise."""
    if not isinstance(text, str) or not text.startswith(PUBLIC_KEY_PREFIX):
        raise SignatureError(f"a public key is written {PUBLIC_KEY_PREFIX}BASE64 (what `stoker bundle keygen` prints)")
    try:
        raw = base64.b64decode(text[len(PUBLIC_KEY_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("the public key's base64 is malformed") from None
    if len(raw) != RAW_KEY_BYTES:
        raise SignatureError(f"an ed25519 public key is {RAW_KEY_BYTES} bytes, this one {len(raw)}")
    return raw


def public_key_text(raw: bytes) -> str:
    """The one-line form of a public key: `ed25519:` and base64 of its raw bytes."""
    return PUBLIC_KEY_PREFIX + base64.b64encode(raw).decode("ascii")


def key_id(raw: bytes) -> str:
    """A key's id: the first 16 hex digits of the sha256 of its raw public bytes."""
    return hashlib.sha256(raw).hexdigest()[:16]


@attrs.frozen
class SigningKey:
    """A private key loaded from its file, with its public half's raw bytes and id."""

    private: Any = attrs.field(repr=False)  # cryptography's Ed25519PrivateKey
    public: bytes

    @property
    def keyid(self) -> str:
        return key_id(self.public)

    @property
    def public_text(self) -> str:
        return public_key_text(self.public)

    def sign(self, data: bytes) -> bytes:
        return bytes(self.private.sign(data))


def _public_raw(private: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def generate_key(path: Path) -> SigningKey:
    """A new key pair: the private key written to `path` (0600, never over an existing file)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    return SigningKey(private, _public_raw(private))


def load_private_key(path: Path) -> SigningKey:
    """The key in a PKCS#8 PEM file `generate_key` wrote; SignatureError if it is not one."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    data = Path(path).read_bytes()
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as err:
        raise SignatureError(f"{path} is not an unencrypted PEM private key ({err})") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise SignatureError(f"{path} holds a {type(private).__name__}, not an ed25519 key")
    return SigningKey(private, _public_raw(private))


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is actually signed."""
    kind = payload_type.encode("utf-8")
    return b" ".join([PAE_PREFIX, str(len(kind)).encode(), kind, str(len(payload)).encode(), payload])


@attrs.frozen
class Envelope:
    """A parsed DSSE envelope: the payload bytes (unparsed) and the signatures on them."""

    payload_type: str
    payload: bytes
    signatures: tuple[tuple[str, bytes], ...]  # (keyid as the signer wrote it, signature)

    @staticmethod
    def looks_like(document: Any) -> bool:
        """Whether a decoded JSON document is shaped as an envelope (not a plain document)."""
        return isinstance(document, Mapping) and "payloadType" in document and "signatures" in document

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> "Envelope":
        """Parse a decoded envelope; SignatureError on any malformed part."""
        kind, payload, sigs = document.get("payloadType"), document.get("payload"), document.get("signatures")
        if not isinstance(kind, str) or not isinstance(payload, str) or not isinstance(sigs, list):
            raise SignatureError("the envelope needs a string payloadType and payload and a list of signatures")
        body = _b64(payload, "payload")
        signatures = []
        for sig in sigs:
            if not isinstance(sig, Mapping) or not isinstance(sig.get("sig"), str):
                raise SignatureError("each signature needs a base64 `sig`")
            keyid = sig.get("keyid")
            signatures.append((keyid if isinstance(keyid, str) else "", _b64(sig["sig"], "sig")))
        return cls(kind, body, tuple(signatures))

    def to_json(self) -> bytes:
        """The envelope as served: one JSON document, the payload base64 inside."""
        doc = {
            "payloadType": self.payload_type,
            "payload": base64.b64encode(self.payload).decode("ascii"),
            "signatures": [{"keyid": k, "sig": base64.b64encode(s).decode("ascii")} for k, s in self.signatures],
        }
        return (json.dumps(doc, indent=2) + "\n").encode("ascii")

    def signers(self, trusted: Mapping[str, bytes]) -> tuple[str, ...]:
        """The ids of the trusted keys (id -> raw public key) with a valid signature here.

        Every signature is tried against every trusted key: the keyid a signature names is the
        signer's claim, so it never decides alone."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        message = pae(self.payload_type, self.payload)
        valid = []
        for keyid, raw in trusted.items():
            public = Ed25519PublicKey.from_public_bytes(raw)
            for _claimed, sig in self.signatures:
                if len(sig) != SIGNATURE_BYTES:
                    continue
                try:
                    public.verify(sig, message)
                except InvalidSignature:
                    continue
                valid.append(keyid)
                break
        return tuple(valid)


def sign_envelope(payload: bytes, payload_type: str, key: SigningKey) -> Envelope:
    """An envelope carrying `payload`, signed by `key`."""
    return Envelope(payload_type, payload, ((key.keyid, key.sign(pae(payload_type, payload))),))


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        try:  # DSSE allows the URL-safe alphabet too
            return base64.urlsafe_b64decode(text)
        except (binascii.Error, ValueError):
            raise SignatureError(f"the envelope's {what} is not base64") from None
