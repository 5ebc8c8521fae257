"""The control-plane token: generation, the 0600 token file, the server interceptor and the client metadata."""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

AUTHORIZATION_KEY = "authorization"  # gRPC metadata keys are lower case
BEARER_PREFIX = "Bearer "
UNAUTHENTICATED_MESSAGE = "missing or invalid control-plane token"
_TOKEN_BYTES = 32  # 256 bits of entropy


def generate_token() -> str:
    """A new random token (URL-safe text, 256 bits)."""
    return secrets.token_urlsafe(_TOKEN_BYTES)


def write_token_file(path: Path | str, token: str | None = None) -> str:
    """Write `token` (a new one when None) to `path` atomically with mode 0600; returns the token."""
    token = generate_token() if token is None else token
    if not token or token.strip() != token or "\n" in token:
        raise ValueError("a token must be non-empty text without surrounding whitespace")
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as file:
            file.write(token + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)  # readers see the old file or the whole new one, never a partial token
    except BaseException:
        os.unlink(temporary)
        raise
    return token


def read_token_file(path: Path | str) -> str:
    """The token stored at `path`; ValueError when the file is empty."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that authenticates a client: pass as `metadata=` to a stub call."""
    return ((AUTHORIZATION_KEY, BEARER_PREFIX + token),)


class InsecureTokenError(ValueError):
    """The control-plane token would cross the network in clear: a plaintext channel to another host."""


def target_host(target: str) -> str:
    """The host of a gRPC target: "h:p", "[v6]:p", "dns:///h:p", "ipv4:h:p", "ipv6:[v6]:p" ("" for unix:)."""
    if target.startswith("unix:") or target.startswith("unix-abstract:"):
        return ""
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    if target.startswith("["):
        return target[1:target.find("]")] if "]" in target else target[1:]
    host, colon, port = target.rpartition(":")
    return host if colon and port.isdigit() and ":" not in host else target


def is_local_target(target: str) -> bool:
    """Whether connecting to `target` stays on this host: a unix socket, localhost, a loopback address (127.0.0.0/8,
    ::1), or the unspecified address (0.0.0.0, ::), which reaches this host's own listeners."""
    host = target_host(target)
    if host in ("", "localhost") or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False  # a host name: it may be any machine
    return address.is_loopback or address.is_unspecified


def check_token_transport(target: str, secure: bool, allow_plaintext: bool = False) -> None:
    """InsecureTokenError unless the token may go to `target`: over TLS anywhere, in plaintext only on this host.
    allow_plaintext: the operator vouches for the network ($RECONFIG_ALLOW_PLAINTEXT_TOKEN=1: one host's compose
    network, whose containers have addresses of their own)."""
    if not secure and not allow_plaintext and not is_local_target(target):
        raise InsecureTokenError(
            f"refusing to send the control-plane token in plaintext to {target}, which is not a loopback address: "
            "configure mutual TLS (--tls-cert, --tls-key, --tls-ca, or $RECONFIG_TLS_CERT/_KEY/_CA)")


def is_authorized(metadata, token: str) -> bool:
    """Whether `metadata` (key/value pairs) carries `authorization: Bearer <token>`; constant-time compare."""
    expected = (BEARER_PREFIX + token).encode()
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY:
            presented = value.encode() if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(presented, expected)
    return False


def _aborting_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that fails every call with `code` without running it."""

    async def abort(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    serializers = dict(request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort, **serializers)
    return grpc.unary_unary_rpc_method_handler(abort, **serializers)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Fails calls to protected methods with UNAUTHENTICATED unless they carry the control-plane token."""

    def __init__(self, token: str, protected: Callable[[str], bool]) -> None:
        if not token:
            raise ValueError("the control-plane token must not be empty")
        self._token = token
        self._protected = protected  # full method name ("/reconfig.v1.Router/Freeze") → needs the token?

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not self._protected(handler_call_details.method):
            return handler
        if is_authorized(handler_call_details.invocation_metadata, self._token):
            return handler
        return _aborting_handler(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def protect_methods(*full_names: str) -> Callable[[str], bool]:
    """A `protected` predicate for TokenAuthInterceptor: exactly these full method names."""
    names = frozenset(full_names)
    return names.__contains__


def protect_all(method: str) -> bool:
    """A `protected` predicate for TokenAuthInterceptor: every method."""
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m services.rpc.auth FILE`: write a new token to FILE (0600), e.g. for the compose stack."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m services.rpc.auth TOKEN_FILE", file=sys.stderr)
        return 2
    write_token_file(args[0])
    print(f"wrote a new control-plane token to {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
