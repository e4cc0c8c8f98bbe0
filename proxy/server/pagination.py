"""The query parameters of every list endpoint: `limit`, `order`, `after`.

One parser, so the conversation items, a response's input items and the ledger's entries
page alike: OpenAI's list limits (openapi: `limit` "can range between 1 and 100, and the
default is 20"; `order` asc or desc, default desc) and OpenAI's 400 for a bad value,
naming the parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from proxy.server.errors import ApiError, invalid
from proxy.server.validate import unsupported_value

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
Order = Literal["asc", "desc"]


@dataclass(frozen=True)
class Page:
    limit: int
    order: Order
    after: str | None


def page_params(query: Mapping[str, str]) -> Page:
    return Page(
        limit=limit_param(query.get("limit")),
        order=order_param(query.get("order")),
        after=query.get("after") or None,
    )


def limit_param(value: str | None) -> int:
    if value is None or value == "":
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except ValueError:
        raise limit_error(
            f"expected an integer, but got '{value}' instead.", "invalid_type"
        ) from None
    if limit < 1:
        raise limit_error(
            f"integer below minimum value. Expected a value >= 1, but got {limit} instead.",
            "integer_below_min_value",
        )
    if limit > MAX_LIMIT:
        raise limit_error(
            f"integer above maximum value. Expected a value <= {MAX_LIMIT}, but got {limit} "
            "instead.",
            "integer_above_max_value",
        )
    return limit


def limit_error(detail: str, code: str) -> ApiError:
    return invalid(f"Invalid 'limit': {detail}", param="limit", code=code)


def order_param(value: str | None) -> Order:
    if value is None or value == "" or value == "desc":
        return "desc"
    if value == "asc":
        return "asc"
    raise unsupported_value(value, ("asc", "desc"), "order")
