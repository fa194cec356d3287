"""Durations in the YAML may say ``100ms``, ``5min`` or ``2s``; in code they are float seconds."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

_UNITS_S = {"ms": 0.001, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PATTERN = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-z]*)\s*$")


def parse_duration_s(value: Any) -> Any:
    """Turn ``"100ms"`` into ``0.1``; numbers pass through as seconds; anything else is left
    for pydantic to reject with its own message. A sign is read (``"-1s"`` is -1.0), so that a
    negative duration is refused by the setting's bound, which names it."""
    if isinstance(value, str):
        match = _PATTERN.match(value.lower())
        if match is None or match.group(2) not in {"", *_UNITS_S}:
            raise ValueError(f"{value!r} is not a duration; write e.g. 100ms, 2s or 5min")
        return float(match.group(1)) * _UNITS_S.get(match.group(2) or "s", 1.0)
    return value


Seconds = Annotated[float, BeforeValidator(parse_duration_s)]
