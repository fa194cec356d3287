"""The reliability drill (registered by ``app.cli``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def reliability(
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("reliability-out"),
    burst_s: Annotated[float, typer.Option(min=0, max=60, help="API burst length (0: none).")] = (
        10.0
    ),
    cpu_hogs: Annotated[int, typer.Option(min=0, max=64, help="Busy processes competing for "
                                          "the cores for the whole drill.")] = 0,
    hosts: Annotated[int, typer.Option(min=0, max=16, help="Run the drill across this many "
                                       "simulated hosts (network namespaces; needs root) "
                                       "instead: Redis with Sentinel and S3 on a bridge.")] = 0,
    faults: Annotated[Optional[str], typer.Option(help="With --hosts: comma-separated faults "
                                                  "(default: all).")] = None,
) -> None:
    """Start a private stack, inject each fault under a mixed load, try bad inputs; write
    reliability.json and exit non-zero if any accepted job was lost or ran twice."""
    if hosts:
        from app.drills.hosts import (  # deferred: the drill, its namespaces and stack
            FAULTS,
            HostsUnavailable,
            run_hosts_drill,
        )

        chosen = tuple(f for f in (faults or ",".join(FAULTS)).split(",") if f)
        try:
            code = run_hosts_drill(out.resolve(), hosts, chosen)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        except HostsUnavailable as exc:
            typer.echo(f"stepline: {exc}", err=True)
            code = 2
        raise typer.Exit(code)
    from app.drills.reliability import run_reliability  # deferred: the stack and the bench

    raise typer.Exit(run_reliability(out.resolve(), burst_s=burst_s, cpu_hogs=cpu_hogs))
