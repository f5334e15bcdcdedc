"""kit/openapi_doc.py - the OpenAPI document lists every status a route answers, with the error's body.

FastAPI documents a route's 200 and a 422 for a body that fails validation. This server answers
that case with OpenAI's 400 instead (kit/openai_api.py), and other statuses besides: 401 without
a key, 404 for an unknown model, 408 and 413 for a body too slow or too large, 415 for one that is
not JSON, 503 when overloaded, shutting down or without its engine, 504 past a request's time
bound. A client generated from the document (or schemathesis, which checks a server against it)
must know them all, and the one shape every error has: OpenAI's `{"error": {...}}`.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kit.server_ops import GENERATION_ROUTES


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error this server answers, in OpenAI's shape."""
    error: ErrorDetail


# --8<-- [start:statuses]
EVERY_ROUTE = {400: "refused: a field or query that is not valid (error.param names it), or a Host name this "
                    "server does not answer to (--allowed-hosts)"}
KEYED = {401: "a valid API key is required (Authorization: Bearer <key>); /engine/* may take --metrics-key "
              "or --admin-key instead"}
WITH_BODY = {408: "the body did not arrive whole within --body-timeout", 413: "the body is larger than the "
             "server takes", 415: "the body is not sent as JSON (Content-Type: application/json)"}
GENERATION = {404: "no such model: not the one served, nor one of its adapters",
              500: "the engine failed on this request; the server goes on",
              503: "overloaded (--max-waiting, --max-waiting-per-key), shutting down, or the engine is "
                   "unavailable: retry after Retry-After seconds",
              504: "the request ran past its time bound (--request-timeout, or one sized from max_tokens)"}


def statuses(path: str, method: str) -> dict[int, str]:
    """The error statuses one route answers, each with when."""
    out = dict(EVERY_ROUTE)
    if path.startswith(("/v1/", "/engine/")):
        out.update(KEYED)
    if method == "post":
        out.update(WITH_BODY)
    if path in GENERATION_ROUTES:
        out.update(GENERATION)
    if path.startswith("/v1/models/"):
        out[404] = GENERATION[404]
    return out
# --8<-- [end:statuses]


def document(app: FastAPI) -> None:
    """Replace the app's OpenAPI document by one whose every route lists its error statuses."""
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error.pop("$defs", {}))
        schemas["ErrorResponse"] = error
        for name in ("HTTPValidationError", "ValidationError"):   # FastAPI's 422, never answered here
            schemas.pop(name, None)
        body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, operations in doc.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                for status, when in statuses(path, method).items():
                    answer = responses.setdefault(str(status), {"description": when})
                    answer["content"] = body
                    if status == 503:
                        answer["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                                             "description": "seconds to wait before trying again"}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
