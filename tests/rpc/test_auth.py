"""The control-plane token: its file, and the interceptor that guards protected methods on a real grpc.aio server."""

from __future__ import annotations

import stat

import grpc
import pytest

from services.rpc.auth import (
    UNAUTHENTICATED_MESSAGE,
    TokenAuthInterceptor,
    auth_metadata,
    generate_token,
    protect_methods,
    read_token_file,
    write_token_file,
)

SERVICE = "test.Guarded"
ADMIN, ADMIN_STREAM, PUBLIC = f"/{SERVICE}/Admin", f"/{SERVICE}/AdminStream", f"/{SERVICE}/Public"


def test_tokens_are_random_and_long():
    tokens = {generate_token() for _ in range(20)}
    assert len(tokens) == 20
    assert all(len(t) >= 40 and t.isprintable() and " " not in t for t in tokens)


def test_token_file_is_private_and_round_trips(tmp_path):
    path = tmp_path / "run" / "token"
    token = write_token_file(path)
    assert read_token_file(path) == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    replaced = write_token_file(path, "second-token")
    assert replaced == "second-token" and read_token_file(path) == "second-token"
    assert sorted(p.name for p in path.parent.iterdir()) == ["token"]  # no temporary left behind


def test_bad_tokens_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_token_file(empty)
    with pytest.raises(ValueError):
        write_token_file(tmp_path / "t", " padded ")
    with pytest.raises(ValueError):
        TokenAuthInterceptor("", protect_methods(ADMIN))


@pytest.fixture
async def guarded():
    """A server whose Admin methods need the token and whose Public method does not; counts handler runs."""
    token = generate_token()
    calls: list[str] = []

    async def admin(request: bytes, context) -> bytes:
        calls.append("admin")
        return b"admin:" + request

    async def admin_stream(request: bytes, context):
        calls.append("admin_stream")
        for i in range(3):
            yield bytes([i])

    async def public(request: bytes, context) -> bytes:
        calls.append("public")
        return b"public:" + request

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Admin": grpc.unary_unary_rpc_method_handler(admin),
        "AdminStream": grpc.unary_stream_rpc_method_handler(admin_stream),
        "Public": grpc.unary_unary_rpc_method_handler(public),
    })
    server = grpc.aio.server(interceptors=[TokenAuthInterceptor(token, protect_methods(ADMIN, ADMIN_STREAM))])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield channel, token, calls
    await channel.close()
    await server.stop(None)


@pytest.mark.parametrize("metadata", [
    None,
    (("authorization", "Bearer wrong"),),
    (("authorization", "bearer TOKEN"),),       # the scheme is case-sensitive here: exact header only
    (("authorization", "Bearer TOKENx"),),      # a longer token is not a match
    (("authorization", "TOKEN"),),              # the bare token without the scheme
    (("x-token", "Bearer TOKEN"),),
], ids=["missing", "wrong", "lower-scheme", "suffix", "no-scheme", "other-key"])
async def test_protected_method_refuses_bad_credentials(guarded, metadata):
    channel, token, calls = guarded
    if metadata is not None:
        metadata = tuple((k, v.replace("TOKEN", token)) for k, v in metadata)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await channel.unary_unary(ADMIN)(b"x", metadata=metadata, timeout=5)
    assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert error.value.details() == UNAUTHENTICATED_MESSAGE
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in channel.unary_stream(ADMIN_STREAM)(b"x", metadata=metadata, timeout=5):
            pass
    assert error.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert calls == [], "the handler must not run without the token"


async def test_protected_methods_accept_the_token(guarded):
    channel, token, calls = guarded
    assert await channel.unary_unary(ADMIN)(b"x", metadata=auth_metadata(token), timeout=5) == b"admin:x"
    items = [item async for item in channel.unary_stream(ADMIN_STREAM)(b"", metadata=auth_metadata(token), timeout=5)]
    assert items == [b"\x00", b"\x01", b"\x02"]
    assert calls == ["admin", "admin_stream"]


async def test_public_method_is_open(guarded):
    channel, token, calls = guarded
    assert await channel.unary_unary(PUBLIC)(b"y", timeout=5) == b"public:y"
    assert await channel.unary_unary(PUBLIC)(b"z", metadata=(("authorization", "Bearer nope"),), timeout=5) \
        == b"public:z"
    assert calls == ["public", "public"]
