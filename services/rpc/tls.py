"""Mutual TLS for every link of the stack, built in one place: the gRPC servers and channels, and the workers' step
socket (an ssl context of the same files). Without a TLSConfig (None) every helper here is plaintext, as before."""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.rpc.auth import check_token_transport

ENV_CERT, ENV_KEY, ENV_CA = "RECONFIG_TLS_CERT", "RECONFIG_TLS_KEY", "RECONFIG_TLS_CA"
ENV_ALLOW_PLAINTEXT_TOKEN = "RECONFIG_ALLOW_PLAINTEXT_TOKEN"  # "1": the token may cross a trusted network in clear


class TLSError(ValueError):
    """The TLS settings are incomplete, or a certificate file cannot be read."""


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """This process's certificate and key, and the CA every peer's certificate must be signed by (PEM files)."""

    cert: str  # this process's certificate chain: presented to servers and to clients alike
    key: str   # its private key
    ca: str    # the CA that signed every certificate of the stack: peers are verified against it alone

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = Path(getattr(self, name))
            if not path.is_file() or not os.access(path, os.R_OK):
                raise TLSError(f"--tls-{name} {path}: no such readable file")

    def _pem(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.ca).read_bytes(), Path(self.cert).read_bytes(), Path(self.key).read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        """A gRPC server's: present our certificate, require a client certificate signed by the CA."""
        ca, cert, key = self._pem()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A gRPC channel's: verify the server against the CA, present our certificate."""
        ca, cert, key = self._pem()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def server_ssl_context(self) -> ssl.SSLContext:
        """The step socket's server side: the same mutual verification as the gRPC servers."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca)
        context.load_cert_chain(self.cert, self.key)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_ssl_context(self) -> ssl.SSLContext:
        """The step socket's client side: the server's name checked against its certificate, as gRPC does."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        context.load_cert_chain(self.cert, self.key)
        return context


def tls_config(cert: str | None, key: str | None, ca: str | None) -> TLSConfig | None:
    """A TLSConfig from the three files, None when none is given; TLSError naming what is missing."""
    given = {"cert": cert, "key": key, "ca": ca}
    if not any(given.values()):
        return None
    missing = [f"--tls-{name}" for name, value in given.items() if not value]
    if missing:
        raise TLSError(f"TLS needs --tls-cert, --tls-key and --tls-ca together; missing {', '.join(missing)}")
    return TLSConfig(str(cert), str(key), str(ca))


def add_tls_arguments(parser: argparse.ArgumentParser, from_environment: bool = False) -> None:
    """--tls-cert, --tls-key, --tls-ca: all three turn on mutual TLS (plaintext is then refused). from_environment:
    their defaults are $RECONFIG_TLS_CERT, $RECONFIG_TLS_KEY and $RECONFIG_TLS_CA (the clients: reconfigctl)."""
    defaults = {flag: os.environ.get(env) if from_environment else None
                for flag, env in (("cert", ENV_CERT), ("key", ENV_KEY), ("ca", ENV_CA))}
    where = " (default: $RECONFIG_TLS_{})" if from_environment else ""
    parser.add_argument("--tls-cert", metavar="PEM", default=defaults["cert"],
                        help="this process's certificate: with --tls-key and --tls-ca, every gRPC link (and step "
                             "socket) is mutual TLS" + where.format("CERT"))
    parser.add_argument("--tls-key", metavar="PEM", default=defaults["key"],
                        help="the private key of --tls-cert" + where.format("KEY"))
    parser.add_argument("--tls-ca", metavar="PEM", default=defaults["ca"],
                        help="the CA every peer's certificate must be signed by" + where.format("CA"))


def from_args(args: argparse.Namespace) -> TLSConfig | None:
    """The TLSConfig of add_tls_arguments' flags (None: plaintext)."""
    return tls_config(args.tls_cert, args.tls_key, args.tls_ca)


def from_env(environ: Mapping[str, str] = os.environ) -> TLSConfig | None:
    """The TLSConfig of $RECONFIG_TLS_CERT, $RECONFIG_TLS_KEY and $RECONFIG_TLS_CA (None when none is set)."""
    return tls_config(environ.get(ENV_CERT), environ.get(ENV_KEY), environ.get(ENV_CA))


def aio_channel(target: str, tls: TLSConfig | None, options: Sequence[tuple[str, object]] = (),
                carries_token: bool = False) -> grpc.aio.Channel:
    """A grpc.aio channel: mutual TLS with a TLSConfig, else plaintext. carries_token: calls on it will bear the
    control-plane token, which is refused (InsecureTokenError) over plaintext to another host."""
    if tls is None:
        if carries_token:
            check_token_transport(target, secure=False, allow_plaintext=_plaintext_token_allowed())
        return grpc.aio.insecure_channel(target, options=list(options) or None)
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=list(options) or None)


def sync_channel(target: str, tls: TLSConfig | None, options: Sequence[tuple[str, object]] = (),
                 carries_token: bool = False) -> grpc.Channel:
    """The blocking counterpart of aio_channel (the CLIs)."""
    if tls is None:
        if carries_token:
            check_token_transport(target, secure=False, allow_plaintext=_plaintext_token_allowed())
        return grpc.insecure_channel(target, options=list(options) or None)
    return grpc.secure_channel(target, tls.channel_credentials(), options=list(options) or None)


def _plaintext_token_allowed() -> bool:
    return os.environ.get(ENV_ALLOW_PLAINTEXT_TOKEN) == "1"


def add_port(server: grpc.aio.Server, address: str, tls: TLSConfig | None) -> int:
    """Bind `server` to `address`: a secure port only with a TLSConfig (plaintext connections then fail their
    handshake), else a plaintext one. The bound port, 0 when it could not bind (older grpcio)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())
