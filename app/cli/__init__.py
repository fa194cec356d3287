"""The ``stepline`` command.

Every command finds the running stack through ``--run-dir``, else ``STEPLINE_RUN_DIR``, else
``.stepline/`` in the working directory — or ``REDIS_URL`` when set. The job commands (submit,
status, jobs, watch, cancel, result) go through the REST API with the Python client, using the
key in ``STEPLINE_API_KEY`` or ``<run-dir>/api-key``; the API's address is
``STEPLINE_API_URL``, else ``service.api_host``/``service.api_port``.
"""

from __future__ import annotations

import logging
import os
import sys

import typer

from app.cli import adapter, bench, experts, jobs, reliability, serve
from app.cli.common import console
from tasks.errors import SteplineError

# Each command imports what only it needs (the API, the dashboard, the bench, the stack, torch)
# inside its body, so `stepline submit --help` or `stepline jobs` start in a fraction of a
# second; tests/unit/test_cli_imports.py holds them out of the module's imports.

# Plain (click) help and tracebacks: rich's help renderer and traceback imports alone cost more
# than the 0.4 s a command's start is allowed; the output itself goes through rich (console()).
cli = typer.Typer(
    help="Stepline: SLO-aware serving of diffusion and MoE jobs.", no_args_is_help=True,
    rich_markup_mode=None, pretty_exceptions_enable=False,
)

# In the order of the help's listing; each module holds one group of commands.
for _command in (serve.up, serve.worker, jobs.submit, serve.demo, bench.bench, jobs.watch,
                 jobs.cancel, jobs.result, jobs.status, jobs.jobs, bench.simulate,
                 reliability.reliability):
    cli.command()(_command)
cli.add_typer(experts.experts_cli, name="experts")
cli.add_typer(adapter.adapter_cli, name="adapter")


def main() -> None:
    # The command line never runs under trio, but httpcore imports it whenever it is installed
    # (a test dependency brings it): a tenth of a second of every API command's start.
    sys.modules.setdefault("trio", None)  # type: ignore[arg-type]
    logging.basicConfig(level=os.environ.get("STEPLINE_LOG_LEVEL", "WARNING"))
    try:
        cli()
    except SteplineError as exc:
        console().print(f"[red]error:[/red] {exc}")
        sys.exit(2)
