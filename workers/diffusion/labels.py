"""Class names of class-conditioned recipes: a prompt that names a class becomes its label, the
way ``DiTPipeline.get_label_ids`` maps names; read without torch, so the API checks cheaply.

``imagenet_classes.txt`` holds the 1000 ImageNet (ILSVRC 2012) class names, one per class id
0..999 in DiT's order: the first WordNet lemma of each class's synset, as the ImageNet class
list is commonly distributed. diffusers does not ship it (a DiT checkpoint carries it as
``id2label`` in its ``model_index.json``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

IMAGENET_CLASSES_FILE = Path(__file__).with_name("imagenet_classes.txt")
CLASS_NAME_SETS = ("imagenet",)
"""The class-name lists a recipe's ``class_names`` may name."""


@lru_cache(maxsize=1)
def imagenet_id2label() -> dict[int, str]:
    """Class id -> name of the 1000 ImageNet classes."""
    names = IMAGENET_CLASSES_FILE.read_text(encoding="utf-8").splitlines()
    return dict(enumerate(names))


@lru_cache(maxsize=1)
def imagenet_labels() -> dict[str, int]:
    """Name -> class id of the ImageNet classes (:func:`label_ids`)."""
    return label_ids(imagenet_id2label())


def label_ids(id2label: Mapping[int, str]) -> dict[str, int]:
    """Name -> class id, as ``DiTPipeline.__init__`` builds its ``labels``: each entry's
    comma-separated names stripped, a later id winning a name two classes share."""
    labels: dict[str, int] = {}
    for key, value in id2label.items():
        for label in value.split(","):
            labels[label.strip()] = int(key)
    return dict(sorted(labels.items()))


def resolve_class(prompt: str, labels: Mapping[str, int]) -> int | None:
    """The class ``prompt`` names: exactly, else ignoring case and surrounding blanks."""
    if prompt in labels:
        return labels[prompt]
    folded = {name.casefold(): label for name, label in labels.items()}
    return folded.get(prompt.strip().casefold())


def closest_names(prompt: str, labels: Mapping[str, int], n: int = 5) -> list[str]:
    """Up to ``n`` class names most like ``prompt`` (difflib's ratio, case ignored)."""
    by_folded = {name.casefold(): name for name in labels}
    close = difflib.get_close_matches(prompt.strip().casefold(), list(by_folded), n=n,
                                      cutoff=0.5)
    return [by_folded[name] for name in close]
