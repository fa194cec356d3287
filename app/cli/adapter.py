"""``stepline adapter``: the LoRA adapters of the diffusion models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from app.cli.common import ConfigFile, RunDir, _setup, console

adapter_cli = typer.Typer(help="LoRA adapters of the diffusion models: list, make (random, "
                          "for trying the feature).", no_args_is_help=True)


def _adapter_folder() -> Path:
    from tasks.runtime import current_settings  # deferred: the settings tree
    from workers.diffusion.adapters import DEFAULT_ADAPTERS_DIR  # deferred: pydantic models

    return current_settings().diffusion.adapters_dir or DEFAULT_ADAPTERS_DIR


@adapter_cli.command("list")
def adapter_list(run_dir: RunDir = None, config: ConfigFile = None) -> None:
    """The adapters in the configured folder (diffusion.adapters_dir), with the model each fits."""
    from rich.table import Table

    from workers.diffusion.adapters import adapter_registry  # deferred: pydantic models

    _setup(run_dir, config)
    folder = _adapter_folder()
    table = Table("name", "model", "rank", "alpha", "target modules", title=str(folder))
    for spec in adapter_registry(folder).all():
        table.add_row(spec.name, spec.base, str(spec.rank), f"{spec.alpha:g}",
                      ", ".join(spec.target_modules))
    console().print(table)


@adapter_cli.command("make")
def adapter_make(
    name: Annotated[str, typer.Argument(help="Adapter name (letters, digits, . _ -).")],
    model: Annotated[str, typer.Option(help="The diffusion model (recipe) it fits.")],
    rank: Annotated[int, typer.Option(min=1, max=256, help="LoRA rank.")] = 4,
    alpha: Annotated[Optional[float], typer.Option(help="LoRA alpha (default: the rank).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of its random weights.")] = 0,
    folder: Annotated[Optional[Path], typer.Option(
        "--dir", help="Where to register it (default: diffusion.adapters_dir).")] = None,
    run_dir: RunDir = None,
    config: ConfigFile = None,
) -> None:
    """Make a LoRA adapter of random weights for MODEL with PEFT and register it (its
    safetensors file and NAME.yaml): to try adapters without a trained one. Nothing is
    downloaded; a trained adapter is registered the same way, by its own NAME.yaml."""
    from workers.diffusion.adapters import AdapterSpec  # deferred: pydantic models
    from workers.diffusion.recipes import diffusion_recipe  # deferred: the recipes
    from workers.errors import ModelConfigError  # deferred: with the recipes

    _setup(run_dir, config)
    target = folder or _adapter_folder()
    try:
        AdapterSpec(name=name, base=model, weights="-", rank=rank, alpha=alpha or rank,
                    target_modules=["-"])
        recipe = diffusion_recipe(model)
    except (ModelConfigError, ValueError) as exc:
        console().print(f"[red]rejected:[/red] {exc}")
        raise typer.Exit(2) from exc
    from workers.diffusion.lora import make_random_adapter  # deferred: loads torch and peft

    spec = make_random_adapter(recipe, name, target, rank=rank, alpha=alpha, seed=seed)
    console().print(f"registered adapter {spec.name!r} for model {spec.base!r} in {target}")
