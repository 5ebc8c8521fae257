"""A gRPC server of the stack's: created and bound in one place, so that every service refuses a port another
process holds, and says which address it could not listen on."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.rpc.tls import TLSConfig, add_port

# gRPC turns SO_REUSEPORT on by default on Linux: a second server on a port in use then binds without an error and
# the kernel splits the connections between the two (a second stack's controller would answer half the calls
# meant for the first one's).
_EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


def new_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
               options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Server:
    """A grpc.aio server whose port is its own."""
    return grpc.aio.server(interceptors=list(interceptors), options=[_EXCLUSIVE_PORT, *options])


def listen(server: grpc.aio.Server, host: str, port: int, service: str, tls: TLSConfig | None = None) -> int:
    """Bind `server` to host:port (0: any free port); the bound port. With `tls`, a mutual-TLS port only: a client
    without a certificate of the CA, or in plaintext, fails its handshake. RuntimeError naming the address and the
    service when it cannot."""
    try:
        bound = add_port(server, f"{host}:{port}", tls)
    except RuntimeError:  # grpcio >= 1.60 raises; older ones return 0
        bound = 0
    if bound == 0:
        raise RuntimeError(f"the {service} cannot listen on {host}:{port}: the port is in use by another program, "
                           "or the address is not one of this host's")
    return bound
