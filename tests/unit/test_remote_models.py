"""Remote models (`[models.NAME] endpoint`): the config's checks, what a contact with the endpoint
means (states/frontdoor/remote_endpoint.py), and https to an endpoint through the front door's wire (a
loopback TLS server with a certificate made here)."""

from __future__ import annotations

import datetime
import ssl
from functools import partial

import httpx
import pytest
import trio

from stoker.daemon.config.model import ConfigError, parse_config
from stoker.daemon.config.instances import served_models
from stoker.daemon.engine.api import EngineClient
from stoker.daemon.engine.wire import EngineWire
from stoker.states.reasons import ReasonCode
from stoker.states.frontdoor.remote_endpoint import Contact, judge

LOCAL = '[models.chat]\nmodel = "/m/chat.gguf"\n'


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    return err.value.problems


def test_a_remote_section_is_parsed_and_kept_out_of_the_models_stoker_runs():
    config = parse_config(
        LOCAL
        + '[models.big]\nendpoint = "https://gpu.example:8000/v1/"\napi_key_env = "BIG_KEY"\n'
        + 'remote_model = "meta-llama/Llama-3.1-70B-Instruct"\n'
    )
    (big,) = config.remotes
    assert big.endpoint == "https://gpu.example:8000/v1" and big.base_path == "/v1" and big.tls
    assert big.upstream_model == "meta-llama/Llama-3.1-70B-Instruct" and big.api_key_env == "BIG_KEY"
    assert [m.name for m in config.models] == ["chat"]
    assert [s.name for s in served_models(config)] == ["chat"]  # no server, no plan, no placement for big
    assert config.to_dict()["models"]["big"]["endpoint"] == "https://gpu.example:8000/v1"


def test_a_remote_model_with_no_name_on_the_endpoint_is_sent_its_own_name():
    config = parse_config('[models.big]\nendpoint = "http://127.0.0.1:8000/v1"\n')
    assert config.remotes[0].upstream_model == "big" and config.remotes[0].api_key_env is None


def test_a_remote_default_takes_the_default_from_the_local_models():
    config = parse_config(LOCAL + '[models.big]\nendpoint = "http://127.0.0.1:8000/v1"\ndefault = true\n')
    assert not any(s.default for s in served_models(config))  # "default" routes to big
    assert problems(
        LOCAL.replace('gguf"\n', 'gguf"\ndefault = true\n')
        + '[models.big]\nendpoint = "http://127.0.0.1:8000/v1"\ndefault = true\n'
    ) == ["models: default = true on chat, big; at most one model is the default"]


def test_both_a_model_and_an_endpoint_are_refused():
    (problem,) = problems('[models.big]\nmodel = "/m/x.gguf"\nendpoint = "http://127.0.0.1:8000/v1"\n')
    assert problem.startswith("models.big: has both model and endpoint") and "remove one" in problem


@pytest.mark.parametrize(
    "url, words",
    [
        ("ftp://10.0.0.5/v1", "must be an http:// or https:// URL"),
        ("10.0.0.5:8000/v1", "must be an http:// or https:// URL"),
        ("http:///v1", "has no host"),
        ("https://user:pw@gpu.example/v1", "must not carry a user or password"),
        ("https://gpu.example/v1?key=x", "without a query"),
        ("https://gpu.example:99999/v1", "is not a valid URL"),
    ],
)
def test_an_endpoint_that_is_not_an_http_base_url_is_refused(url, words):
    (problem,) = problems(f'[models.big]\nendpoint = "{url}"\n')
    assert problem.startswith("models.big.endpoint: ") and words in problem, problem


def test_plain_http_to_another_machine_needs_allow_insecure():
    (problem,) = problems('[models.big]\nendpoint = "http://10.0.0.5:8000/v1"\n')
    assert "plain http to another machine" in problem and "allow_insecure = true" in problem
    config = parse_config('[models.big]\nendpoint = "http://10.0.0.5:8000/v1"\nallow_insecure = true\n')
    assert config.remotes[0].allow_insecure
    for loopback in ("127.0.0.1", "localhost", "[::1]"):
        parse_config(f'[models.big]\nendpoint = "http://{loopback}:8000/v1"\n')  # this machine: no network crossed
    parse_config('[models.big]\nendpoint = "https://10.0.0.5:8000/v1"\n')


