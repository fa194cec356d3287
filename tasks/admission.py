"""The admission status each tick publishes (``sl:admission``, JSON): one frozen record and its one
codec, written by the tick and read by the submit path, the autoscaler and the stats."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler import AdmissionStatus, TickPlan
from scheduler.state import AdmissionState
from tasks.errors import AdmissionStatusError


@dataclass(frozen=True, slots=True)
class PublishedAdmission:
    """What the last tick decided about admission, and under which policy."""

    state: AdmissionState
    load: float
    retry_after_s: float
    measured_at_s: float
    policy: str | None = None
    """The policy the tick ran (None: a status written without one)."""
    reserved_workers: tuple[str, ...] = ()
    """Workers held for realtime work by that tick."""
    compute_load: float | None = None
    """Outstanding compute work alone ÷ capacity (None: not measured)."""
    effective_load: float | None = None
    """Compute plus the expected model loads ÷ capacity (None: not measured)."""

    @classmethod
    def of_plan(cls, plan: TickPlan) -> PublishedAdmission:
        a = plan.admission
        return cls(state=a.state, load=a.load, retry_after_s=a.retry_after_s,
                   measured_at_s=a.measured_at_s, policy=plan.policy.value,
                   reserved_workers=tuple(sorted(plan.reserved_workers)),
                   compute_load=a.compute_load, effective_load=a.effective_load)

    @property
    def status(self) -> AdmissionStatus:
        """What the submit path's ``admit`` needs."""
        return AdmissionStatus(state=self.state, load=self.load,
                               retry_after_s=self.retry_after_s, measured_at_s=self.measured_at_s,
                               compute_load=self.compute_load,
                               effective_load=self.effective_load)

    def as_json(self) -> dict[str, Any]:
        """The JSON object of the wire form (and of ``/v1/stats``'s ``load``): ``load`` the
        figure admission goes by, ``effective_load`` and ``compute_load`` beside it (left out
        when the tick did not measure them)."""
        body: dict[str, Any] = {
            "state": self.state.value, "load": self.load, "retry_after_s": self.retry_after_s,
            "measured_at_s": self.measured_at_s, "policy": self.policy,
            "reserved_workers": list(self.reserved_workers)}
        for key, value in (("effective_load", self.effective_load),
                           ("compute_load", self.compute_load)):
            if value is not None:
                body[key] = value
        return body

    def encode(self) -> str:
        return json.dumps(self.as_json())

    @classmethod
    def decode(cls, raw: bytes | str) -> PublishedAdmission:
        """The status from its wire form; ``policy``, ``reserved_workers`` and the load figures
        may be missing (a status written by hand or by an older tick). Anything else wrong
        raises :class:`AdmissionStatusError` naming the entry."""
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise AdmissionStatusError(f"the admission status is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise AdmissionStatusError("the admission status is not a JSON object")
        try:
            state = AdmissionState(body.get("state"))
        except ValueError:
            raise AdmissionStatusError(
                f"the admission status's state is {body.get('state')!r}, not one of "
                f"{[s.value for s in AdmissionState]}") from None
        policy, reserved = body.get("policy"), body.get("reserved_workers") or []
        if policy is not None and not isinstance(policy, str):
            raise AdmissionStatusError("the admission status's policy is not a string")
        if not isinstance(reserved, list) or not all(isinstance(w, str) for w in reserved):
            raise AdmissionStatusError("the admission status's reserved_workers is not a list "
                                       "of names")
        return cls(state=state, load=_number(body, "load"),
                   retry_after_s=_number(body, "retry_after_s"),
                   measured_at_s=_number(body, "measured_at_s"), policy=policy,
                   reserved_workers=tuple(reserved),
                   compute_load=_optional_number(body, "compute_load"),
                   effective_load=_optional_number(body, "effective_load"))


def _number(body: Mapping[str, Any], key: str) -> float:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdmissionStatusError(f"the admission status's {key} is {value!r}, not a number")
    return float(value)


def _optional_number(body: Mapping[str, Any], key: str) -> float | None:
    return None if body.get(key) is None else _number(body, key)
