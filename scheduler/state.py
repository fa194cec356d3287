"""The little the policy remembers between ticks, persisted by the adapter as plain JSON."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from scheduler.errors import StateDecodeError


class AdmissionState(str, Enum):
    """Whether overload convergence is in force."""

    OPEN = "open"
    """Load is normal: everything is released; suspended work resumes a few jobs a tick."""
    CONVERGING = "converging"
    """Load went above the threshold: batch work is held, non-critical work is on standby."""


@dataclass(frozen=True, slots=True)
class PolicyState:
    """Carried from one tick's plan to the next tick's snapshot.

    Per-job MLFQ state (level, quantum used) is not here: it lives on each job (``JobView.level``,
    ``JobView.level_service_s``) so this blob stays small however many jobs are queued.
    """

    origin_id: str | None = None
    origin_since_s: float | None = None
    admission: AdmissionState = AdmissionState.OPEN
    reserve_until_s: float | None = None
    """The reserve is held until then after the last realtime/origin pressure (hysteresis)."""
    reserved_workers: tuple[str, ...] = ()
    """Workers reserved last tick; kept reserved while alive so consumers do not churn."""

    def to_json(self) -> dict[str, Any]:
        """A plain dict for ``json.dumps``."""
        return {
            "origin_id": self.origin_id,
            "origin_since_s": self.origin_since_s,
            "admission": self.admission.value,
            "reserve_until_s": self.reserve_until_s,
            "reserved_workers": list(self.reserved_workers),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PolicyState:
        """Inverse of :meth:`to_json`; raises :class:`StateDecodeError` on a foreign shape."""
        try:
            return cls(
                origin_id=_optional_str(data["origin_id"]),
                origin_since_s=_optional_float(data["origin_since_s"]),
                admission=AdmissionState(data["admission"]),
                reserve_until_s=_optional_float(data["reserve_until_s"]),
                reserved_workers=tuple(str(name) for name in data["reserved_workers"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StateDecodeError(
                f"policy state is not what PolicyState.to_json writes ({exc!r}); "
                "delete the stored state to start afresh"
            ) from exc


def _optional_str(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"expected a string or null, got {value!r}")
    return value


def _optional_float(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number or null, got {value!r}")
    return float(value)
