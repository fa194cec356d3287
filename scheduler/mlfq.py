"""Multi-level feedback queue: skip-join by class and size, demotion by quantum, aging."""

from __future__ import annotations

from scheduler.lifecycle import SloClass
from scheduler.model import JobView
from scheduler.plan import LevelMark
from scheduler.policy import PolicyConfig
from scheduler.queues import LOWEST_LEVEL

assert LOWEST_LEVEL == 2, "join_level and level_quanta_s assume three levels"


def join_level(slo_class: SloClass, remaining_s: float, policy: PolicyConfig) -> int:
    """Skip-join: the first level whose quantum fits the job's estimated work, but never a more
    urgent level than its class."""
    quantum0_s, quantum1_s = policy.level_quanta_s
    size_level = 0 if remaining_s <= quantum0_s else (1 if remaining_s <= quantum1_s else 2)
    return max(slo_class.rank, size_level)


def mark_level(job: JobView, remaining_s: float, policy: PolicyConfig) -> int:
    """``current_mark(...).level`` without building the mark: the tick asks it of many jobs."""
    level = job.level
    if level is None:
        return join_level(job.slo_class, remaining_s, policy)
    if level < LOWEST_LEVEL and job.service_s - job.level_service_s >= policy.level_quanta_s[level]:
        return level + 1
    return level


def current_mark(job: JobView, remaining_s: float, policy: PolicyConfig) -> LevelMark:
    """The job's MLFQ mark now: joined if new, demoted one level once its quantum is used."""
    if job.level is None:
        return LevelMark(join_level(job.slo_class, remaining_s, policy), job.service_s)
    used_s = job.service_s - job.level_service_s
    if job.level < LOWEST_LEVEL and used_s >= policy.level_quanta_s[job.level]:
        return LevelMark(job.level + 1, job.service_s)
    return LevelMark(job.level, job.level_service_s)


def aged_level(level: int, wait_s: float, slo_class: SloClass, policy: PolicyConfig) -> int:
    """One level up per aging bound waited. Only realtime-class jobs age back into level 0, so
    the realtime queue (and the reserve) carries realtime work only."""
    steps = int(wait_s // policy.aging_bound_s) if wait_s > 0 else 0
    if steps <= 0:
        return level
    floor = 0 if slo_class is SloClass.REALTIME else 1
    return max(min(level, floor), level - steps)
