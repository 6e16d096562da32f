"""Reading config keys with one clear error per missing or mistyped key."""

from __future__ import annotations

from pyml.core.errors import ModelFormatError


def require(cfg: dict, key: str, kind: type, source: str):
    """cfg[key] as `kind`; a missing key or a value of the wrong type is a ModelFormatError."""
    if key not in cfg or cfg[key] is None:
        raise ModelFormatError(f"{source}: required key {key!r} is missing")
    value = cfg[key]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelFormatError(f"{source}: {key} must be a positive integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelFormatError(f"{source}: {key} must be a number, got {value!r}")
        value = float(value)
    return value
