"""Priority inheritance: a job that others wait on runs at the most urgent waiter's level."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence


def inherit_levels(waiters: Iterable[tuple[str, int]], depends_on: Mapping[str, Sequence[str]],
                   own_level: Callable[[str], int]) -> dict[str, int]:
    """Levels lowered by inheritance, transitively: ``{job_id: level}`` for every live job that
    a waiter at a more urgent level (directly or through a chain) waits on.

    ``depends_on`` maps each live job to the ids it waits for; ids not in it are finished and
    ignored. A level only ever falls, so cycles end.
    """
    inherited: dict[str, int] = {}
    stack = [(dep, level) for job_id, level in waiters for dep in depends_on.get(job_id, ())]
    while stack:
        job_id, level = stack.pop()
        if job_id not in depends_on:
            continue
        if level >= inherited.get(job_id, own_level(job_id)):
            continue
        inherited[job_id] = level
        stack.extend((dep, level) for dep in depends_on[job_id])
    return inherited
