"""Checks of the values users pass, shared by every entry point that takes them: a bad value is
refused where it is given, with its name, before it can reach the pool (a priority of "high"
stored on cached blocks broke every later eviction of every request)."""

from __future__ import annotations

import math
import operator

PUBLIC_TENANT = "__public__"  # blocks every tenant may use, only by an explicit publish call
PRIORITY_LIMIT = 1_000_000


def integer(name: str, value) -> int:
    """`value` as an int (numpy integers too); ValueError naming `name` otherwise (bools too)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def tenant(value) -> str:
    """A tenant name: non-empty text (UTF-8 encodable: it is hashed into every block digest; a
    lone surrogate failed the engine's step, for every request in it)."""
    if not isinstance(value, str) or not value or value == PUBLIC_TENANT:
        raise ValueError(f"tenant must be a non-empty string other than {PUBLIC_TENANT!r}, got {value!r}")
    if not is_unicode(value):
        raise ValueError(f"tenant must be Unicode text, got {value!r} (a lone surrogate)")
    return value


def is_unicode(text: str) -> bool:
    """Whether UTF-8 can encode `text`: Python strings, and JSON's, may hold lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def priority(value) -> int:
    """A priority: an integer within +-PRIORITY_LIMIT (the load controller reports the shed
    priority as a float gauge; a 400-digit one failed the engine's step)."""
    value = integer("priority", value)
    if abs(value) > PRIORITY_LIMIT:
        raise ValueError(f"priority must be within [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}], got {value}")
    return value


def seconds(name: str, value, optional: bool = True) -> float | None:
    """A duration such as a TTL: a finite number > 0, or None (no limit) where `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0{', or None' if optional else ''}, "
                         f"got {value!r}")
    return float(value)
