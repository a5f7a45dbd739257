"""OpenAI's error shape (`APIError`, with the HTTP status to answer) and the turn of pydantic's
validation errors into 400s whose `param` names the field (`parse_request`).

A validator that knows its param more precisely than its location raises `_ParamError`; any
other `ValueError` of a validator is the client's message as it stands. Messages never repeat a
long input (`_short`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import pydantic
from pydantic import BaseModel

MAX_ECHOED_CHARS = 100  # longest value an error message repeats back


class APIError(Exception):
    """A request failure in OpenAI's error shape, with the HTTP status to answer."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: int | str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = status if code is None else code

    def body(self) -> dict:
        """`{"error": {"message", "type", "param", "code"}}`, ready for a JSON response."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> APIError:
        return cls(400, message, "BadRequestError", param)

    @classmethod
    def unauthorized(cls, message: str = "Invalid or missing API key.") -> APIError:
        return cls(401, message, "AuthenticationError")

    @classmethod
    def not_found(cls, message: str, param: str | None = None) -> APIError:
        return cls(404, message, "NotFoundError", param)

    @classmethod
    def model_not_found(cls, model: str | None) -> APIError:
        name = str(model)
        if len(name) > MAX_ECHOED_CHARS:
            name = name[: MAX_ECHOED_CHARS - 3] + "..."
        return cls.not_found(f"The model `{name}` does not exist.", param="model")

    @classmethod
    def too_large(cls, max_bytes: int | None = None) -> APIError:
        limit = "" if max_bytes is None else f" (the limit is {max_bytes} bytes)"
        return cls(413, f"The request body is too large{limit}.", "RequestTooLargeError")

    @classmethod
    def unavailable(cls, message: str = "The engine is not available.") -> APIError:
        return cls(503, message, "ServiceUnavailableError")

    @classmethod
    def internal(cls, message: str = "Internal server error.") -> APIError:
        """A 500. The message must stay generic: log the cause on the server, never send it
        (no exception text, paths or tracebacks)."""
        return cls(500, message, "InternalServerError")


class _ParamError(ValueError):
    """A validator's error that names its param: relative to the validator's location (the
    field or nested model it validates; the request itself for a model validator)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def _short(value: Any) -> str:
    """`value` as an error message may repeat it: at most MAX_ECHOED_CHARS characters."""
    if isinstance(value, str):
        text = repr(value[: MAX_ECHOED_CHARS + 1])
    elif value is None or isinstance(value, bool | int | float):
        text = repr(value)
    else:
        return f"a {type(value).__name__}"  # never render a container: it may be huge
    return text if len(text) <= MAX_ECHOED_CHARS else text[: MAX_ECHOED_CHARS - 3] + "..."


# Union members pydantic names in an error's location; they are not part of the param.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _param_of(loc: Sequence[int | str]) -> str | None:
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or p.isdigit() or (p.isidentifier() and p not in _TYPE_TAGS)
    ]
    return ".".join(parts) or None


def from_validation_error(exc: pydantic.ValidationError) -> APIError:
    """A 400 for the first error of a validation: its dotted location is the param
    ("temperature", "messages.0.role") and the message never repeats a long input.

    Also takes FastAPI's RequestValidationError (anything with `.errors()`; a leading "body"
    location is dropped)."""
    errors = exc.errors()
    if not errors:
        return APIError.bad_request("Invalid request.")
    err = errors[0]
    loc = list(err.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ValueError):  # one of ours: the message names its field
        if isinstance(cause, _ParamError) and cause.param:
            loc = [*loc, *cause.param.split(".")]
        param = _param_of(loc)
        message = str(cause)
        if param and "." in param and not message.startswith(param):
            message = f"{param}: {message}"  # nested: say where
        return APIError.bad_request(message, param)
    param = _param_of(loc)
    if err.get("type") == "model_type":
        if param is None:
            return APIError.bad_request("The request body must be a JSON object.")
        return APIError.bad_request(f"{param} must be a JSON object", param)
    subject = param or "request body"
    if err.get("type") == "missing":
        return APIError.bad_request(f"{subject} is required", param)
    message = f"{subject}: {err.get('msg', 'invalid value')}"
    if "input" in err and not isinstance(err["input"], dict | list):
        message += f" (got {_short(err['input'])})"
    return APIError.bad_request(message, param)


_M = TypeVar("_M", bound=BaseModel)


def parse_request(model: type[_M], body: Any) -> _M:
    """Validates a decoded JSON body into `model`; any failure is an APIError (400)."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None