def test_the_keys_of_a_local_model_and_a_key_in_place_of_a_variable_are_refused():
    found = problems(
        '[models.big]\nendpoint = "http://127.0.0.1:8000/v1"\npinned = true\nidle_ttl_s = 60\n'
        'api_key_env = "sk-abc-123"\ncolour = "red"\n'
    )
    assert "models.big.pinned: only for a model Stoker runs itself; [models.big] is served by its endpoint" in found
    assert any(p.startswith("models.big.idle_ttl_s: only for a model Stoker runs itself") for p in found)
    assert any(p.startswith("models.big.api_key_env: must be the name of an environment variable") for p in found)
    assert any(p.startswith("models.big.colour: unknown key for a remote model") for p in found)


def test_what_each_contact_with_the_endpoint_means():
    missing = judge(Contact.KEY_MISSING)
    assert (missing.reachable, missing.reason, missing.status, missing.retry_after_s) == (
        None,
        ReasonCode.REMOTE_KEY_MISSING,
        503,
        None,
    )
    never = judge(Contact.NOT_CONNECTED)
    assert (never.reachable, never.reason, never.status, never.retry_after_s) == (
        False,
        ReasonCode.REMOTE_ENDPOINT_UNREACHABLE,
        503,
        5,
    )
    lost = judge(Contact.LOST)  # it may have run the request: no invitation to send it again
    assert (lost.status, lost.retry_after_s, lost.reason) == (502, None, ReasonCode.REMOTE_ENDPOINT_UNREACHABLE)
    for status in (401, 403):
        rejected = judge(Contact.ANSWERED, status)
        assert (rejected.reachable, rejected.reason, rejected.status) == (True, ReasonCode.REMOTE_KEY_REJECTED, 502)
    for status in (200, 400, 404, 500, 503):
        assert judge(Contact.ANSWERED, status).relayed and judge(Contact.ANSWERED, status).reachable


# --- https through the wire ------------------------------------------------------------------


def certificate() -> tuple[bytes, bytes]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stoker test endpoint")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


async def tls_endpoint(nursery: trio.Nursery, tmp_path, seen: list[bytes]) -> tuple[str, ssl.SSLContext]:
    """An https endpoint on loopback answering every request with a small JSON (its heads kept)."""
    cert, key = certificate()
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")

    async def connection(stream: trio.SSLStream) -> None:
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            seen.append(data)
            body = b'{"object":"list","data":[{"id":"big"}]}'
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await stream.aclose()
        except trio.BrokenResourceError:
            pass

    listeners = await nursery.start(partial(trio.serve_ssl_over_tcp, connection, 0, server, host="127.0.0.1"))
    port = listeners[0].transport_listener.socket.getsockname()[1]
    trusting = ssl.create_default_context(cadata=cert.decode())
    return f"https://127.0.0.1:{port}/v1", trusting


async def test_an_https_endpoint_is_reached_verified_and_sent_the_key(tmp_path):
    seen: list[bytes] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            base, trusting = await tls_endpoint(nursery, tmp_path, seen)
            async with httpx.AsyncClient() as http:
                engine = EngineClient(base, "upstream-key", http, wire=EngineWire(tls=trusting))
                async with engine.forward("GET", "/v1/models") as answer:
                    body = b"".join([chunk async for chunk in answer.aiter_raw()])
                assert answer.status_code == 200 and b'"id":"big"' in body
                assert b"authorization: Bearer upstream-key" in seen[0]

                # The same endpoint with the CA bundle it is not in: refused before anything is sent.
                stranger = EngineClient(base, "upstream-key", http, wire=EngineWire())
                with pytest.raises(httpx.ConnectError, match="certificate verify failed"):
                    async with stranger.forward("GET", "/v1/models"):
                        pass
                assert len(seen) == 1
            nursery.cancel_scope.cancel()
