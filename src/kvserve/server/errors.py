"""Error responses: the OpenAI shape, an honest status, and text that can
always be encoded (an error may quote what the client sent, and JSON
lets a client send lone UTF-16 surrogates, which UTF-8 cannot carry).

`APIError` is the one exception the serving pipeline raises for a request
it will not serve; `rejection` and `ended_without_output` turn an admission
refusal and a request that ended before its first token into one.

The framework's own errors go through here too: FastAPI's validation
errors (422 -> 400, naming the field as `messages[0].content`), unknown
routes (404), wrong methods (405).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from kvserve.admission.decision import AdmissionDecision, Reason
from kvserve.contract import InvalidParameter
from kvserve.engine.async_engine import ENGINE_FAILED
from kvserve.server.protocol import error_body, refusal_type

if TYPE_CHECKING:
    from kvserve.engine.async_engine import Finished

# pydantic error types that mean "the body is not an object at all".
_NOT_AN_OBJECT = {"model_attributes_type", "model_type", "dict_type"}
# What a request that ended before its first token was told, by abort reason.
_ENDED_MESSAGES = {Reason.QUEUE_TIMEOUT: "the request waited too long in the queue and did not start",
                   Reason.DEADLINE: "the request could not start before its deadline",
                   "shutdown": "the server is shutting down",
                   "sleep": "the server went to sleep before the request started"}


class APIError(Exception):
    """An OpenAI-shaped error with an honest status (rendered by
    `error_response`, whose responses always encode)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}


def bad_request(exc: InvalidParameter) -> APIError:
    return APIError(400, str(exc), param=exc.param)


def rejection(decision: AdmissionDecision) -> APIError:
    """The error of a request admission refused: its status, reason as the
    code, and Retry-After when the refusal says when to come back."""
    headers = {}
    if decision.retry_after_s is not None:
        headers["Retry-After"] = str(decision.retry_after_s)
    return APIError(decision.status, decision.message, refusal_type(decision.status, decision.reason),
                    decision.reason, None, headers)


def engine_failed(done: Finished) -> APIError:
    """The error of a request the engine had when it failed (the server is
    unhealthy now: an orchestrator restarts it)."""
    return APIError(503, f"the request failed: {done.error}", "unavailable", "engine_dead")


def ended_without_output(done: Finished, retry_after_s: int | None = None) -> APIError:
    """The error of an admitted request that ended before its first token
    (headers are not sent yet, so it still gets an honest status); a 503
    carries `retry_after_s` when given."""
    if done.abort_reason == ENGINE_FAILED:
        return engine_failed(done)
    if done.error is not None:
        return APIError(400, done.error, code="engine_refused")
    reason = done.abort_reason or "abort"
    headers = None if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    return APIError(503, _ENDED_MESSAGES.get(reason, f"the request was aborted ({reason})"),
                    "unavailable", reason, headers=headers)


def error_response(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> Response:
    body = error_body(_encodable(message), type_, code, None if param is None else _encodable(param))
    content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    return Response(content, status_code=status, headers=headers, media_type="application/json")


def internal_error_response() -> Response:
    return error_response(500, "internal server error", "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        # FastAPI answers 422; OpenAI clients expect 400 with the error shape.
        message, param = validation_message(exc.errors(), getattr(exc, "body", None))
        return error_response(400, message, "invalid_request_error", "invalid_value", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        message = _body_parse_message(exc.__cause__) or str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


def _body_parse_message(cause: BaseException | None) -> str | None:
    """FastAPI's one message for every body its JSON parser refused, made specific."""
    if isinstance(cause, UnicodeDecodeError):
        return "request body is not valid UTF-8"
    if isinstance(cause, RecursionError):
        return "request body is nested too deeply"
    if isinstance(cause, ValueError):  # e.g. an integer of more digits than Python converts
        return "request body is not valid JSON"
    return None


def validation_message(errors: list[dict], body: object) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors on a request body: the most
    specific error (the deepest place in the body; at equal depth a value
    check before a type mismatch), its field named as in the body."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    ranked = [(_place(e, body), e) for e in errors]
    if first.get("type") in _NOT_AN_OBJECT and not ranked[0][0]:
        return "request body must be a JSON object (Content-Type: application/json)", None
    best_place, best = max(ranked, key=lambda pe: (len(pe[0]), _is_value_error(pe[1])))
    same = [e for p, e in ranked if p == best_place and _is_value_error(e) == _is_value_error(best)]
    messages = list(dict.fromkeys(e.get("msg", "invalid value") for e in same))
    param = _field_name(best_place) or None
    text = "; ".join(messages)
    return (f"{param}: {text}" if param else text), param


def _is_value_error(error: dict) -> bool:
    return not error.get("type", "").endswith("_type")


def _place(error: dict, body: object) -> list[str | int]:
    """The error's location as a path into the request body: pydantic's loc
    also names union members ('list[int]', 'function-after[...]'), which are
    no place in the body and are dropped."""
    loc = list(error.get("loc", ()))
    if not loc or loc[0] != "body":
        return [str(p) for p in loc]
    path: list[str | int] = []
    node = body
    for i, segment in enumerate(loc[1:], start=1):
        if isinstance(node, dict) and segment in node:
            node = node[segment]
        elif isinstance(node, list) and isinstance(segment, int) and 0 <= segment < len(node):
            node = node[segment]
        elif not (error.get("type") == "missing" and i == len(loc) - 1):
            continue  # a union member's tag
        path.append(segment)
    return path


def _field_name(path: list[str | int]) -> str:
    """['messages', 0, 'content'] -> 'messages[0].content'."""
    out = ""
    for segment in path:
        out += f"[{segment}]" if isinstance(segment, int) else (f".{segment}" if out else str(segment))
    return out


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
