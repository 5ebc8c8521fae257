"""One server interceptor that maps the exceptions of servicers and domain objects to gRPC status codes."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass

import grpc
import structlog

log = structlog.get_logger(__name__)

# An exception type may name its own code in a class attribute `grpc_status` (a grpc.StatusCode member's name:
# the router's QueueFullError says RESOURCE_EXHAUSTED), so this bottom layer imports no service. Otherwise these are
# checked in order: the first matching type decides the code (the router's RequestError is a ValueError).
STATUS_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
)
RETRY_AFTER_KEY = "retry-after"  # trailing metadata of RESOURCE_EXHAUSTED: whole seconds to wait


class MalformedRequest(ValueError):
    """The request bytes are not a protobuf message of the method's request type (INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """Stands for a request message that failed to parse, so the call can end INVALID_ARGUMENT, not UNKNOWN."""

    error: str


def _tolerant(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    """`deserializer`, returning _Undecodable instead of raising (gRPC would answer a raise with UNKNOWN)."""
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError: corrupt wire format, bad UTF-8 in a string field, ...
            return _Undecodable(str(exc) or type(exc).__name__)

    return deserialize


def _decoded(request: object) -> object:
    if isinstance(request, _Undecodable):
        raise MalformedRequest(f"malformed request message: {request.error}")
    return request


async def _decoded_stream(requests: AsyncIterator[object]) -> AsyncIterator[object]:
    async for request in requests:
        yield _decoded(request)


def describe_error(exc: BaseException) -> str:
    """One line for logs and operation errors: `CODE: details` for a failed RPC, `Type: message` otherwise."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def check_address(address: str, what: str = "worker address") -> None:
    """ValueError unless `address` reads host:port (a port in 1..65535, no whitespace in the host)."""
    host, _, port = address.rpartition(":")
    if not host or any(c.isspace() for c in host) or not port.isdigit() or not 0 < int(port) < 1 << 16:
        raise ValueError(f"{what} {address!r} is not host:port")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for `exc`."""
    named = getattr(type(exc), "grpc_status", None)
    for exc_type, code in ((type(exc), grpc.StatusCode[named]),) if named else STATUS_CODES:
        if isinstance(exc, exc_type):
            # KeyError's str() is the repr of its key; its first argument reads better.
            message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
            return code, message or type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """Abort the call with the status of `exc` (never returns)."""
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("rpc.internal_error", method=method, error=message, exc_info=exc)
    trailing = ()
    retry_after_s = getattr(exc, "retry_after_s", None)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_s is not None:
        trailing = ((RETRY_AFTER_KEY, str(max(1, math.ceil(retry_after_s)))),)
    await context.abort(code, message, trailing_metadata=trailing)


def _wrap_unary_response(behavior, method: str, is_request_stream: bool):
    async def wrapped(request_or_iterator, context):
        try:
            request = _decoded_stream(request_or_iterator) if is_request_stream else _decoded(request_or_iterator)
            result = behavior(request, context)
            return (await result) if inspect.isawaitable(result) else result
        except grpc.aio.AbortError:  # the servicer chose its own status
            raise
        except Exception as exc:
            await abort_with(context, exc, method)

    return wrapped


def _wrap_stream_response(behavior, method: str, is_request_stream: bool):
    async def wrapped(request_or_iterator, context):
        try:
            request = _decoded_stream(request_or_iterator) if is_request_stream else _decoded(request_or_iterator)
            result = behavior(request, context)
            if inspect.isasyncgen(result):
                async with contextlib.aclosing(result):  # a cancelled call closes the servicer's generator now
                    async for response in result:
                        yield response
            else:  # a coroutine that writes with context.write()
                await result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc, method)

    return wrapped


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a method into status codes (STATUS_CODES; anything else INTERNAL), and request
    bytes that do not parse into INVALID_ARGUMENT."""

    def __init__(self, exclude: Collection[str] = ()) -> None:
        self._exclude = frozenset(exclude)  # full method names left as they are (a hot stream that maps its own)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in self._exclude:
            return handler
        handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary_response(handler.unary_unary, method, False))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_wrap_unary_response(handler.stream_unary, method, True))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_stream_response(handler.unary_stream, method, False))
        return handler._replace(stream_stream=_wrap_stream_response(handler.stream_stream, method, True))
