"""A typed Python client of Grove's REST API."""

from client.api import (
    DEFAULT_API,
    ApiError,
    Conflict,
    Forbidden,
    Grove,
    GroveError,
    Invalid,
    NotFound,
    Unauthorized,
    Unreachable,
    from_env,
)

__all__ = [
    "DEFAULT_API",
    "ApiError",
    "Conflict",
    "Forbidden",
    "Grove",
    "GroveError",
    "Invalid",
    "NotFound",
    "Unauthorized",
    "Unreachable",
    "from_env",
]
