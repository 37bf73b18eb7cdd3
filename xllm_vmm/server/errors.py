"""OpenAI-shaped errors: every failure a client sees is ``{"error": {"message", "type", "param",
"code"}}`` with the HTTP status that says who has to act.

| status | type | when |
|---|---|---|
| 400 | ``invalid_request_error`` | a bad parameter (``param`` names it), a prompt longer than the context (both numbers), an unknown model |
| 401 | ``authentication_error`` | a missing or wrong ``Authorization: Bearer`` key |
| 404 | ``not_found_error`` | a route that does not exist (admin routes while they are disabled) |
| 409 | ``conflict_error`` | sleep asked while requests run (without ``drain``), or deeper than the current sleep |
| 413 | ``invalid_request_error`` | the request body is over ``--max-request-bytes`` |
| 429 | ``rate_limit_error`` | the waiting queue is full (``--max-waiting-requests``) |
| 503 | ``service_unavailable`` | the engine sleeps, its weights are not loaded, or the server is shutting down |
| 500 | ``internal_error`` | the engine failed; the message says what it raised |

``code`` repeats the status as a number (what vLLM sends). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered to the client as is (status + OpenAI body)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str | None = None, code: int | str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.code = status if code is None else code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str) -> APIError:
    return APIError(503, message)


def from_validation(errors: list[dict]) -> APIError:
    """A 400 from pydantic's ``errors()``: the first error's location is the ``param``
    (``messages.0.role``), its message says what is wrong; the others follow."""
    parts = []
    param = None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc)
        if param is None and where:
            param = where
        msg = str(e.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        parts.append(f"{where}: {msg}" if where else msg)
    return APIError(400, "; ".join(parts) or "invalid request", param=param)
