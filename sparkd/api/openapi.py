"""GET /openapi.json: the OpenAPI 3.1 document of the /v1 HTTP routes.

Request and response bodies are the msgspec Structs the routes decode and
encode, so the document cannot drift from what the server accepts. OpenAPI
3.1 uses JSON Schema 2020-12, which is what msgspec emits (`"type": "null"`
rather than 3.0's `nullable`). Value ranges checked after decoding (by
`SamplingParams` and the server's limits) are not in the schema: a request
outside them is well-formed here and answered with a 400 naming the field.
The WebSocket at /v1/ws has no place in OpenAPI; docs/api.md describes it.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse

from .. import __version__
from .errors import ErrorResponse
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, ModelList

_REF = "#/components/schemas/{name}"

# status -> when a /v1 route answers with it; each carries the OpenAI error body.
_ERRORS = {
    "400": "The request is malformed or a value is out of range; `param` names the field.",
    "401": "The API key is missing or wrong (only when the server runs with --api-key).",
    "404": "The requested model is not served.",
    "413": "The request body is too large.",
    "429": "Too many requests are waiting; retry after `Retry-After` seconds.",
    "503": "The server is draining for shutdown or its engine has stopped.",
    "504": "The request did not finish within the server's --request-timeout.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}
_GENERATION_ERRORS = ("400", "401", "404", "413", "429", "503", "504")

_SSE_DESCRIPTION = ("With `stream: true`: Server-Sent Events, one `data: <chunk JSON>` event per token, "
                    "an error event `data: {\"error\": ...}` if the request fails after the stream began, "
                    "then `data: [DONE]`.")


@functools.cache
def openapi_schema() -> dict[str, Any]:
    """The document, built once; callers must not mutate it."""
    structs = [CompletionRequest, ChatCompletionRequest, CompletionResponse, ChatCompletionResponse,
               ChatCompletionChunk, ModelList, ErrorResponse]
    _, schemas = msgspec.json.schema_components(structs, ref_template=_REF)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "sparkd",
            "version": __version__,
            "description": "OpenAI-compatible completions and chat completions.",
        },
        "paths": {
            "/v1/models": {"get": {
                "operationId": "listModels",
                "summary": "The models this server answers to.",
                "responses": {"200": _json("The served models.", ModelList), **_error_responses(("401",))},
            }},
            # OpenAI's completions stream chunks are full response objects, chat's are their own type.
            "/v1/completions": {"post": _generation("createCompletion", "Complete a prompt.",
                                                    CompletionRequest, CompletionResponse, CompletionResponse)},
            "/v1/chat/completions": {"post": _generation("createChatCompletion", "Answer a conversation.",
                                                         ChatCompletionRequest, ChatCompletionResponse,
                                                         ChatCompletionChunk)},
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                               "description": "The server's --api-key, when it has one."}},
        },
        "security": [{"bearerAuth": []}],
    }


async def openapi_endpoint(request: Request) -> JSONResponse:
    return JSONResponse(openapi_schema())


def _generation(operation_id: str, summary: str, request_type: type, response_type: type,
                chunk_type: type) -> dict[str, Any]:
    ok = _json("The full response, or with `stream: true` an event stream.", response_type)
    ok["content"]["text/event-stream"] = {"schema": _sse_event(chunk_type)}
    return {
        "operationId": operation_id,
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request_type)}}},
        "responses": {"200": ok, **_error_responses(_GENERATION_ERRORS)},
    }


def _sse_event(chunk_type: type) -> dict[str, Any]:
    """One event of the stream, as OpenAPI before 3.2 describes event streams (3.2 has `itemSchema`)."""
    chunk_json = {"type": "string", "contentMediaType": "application/json",
                  "contentSchema": {"anyOf": [_ref(chunk_type), _ref(ErrorResponse)]}}
    return {
        "type": "object",
        "description": _SSE_DESCRIPTION,
        "properties": {"event": {"type": "string"}, "data": {"anyOf": [{"const": "[DONE]"}, chunk_json]}},
        "required": ["data"],
    }


def _error_responses(statuses: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for status in statuses:
        out[status] = _json(_ERRORS[status], ErrorResponse)
        if status in ("429", "503"):
            out[status]["headers"] = _RETRY_AFTER
    return out


def _json(description: str, struct: type) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(struct)}}}


def _ref(struct: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=struct.__name__)}
