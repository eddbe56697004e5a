"""One exception type for API errors and the FastAPI handlers that render the error shape."""

from __future__ import annotations

import logging
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from protocol import errors as error_types
from protocol.errors import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)

_TYPE_BY_STATUS = {
    400: error_types.INVALID_REQUEST,
    401: error_types.AUTHENTICATION,
    404: error_types.NOT_FOUND,
    405: error_types.INVALID_REQUEST,
    408: error_types.TIMEOUT,
    413: error_types.INVALID_REQUEST,
    422: error_types.INVALID_REQUEST,
    431: error_types.INVALID_REQUEST,
    429: error_types.OVERLOADED,
    502: error_types.UPSTREAM,
    503: error_types.OVERLOADED,
    504: error_types.TIMEOUT,
}


class APIError(Exception):
    """An error answered to the caller with a status, the error shape and optional headers."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        error_type: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type or _TYPE_BY_STATUS.get(status_code, error_types.INTERNAL)
        self.param = param
        self.headers = headers or {}

    def to_response(self) -> ErrorResponse:
        """The error shape for this error."""
        detail = ErrorDetail(
            type=self.error_type, message=self.message, code=self.status_code, param=self.param
        )
        return ErrorResponse(error=detail)

    def to_json_response(self) -> JSONResponse:
        """A ready JSON answer with status and headers."""
        return JSONResponse(
            self.to_response().model_dump(),
            status_code=self.status_code,
            headers=self.headers,
        )


def overloaded(message: str, retry_after_seconds: int = 1, status_code: int = 503) -> APIError:
    """An overload error (429/503) that tells the caller when to retry."""
    return APIError(status_code, message, headers={"Retry-After": str(retry_after_seconds)})


def describe_validation_error(exc: ValidationError | RequestValidationError) -> tuple[str, str]:
    """Turn pydantic errors into one readable message and the first offending field."""
    parts: list[str] = []
    first_param = ""
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        # pydantic puts the union member or validator name in the location; drop noise.
        loc = [p for p in loc if not p.startswith("function-") and "[" not in p]
        field = ".".join(loc)
        if not first_param:
            first_param = field
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{field}: {msg}" if field else msg)
    return "; ".join(parts) or "invalid request", first_param


def validation_api_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the fields that failed validation."""
    message, param = describe_validation_error(exc)
    return APIError(400, message, param=param or None)


def parse_json_body(body: bytes, schema: type[ModelT]) -> ModelT:
    """``body`` validated straight into ``schema`` (no intermediate dict); 400 naming the
    problem otherwise: not JSON (lone UTF-16 surrogate escapes and nesting deeper than the
    parser's recursion limit included), not an object, or the fields that failed."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        if errors and errors[0]["type"] == "json_invalid":
            reason = str(errors[0].get("ctx", {}).get("error", errors[0]["msg"]))
            if "hex escape" in reason or "surrogate" in reason:
                reason += " (a lone UTF-16 surrogate escape such as \\ud800 is not text)"
            raise APIError(400, f"the request body is not valid JSON: {reason}") from None
        if errors and errors[0]["type"] == "model_type" and not errors[0]["loc"]:
            raise APIError(400, "the request body must be a JSON object") from None
        raise validation_api_error(exc) from None


def install_error_handlers(app: FastAPI) -> None:
    """Make every error of ``app`` answer with the one error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.to_json_response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_api_error(exc).to_json_response()

    @app.exception_handler(ValidationError)
    async def _pydantic_error(_: Request, exc: ValidationError) -> JSONResponse:
        return validation_api_error(exc).to_json_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).to_json_response()

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # A caller hanging up mid-upload is ordinary life, not a server error.
        logger.info("client went away during %s %s", request.method, request.url.path)
        return APIError(499, "the client closed the connection").to_json_response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").to_json_response()
