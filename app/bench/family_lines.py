"""How much code each diffusion family costs: non-blank lines that are not comments, per family,
in ``workers/diffusion``. A family added as a module of its own (Flux, SD3, Qwen-Image, Z-Image,
Wan 2.2) counts that whole module; the first three families live as classes in the shared
modules (``families.py``, ``blockwise.py``) and count those classes. What is left of those two
modules, with ``flow.py`` (the flow-matching timesteps, 2x2 packing and VAE shift of the Flux
line, Qwen-Image and Z-Image), is shared and counted apart; the runner around them is not
counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIFFUSION = Path("workers/diffusion")
MODULES = {"flux": "flux.py", "sd3": "sd3.py", "qwen_image": "qwen_image.py",
           "zimage": "zimage.py", "wan22": "wan22.py", "flux_kontext": "flux_kontext.py",
           "wan22_i2v": "wan22_i2v.py", "flux2_klein": "flux2_klein.py",
           "hunyuan_video15": "hunyuan_video15.py"}
"""Families in a module of their own."""
CLASSES = {"dit": ("DiTFamily", "DiTBlockwise"), "pixart": ("PixArtFamily", "PixArtBlockwise"),
           "wan": ("WanFamily", "WanBlockwise")}
"""Families held as classes in ``families.py`` and ``blockwise.py``."""
SHARED = ("families.py", "blockwise.py",
          "flow.py")


def code_lines(lines: list[str]) -> int:
    """Lines that are neither blank nor a comment alone (docstrings count: they are code)."""
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def _class_spans(path: Path) -> dict[str, tuple[int, int]]:
    tree = ast.parse(path.read_text())
    return {node.name: (node.lineno - 1 - len(node.decorator_list), node.end_lineno or node.lineno)
            for node in tree.body if isinstance(node, ast.ClassDef)}


def family_lines(root: Path = ROOT) -> dict[str, int]:
    """Code lines per family, plus ``shared``: the rest of the shared modules."""
    out = {family: code_lines((root / DIFFUSION / name).read_text().splitlines())
           for family, name in MODULES.items()}
    shared = 0
    for module in SHARED:
        path = root / DIFFUSION / module
        lines = path.read_text().splitlines()
        spans = _class_spans(path)
        taken: set[int] = set()
        for family, classes in CLASSES.items():
            for name in classes:
                if name in spans:
                    start, stop = spans[name]
                    out[family] = out.get(family, 0) + code_lines(lines[start:stop])
                    taken.update(range(start, stop))
        shared += code_lines([line for n, line in enumerate(lines) if n not in taken])
    out["shared"] = shared
    return out


def lines_table(counts: dict[str, int]) -> str:
    """``family  lines`` rows, the families first, ``shared`` last."""
    width = max(len("family"), *map(len, counts))
    rows = [f"{'family':{width}s} {'code lines':>10s}"]
    rows += [f"{family:{width}s} {n:10d}" for family, n in counts.items()]
    return "\n".join(rows)
