"""Checking a generation request before any upstream call, and OpenAI-style error responses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 502: "upstream_error", 503: "service_unavailable", 504: "upstream_timeout"}


#: JSON in and out of the router's hot path: msgspec's codec (a fifth of the json module's time per body); what it
#: refuses goes to the json module.
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def dump_json(value: Any) -> bytes:
    """Compact JSON of a (parsed) request body."""
    try:
        return _encode(value)
    except UnicodeEncodeError:  # a lone surrogate the json module let in: it writes it escaped, as it came
        return json.dumps(value, separators=(",", ":")).encode()


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


class RequestError(Exception):
    """A request the router refuses; becomes `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param,
                      "code": code if code is not None else status}}


def error_response(error: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error.status, error.message, error.param, error.code), status_code=error.status,
                        headers=headers)


@dataclass(frozen=True)
class GenerationRequest:
    """The parts of a (chat) completion request the router looks at; `body` is forwarded unchanged."""

    body: dict[str, Any]
    chat: bool
    stream: bool
    max_tokens: int | None


def check_request(body: Any, chat: bool, served_model: str, max_model_len: int) -> GenerationRequest:
    """Refuse what vLLM would refuse (and what would waste an upstream call): wrong shape, unknown model,
    missing prompt, bad `max_tokens`. The prompt's length is checked after tokenizing."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", None, "invalid_body")
    model = body.get("model")
    if model is None:
        raise RequestError(400, "missing required field 'model'", "model", "missing_field")
    if model != served_model:
        raise RequestError(400, f"unknown model {model!r}: this deployment serves {served_model!r}", "model",
                           "model_not_found")
    field = "messages" if chat else "prompt"
    if body.get(field) is None:
        raise RequestError(400, f"missing required field {field!r}", field, "missing_field")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream", "invalid_type")
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(400, f"{name!r} must be an integer", name, "invalid_type")
        if value < 0:
            raise RequestError(400, f"{name!r} must be >= 0, got {value}", name, "invalid_value")
        if value > max_model_len:
            raise RequestError(400, f"{name}={value} is more than the model's context length ({max_model_len} "
                               "tokens)", name, "context_length_exceeded")
        max_tokens = value
    return GenerationRequest(body=body, chat=chat, stream=stream, max_tokens=max_tokens)


def parse_json(raw: bytes, strict: bool = True) -> Any:
    """A request body's JSON; RequestError 400 when it is not JSON, or nested too deeply to parse (a
    RecursionError is the client's doing, not a server fault). Not `strict` (an instance's answer): NaN and
    Infinity are read as the json module reads them."""
    try:
        try:
            return _decode(raw)
        except ValueError:  # msgspec refuses lone surrogates: the json module decides, and words the error
            return json.loads(raw, parse_constant=_not_json if strict else None)
    except RecursionError:
        raise RequestError(400, "the JSON body is nested too deeply", None, "invalid_json") from None
    except ValueError as error:
        raise RequestError(400, f"malformed JSON body: {error}", None, "invalid_json") from None
