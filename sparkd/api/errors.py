"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Every failure a client can cause is raised as `APIError` somewhere below the
routes and turned into JSON here, so no stack trace ever reaches a response.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec
from starlette.responses import Response

# A full queue drains within a few engine steps; a draining process never comes back,
# but its replacement (or another replica) is up within seconds.
RETRY_AFTER_QUEUE_FULL_S = 1
RETRY_AFTER_DRAINING_S = 5

# The error `type` OpenAI uses for each status we send.
_TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """A request that cannot be served, with the status and the field to blame.
    retry_after: seconds, sent as `Retry-After` when the client should come back later."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def info(self) -> ErrorInfo:
        error_type = _TYPE_FOR_STATUS.get(self.status, "invalid_request_error")
        return ErrorInfo(self.message, error_type, self.param, self.code)

    def response(self) -> Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return Response(msgspec.json.encode(ErrorResponse(self.info())), self.status, headers=headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def server_error(message: str = "internal server error") -> APIError:
    return APIError(500, message, code="internal_error")


def engine_dead(reason: str | None) -> APIError:
    return APIError(503, f"the engine is not available: {reason or 'it stopped'}", code="engine_dead")


def shutting_down(message: str = "the server is shutting down") -> APIError:
    """503: this process takes no new work; the client should go to another replica or come back."""
    return APIError(503, message, code="server_shutting_down", retry_after=RETRY_AFTER_DRAINING_S)


def queue_full(limit: int) -> APIError:
    return APIError(429, f"the server is busy: {limit} requests are already waiting", code="too_many_requests",
                    retry_after=RETRY_AFTER_QUEUE_FULL_S)


def request_timed_out(timeout_s: float) -> APIError:
    """504: the request was valid and the client was not slow; the server missed its own deadline."""
    return APIError(504, f"the request did not finish within the server's request timeout of {timeout_s:g} s",
                    code="request_timeout")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over {limit} bytes", code="request_too_large")


T = TypeVar("T")


def decode_json(raw: bytes | str, body_type: type[T]) -> T:
    """Decode a client's JSON into `body_type`; any failure is a 400 naming the field."""
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    except RecursionError:  # msgspec's guard against stack exhaustion by deep nesting
        raise bad_request("the request body is nested too deeply") from None


_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`")


def from_decode_error(exc: msgspec.DecodeError) -> APIError:
    """Turn a msgspec failure on a request body into a 400 that names the field.

    ValidationError (a DecodeError subclass) carries a JSON path such as
    `$.messages[0].role`; plain DecodeError means the bytes are not JSON or not UTF-8.
    """
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"the request body is not valid JSON: {text}")
    match = _PATH.search(text)
    path = match["path"] if match else ""
    text = _PATH.sub("", text)
    unknown = _UNKNOWN_FIELD.match(text)
    if unknown:
        # OpenAI's own wording: clients already recognise it.
        field = unknown["field"]
        param = f"{path}.{field}" if path else field
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    return bad_request(f"{text}{f' (at {path})' if path else ''}", path or None)
