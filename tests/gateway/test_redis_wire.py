"""The event reader's Redis connection (gateway/redis_wire.py), on the shared real Redis: round
trips of several commands, error replies, the URL's database and name, a killed connection, a
refused one, a timeout and a cancelled round trip."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.exceptions

from benchmarks.harness.stack import free_port
from gateway.redis_wire import WireConnection, pack

pytestmark = pytest.mark.anyio


@pytest.fixture
def key(settings) -> str:
    return f"test-wire:{uuid.uuid4().hex}"


@pytest.fixture
async def wire(settings) -> AsyncIterator[WireConnection]:
    connection = WireConnection(settings.REDIS_URL, f"wire-{uuid.uuid4().hex[:8]}")
    yield connection
    connection.close()


@pytest.fixture
def sync_client(settings, key) -> redis.Redis:
    client = redis.Redis.from_url(settings.REDIS_URL)
    yield client
    client.delete(key, f"{key}:s")
    client.close()


def test_commands_are_packed_as_arrays_of_bulk_strings():
    assert pack([("SET", b"k", 1), ("GET", "k\u00e9")]) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n1\r\n*2\r\n$3\r\nGET\r\n$3\r\nk\xc3\xa9\r\n")
    with pytest.raises(TypeError, match="bool"):
        pack([("SET", "k", True)])


async def test_a_round_trip_returns_each_reply_in_order(wire, sync_client, key):
    stream = f"{key}:s"
    replies = await wire.round_trip([
        ("SET", key, b"\x00value"), ("GET", key), ("GET", f"{key}:missing"),
        ("XADD", stream, "*", "data", "one"), ("XADD", stream, "*", "data", b"two"),
        ("XREAD", "COUNT", 10, "STREAMS", stream, "0-0"),
    ])
    assert replies[:3] == [b"OK", b"\x00value", None]
    first_id, second_id = replies[3], replies[4]
    assert replies[5] == [[stream.encode(), [[first_id, [b"data", b"one"]],
                                             [second_id, [b"data", b"two"]]]]]
    # A read that finds nothing within its block is a nil.
    assert await wire.round_trip([("XREAD", "BLOCK", 10, "STREAMS", stream, second_id)]) == [None]
    assert sync_client.get(key) == b"\x00value"


async def test_an_error_reply_raises_after_every_reply_was_read(wire, sync_client, key):
    sync_client.set(key, "a string")
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        await wire.round_trip([("HSET", key, "f", "v"), ("SET", f"{key}:s", "after")])
    assert sync_client.get(f"{key}:s") == b"after"  # the command after the error ran
    assert await wire.round_trip([("GET", key)]) == [b"a string"]  # still in step


async def test_the_urls_database_and_the_connections_name(settings, key):
    url = settings.REDIS_URL.rsplit("/", 1)[0] + "/5"
    name = f"wire-{uuid.uuid4().hex[:8]}"
    connection = WireConnection(url, name)
    other = redis.Redis.from_url(url)
    try:
        await connection.round_trip([("SET", key, "in db 5")])
        assert other.get(key) == b"in db 5"
        assert [c for c in other.client_list() if c["name"] == name][0]["db"] == "5"
    finally:
        other.delete(key)
        other.close()
        connection.close()


async def test_a_killed_connection_is_made_again_and_the_round_trip_answered(wire, sync_client,
                                                                              key):
    await wire.round_trip([("SET", key, "1")])
    name = wire._client_name
    [mine] = [c for c in sync_client.client_list() if c["name"] == name]
    assert sync_client.client_kill_filter(_id=mine["id"]) == 1
    assert await wire.round_trip([("INCR", key)]) == [2]  # sent once more: nothing doubled
    assert sync_client.get(key) == b"2"
    assert [c for c in sync_client.client_list() if c["name"] == name]  # reconnected


async def test_a_refused_connection_raises_connection_error():
    connection = WireConnection(f"redis://127.0.0.1:{free_port()}/0", "refused")
    with pytest.raises(redis.exceptions.ConnectionError, match="Error connecting"):
        await connection.round_trip([("PING",)])


async def test_a_wrong_password_is_an_authentication_error(settings):
    url = settings.REDIS_URL.replace("redis://", "redis://:not-the-password@", 1)
    connection = WireConnection(url, "wrong-password")
    with pytest.raises(redis.exceptions.AuthenticationError, match="AUTH"):
        await connection.round_trip([("PING",)])


async def test_no_reply_within_the_urls_socket_timeout_is_a_timeout(settings, key, sync_client):
    url = settings.REDIS_URL + ("&" if "?" in settings.REDIS_URL else "?") + "socket_timeout=0.2"
    connection = WireConnection(url, "timeout")
    try:
        with pytest.raises(redis.exceptions.TimeoutError, match="within 0.2 s"):
            await connection.round_trip([("XREAD", "BLOCK", 2000, "STREAMS", f"{key}:s", "$")])
        assert await connection.round_trip([("PING",)]) == [b"PONG"]  # a fresh connection
    finally:
        connection.close()


async def test_a_cancelled_round_trip_never_answers_the_next_one(wire, sync_client, key):
    sync_client.set(key, "mine")
    read = asyncio.ensure_future(wire.round_trip(
        [("XREAD", "BLOCK", 300, "STREAMS", f"{key}:s", "$")]))
    await asyncio.sleep(0.05)
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    assert await wire.round_trip([("GET", key)]) == [b"mine"]
    await asyncio.sleep(0.4)  # past the cancelled read's block: its late nil reaches nobody
    assert await wire.round_trip([("GET", key)]) == [b"mine"]


def self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by its own key (PEM files: certificate, key)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test redis")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture
def tls_redis(tmp_path) -> Iterator[tuple[int, str]]:
    """A redis-server of the test's own that speaks TLS only, with a self-signed certificate:
    (its port, the certificate's path)."""
    cert, key = self_signed(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--tls-cert-file", cert,
         "--tls-key-file", key, "--tls-ca-cert-file", cert, "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                pytest.skip(f"this redis-server does not speak TLS: {proc.stdout.read()[-300:]!r}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "the TLS redis-server did not start"
            time.sleep(0.05)
        yield port, cert
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.process
async def test_a_tls_connection_checks_the_certificate_as_redis_py_does(tls_redis):
    port, cert = tls_redis
    url = f"rediss://127.0.0.1:{port}/0"
    with pytest.raises(redis.exceptions.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        await WireConnection(url, "tls-unverified").round_trip([("PING",)])
    trusted = WireConnection(f"{url}?ssl_ca_certs={cert}", "tls-trusted")
    try:
        assert await trusted.round_trip([("PING",)]) == [b"PONG"]
    finally:
        trusted.close()
    # Only a URL that asks for no check gets none, as with redis-py.
    unchecked = WireConnection(f"{url}?ssl_cert_reqs=none", "tls-none")
    try:
        assert await unchecked.round_trip([("PING",)]) == [b"PONG"]
    finally:
        unchecked.close()
