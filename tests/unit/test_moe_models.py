"""MoE recipes: deterministic seeded weights, a local tokenizer, save and load of a weights dir."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.errors import ModelConfigError
from workers.moe.recipes import build_model, list_recipes, load_recipe, save_model_dir
from workers.moe.tokenizer import build_tokenizer, encode_prompt

pytestmark = pytest.mark.timeout(60)


def test_recipes_include_mixtral_and_another_moe_family() -> None:
    names = list_recipes()
    assert {"mixtral-tiny", "qwen3-moe-tiny"} <= set(names)
    assert {load_recipe(n).family for n in names} >= {"mixtral", "qwen3_moe"}


@pytest.mark.parametrize("name", ["mixtral-tiny", "qwen3-moe-tiny", "olmoe-tiny"])
def test_a_recipe_builds_identical_weights_every_time(name: str) -> None:
    # given two builds of the same recipe (as two worker processes would do)
    first, second = build_model(load_recipe(name)), build_model(load_recipe(name))
    # then every parameter is equal, and the experts are fused 3-D tensors
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)
    experts = first.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dim() == 3 and experts.down_proj.dim() == 3


def test_a_saved_weights_dir_loads_back_with_equal_logits(tmp_path: Path) -> None:
    # given a built model saved with save_pretrained, and a recipe pointing at it
    built = build_model(load_recipe("qwen3-moe-tiny"))
    save_model_dir(built, tmp_path / "weights")
    (tmp_path / "local-moe.yaml").write_text(
        f"name: local-moe\nkind: text\nfamily: qwen3_moe\nweights: {tmp_path / 'weights'}\n"
    )
    # when the recipe is loaded
    loaded = build_model(load_recipe("local-moe", tmp_path))
    # then the tokenizer and the logits are the same
    ids = encode_prompt(loaded.tokenizer, "Explain quantum computing")
    assert ids == encode_prompt(built.tokenizer, "Explain quantum computing")
    with torch.inference_mode():
        want = built.model(input_ids=torch.tensor([ids])).logits
        got = loaded.model(input_ids=torch.tensor([ids])).logits
    assert torch.equal(want, got)


def test_a_weights_dir_without_config_is_refused_with_a_hint(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text(
        f"name: broken\nkind: text\nfamily: mixtral\nweights: {tmp_path / 'nothing'}\n"
    )
    with pytest.raises(ModelConfigError, match="save_pretrained"):
        build_model(load_recipe("broken", tmp_path))


def test_the_built_in_tokenizer_round_trips_english_and_unicode() -> None:
    tokenizer = build_tokenizer(512)
    text = "Mixture of experts routes every token. Ünïcode too."
    ids = encode_prompt(tokenizer, text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(tokenizer) <= 512
