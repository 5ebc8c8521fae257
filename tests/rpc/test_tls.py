"""Mutual TLS on a real grpc.aio server and on the step socket, with certificates from `reconfig certs`; the token
kept off plaintext links to other hosts."""

from __future__ import annotations

import argparse
import stat

import grpc
import pytest

from services.router.driver import WorkerUnreachable, _WorkerStream
from services.rpc.auth import InsecureTokenError, check_token_transport, is_local_target, target_host
from services.rpc.certs import check_hosts, write_dev_certs
from services.rpc.reconfig.v1 import weightstore_pb2, weightstore_pb2_grpc
from services.rpc.server import listen, new_server
from services.rpc.tls import TLSConfig, TLSError, add_tls_arguments, aio_channel, from_args, from_env, tls_config
from services.weightstore.server import WeightStoreServicer
from services.worker.step_server import start_step_server


def _config(files) -> TLSConfig:
    return TLSConfig(str(files.cert), str(files.key), str(files.ca))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The stack's CA with certificates for two hosts, and a second CA with one of its own (an intruder)."""
    ours = write_dev_certs(["node-a", "node-b"], tmp_path_factory.mktemp("ours"))
    theirs = write_dev_certs(["node-a"], tmp_path_factory.mktemp("theirs"))
    return {"server": _config(ours[0]), "client": _config(ours[1]), "intruder": _config(theirs[0])}


@pytest.fixture
async def server(pki):
    """A weight store servicer (Health answers before any checkpoint) behind a mutual-TLS port only."""
    grpc_server = new_server()
    weightstore_pb2_grpc.add_WeightStoreServicer_to_server(WeightStoreServicer(), grpc_server)
    port = listen(grpc_server, "127.0.0.1", 0, "weight store", pki["server"])
    await grpc_server.start()
    yield f"127.0.0.1:{port}"
    await grpc_server.stop(None)


async def _health(channel: grpc.aio.Channel) -> weightstore_pb2.HealthResponse:
    async with channel:
        stub = weightstore_pb2_grpc.WeightStoreStub(channel)
        return await stub.Health(weightstore_pb2.HealthRequest(), timeout=5)


def test_certs_are_written_with_private_keys(tmp_path):
    written = write_dev_certs(["h1", "10.0.0.2", "h1"], tmp_path / "certs")
    assert [files.host for files in written] == ["h1", "10.0.0.2"]
    for files in written:
        assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
        assert files.cert.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert stat.S_IMODE((tmp_path / "certs" / "ca-key.pem").stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="not a host name"):
        check_hosts(["ok", "bad/name"])
    with pytest.raises(ValueError, match="names no host"):
        check_hosts([" ", ""])


async def test_a_client_with_a_certificate_of_the_ca_is_served(pki, server):
    reply = await _health(aio_channel(server, pki["client"]))
    assert reply.pid > 0


async def test_a_client_without_a_certificate_is_refused(pki, server):
    credentials = grpc.ssl_channel_credentials(root_certificates=open(pki["server"].ca, "rb").read())
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _health(grpc.aio.secure_channel(server, credentials))
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_client_with_a_certificate_of_another_ca_is_refused(pki, server):
    # It trusts our CA (so it would accept the server), but presents a certificate our CA did not sign.
    intruder = pki["intruder"]
    credentials = grpc.ssl_channel_credentials(root_certificates=open(pki["server"].ca, "rb").read(),
                                               private_key=open(intruder.key, "rb").read(),
                                               certificate_chain=open(intruder.cert, "rb").read())
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _health(grpc.aio.secure_channel(server, credentials))
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_plaintext_client_is_refused(server):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _health(grpc.aio.insecure_channel(server))
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_the_step_socket_is_mutual_tls(pki):
    step_server, port = await start_step_server(servicer=None, host="127.0.0.1", port=0, token="secret",
                                                tls=pki["server"])
    try:
        stream = _WorkerStream("127.0.0.1:1", (), "secret", pki["client"])
        await stream.open(port)  # the greeting went through: the worker answered it
        assert stream.is_open
        await stream.close()
        for refused in (None, pki["intruder"]):  # plaintext, and a certificate of another CA
            stream = _WorkerStream("127.0.0.1:1", (), "secret", refused)
            with pytest.raises(WorkerUnreachable, match="cannot open its step socket"):
                await stream.open(port, timeout_s=5)
            await stream.channel.close()
    finally:
        step_server.close()


@pytest.mark.parametrize("target, host", [
    ("127.0.0.1:50051", "127.0.0.1"), ("[::1]:8", "::1"), ("dns:///worker-0:50100", "worker-0"),
    ("ipv4:10.1.2.3:5", "10.1.2.3"), ("ipv6:[fe80::1]:5", "fe80::1"), ("unix:/run/x.sock", ""), ("node-a", "node-a"),
])
def test_target_host(target, host):
    assert target_host(target) == host


@pytest.mark.parametrize("target, local", [
    ("127.0.0.1:1", True), ("127.8.9.10:1", True), ("localhost:1", True), ("[::1]:1", True), ("0.0.0.0:1", True),
    ("unix:/tmp/s", True), ("10.0.0.2:1", False), ("node-b:50051", False), ("[2001:db8::1]:1", False),
    ("localhost.example.com:1", False),
])
def test_only_this_host_is_local(target, local):
    assert is_local_target(target) is local


def test_the_token_goes_in_plaintext_only_to_this_host():
    check_token_transport("127.0.0.1:50051", secure=False)
    check_token_transport("node-b:50051", secure=True)
    check_token_transport("node-b:50051", secure=False, allow_plaintext=True)
    with pytest.raises(InsecureTokenError, match=r"node-b:50051.*--tls-cert"):
        check_token_transport("node-b:50051", secure=False)


async def test_a_channel_bearing_the_token_to_another_host_needs_tls(pki, monkeypatch):
    monkeypatch.delenv("RECONFIG_ALLOW_PLAINTEXT_TOKEN", raising=False)
    with pytest.raises(InsecureTokenError, match="10.0.0.2:50100"):
        aio_channel("10.0.0.2:50100", None, carries_token=True)
    for channel in (aio_channel("10.0.0.2:50100", None),  # no token on it: plaintext stays allowed
                    aio_channel("10.0.0.2:50100", pki["client"], carries_token=True)):
        await channel.close()


def test_settings_are_all_three_files(pki, tmp_path):
    assert tls_config(None, "", None) is None
    with pytest.raises(TLSError, match="missing --tls-key, --tls-ca"):
        tls_config(pki["client"].cert, None, None)
    with pytest.raises(TLSError, match=f"--tls-ca {tmp_path / 'absent.pem'}: no such readable file"):
        tls_config(pki["client"].cert, pki["client"].key, str(tmp_path / "absent.pem"))
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    args = parser.parse_args(["--tls-cert", pki["client"].cert, "--tls-key", pki["client"].key,
                              "--tls-ca", pki["client"].ca])
    assert from_args(args) == pki["client"]
    assert from_args(parser.parse_args([])) is None
    environ = {"RECONFIG_TLS_CERT": pki["client"].cert, "RECONFIG_TLS_KEY": pki["client"].key,
               "RECONFIG_TLS_CA": pki["client"].ca}
    assert from_env(environ) == pki["client"] and from_env({}) is None
