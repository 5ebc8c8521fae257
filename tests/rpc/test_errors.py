"""ErrorInterceptor: exceptions escaping a method become the right status codes; the server survives them."""

from __future__ import annotations

import grpc
import pytest

from services.router.contracts import QueueFullError, RequestError
from services.rpc.errors import RETRY_AFTER_KEY, ErrorInterceptor

SERVICE = "test.Failing"

RAISES = {
    "RequestError": RequestError("prompt too long"),
    "ValueError": ValueError("bad top_p"),
    "KeyError": KeyError("no request r-1"),
    "QueueFull": QueueFullError("queue full", retry_after_s=2.5),
    "Timeout": TimeoutError("freeze took too long"),
    "Unexpected": RuntimeError("boom"),
}


@pytest.fixture
async def channel():
    async def unary(request: bytes, context) -> bytes:
        name = request.decode()
        if name == "ok":
            return b"fine"
        if name == "abort":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "chosen by the servicer")
        raise RAISES[name]

    async def stream(request: bytes, context):
        yield b"first"
        raise RAISES[request.decode()]

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    })
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    await server.stop(None)


@pytest.mark.parametrize("name,code,details", [
    ("RequestError", grpc.StatusCode.INVALID_ARGUMENT, "prompt too long"),
    ("ValueError", grpc.StatusCode.INVALID_ARGUMENT, "bad top_p"),
    ("KeyError", grpc.StatusCode.NOT_FOUND, "no request r-1"),
    ("QueueFull", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
    ("Timeout", grpc.StatusCode.DEADLINE_EXCEEDED, "freeze took too long"),
    ("Unexpected", grpc.StatusCode.INTERNAL, "internal error: RuntimeError: boom"),
    ("abort", grpc.StatusCode.PERMISSION_DENIED, "chosen by the servicer"),
])
async def test_unary_exceptions_map_to_status_codes(channel, name, code, details):
    call = channel.unary_unary(f"/{SERVICE}/Unary")(name.encode(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    assert (error.value.code(), error.value.details()) == (code, details)
    trailing = dict(await call.trailing_metadata() or ())
    if name == "QueueFull":
        assert trailing[RETRY_AFTER_KEY] == "3"  # whole seconds, rounded up
    else:
        assert RETRY_AFTER_KEY not in trailing
    # The server keeps serving after any of them.
    assert await channel.unary_unary(f"/{SERVICE}/Unary")(b"ok", timeout=5) == b"fine"


async def test_stream_error_after_a_response(channel):
    call = channel.unary_stream(f"/{SERVICE}/Stream")(b"ValueError", timeout=5)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for item in call:
            received.append(item)
    assert received == [b"first"]
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
