"""OpenAI-shaped error responses and the exception handlers that produce them."""

from __future__ import annotations

import math
from http import HTTPStatus
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.router.api.protocol import ErrorInfo, ErrorResponse
from services.router.contracts import EngineDrainingError, QueueFullError, RequestError

log = structlog.get_logger(__name__)

INVALID_REQUEST = "invalid_request_error"


class ApiError(Exception):
    """An error the API answers with `status_code` and an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=error_type, param=param, code=code)
        self.headers = headers


class ClientDisconnected(Exception):
    """The client went away before its response was ready; nobody reads the answer."""


def error_body(info: ErrorInfo) -> dict[str, Any]:
    """The JSON body of an error (also sent as a `data:` event when a stream fails)."""
    return ErrorResponse(error=info).model_dump()


def error_response(error: ApiError) -> JSONResponse:
    """The HTTP response of an ApiError."""
    return JSONResponse(error_body(error.info), status_code=error.status_code, headers=error.headers)


def from_engine_error(exc: Exception) -> ApiError:
    """Map the engine's admission errors (and anything else) to API errors."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFullError):
        retry_after = max(1, math.ceil(exc.retry_after_s))  # Retry-After takes whole seconds
        return ApiError(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after)})
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc))
    if isinstance(exc, EngineDrainingError):
        return ApiError(503, str(exc), "server_error", code="shutting_down")
    return ApiError(500, "internal server error", "server_error")


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request")
    first = errors[0]
    location = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        message = f"could not parse the JSON body of the request: {detail}".rstrip(": ")
        return ApiError(400, message, code="invalid_json")
    param = next((part for part in location if isinstance(part, str)), None)
    kind = first.get("type", "")
    code = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}.get(kind, "invalid_value")
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if len(errors) > 1 and param is not None and all(_first_name(e) == param for e in errors):
        message = f"invalid type or value for '{param}'"  # a union: pydantic reports one error per member
    elif location:
        message = f"{message} ('{'.'.join(str(part) for part in location)}')"
    return ApiError(400, message, param=param, code=code)


def _first_name(error: Any) -> str | None:
    return next((part for part in error.get("loc", ()) if isinstance(part, str) and part != "body"), None)


async def _handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)  # type: ignore[arg-type]


async def _handle_engine_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(from_engine_error(exc))


async def _handle_validation_error(request: Request, exc: Exception) -> JSONResponse:
    content_type = request.headers.get("content-type", "")
    if request.method == "POST" and not _is_json(content_type):  # e.g. curl -d without -H: a form, not JSON
        return error_response(ApiError(
            400, f"the request body must be JSON, sent with the header `Content-Type: application/json` (this one "
                 f"came as {content_type or 'no content type'}; with curl: -H 'content-type: application/json')",
            code="invalid_content_type"))
    return error_response(_validation_error(exc))  # type: ignore[arg-type]


def _is_json(content_type: str) -> bool:
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


async def _handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"invalid URL ({request.method} {request.url.path})"
    else:
        message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
    error_type = INVALID_REQUEST if exc.status_code < 500 else "server_error"
    return error_response(ApiError(exc.status_code, message, error_type, headers=exc.headers))


async def _handle_disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; never reaches the client


async def _handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("api.unhandled_exception", path=request.url.path, exc_info=exc)
    return error_response(ApiError(500, "internal server error", "server_error"))


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app as OpenAI error JSON: 400 for bad requests (never 422), 429, 500, ..."""
    app.add_exception_handler(ApiError, _handle_api_error)
    app.add_exception_handler(QueueFullError, _handle_engine_error)
    app.add_exception_handler(EngineDrainingError, _handle_engine_error)
    app.add_exception_handler(RequestError, _handle_engine_error)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)
    app.add_exception_handler(ClientDisconnected, _handle_disconnected)
    app.add_exception_handler(Exception, _handle_unexpected)
