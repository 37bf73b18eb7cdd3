"""An admin route's parameters: query parameters merged with a JSON object body."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from xllm_vmm.server.errors import APIError


async def route_params(request: Request) -> dict[str, Any]:
    """Query parameters merged with a JSON object body (the body wins)."""
    out: dict[str, Any] = dict(request.query_params)
    raw = await request.body()
    if raw.strip():
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        out.update(data)
    return out
