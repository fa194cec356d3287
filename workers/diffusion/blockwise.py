"""Transformer forwards split into prologue, blocks and epilogue, so a step can stop between
groups of blocks and resume elsewhere.

Each adapter replays its diffusers model's own ``forward`` (same modules, same order, same
arguments), so running every block in one go is bit-identical to ``model(...)``; the unit tests
check that against the model for every recipe. ``ctx`` holds every tensor the blocks and the
epilogue need, so a partial step is (hidden states, ctx) plus a cursor.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

Tensors = dict[str, torch.Tensor]


class BlockwiseForward(Protocol):
    """A transformer forward cut at block boundaries."""

    def num_blocks(self, model: Any) -> int:
        """How many transformer blocks the model has."""
        ...

    def prologue(self, model: Any, inputs: Tensors) -> tuple[torch.Tensor, Tensors]:
        """Embed the inputs: the hidden states entering block 0 and the context of every block."""
        ...

    def block(self, model: Any, index: int, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        """Run block ``index``."""
        ...

    def epilogue(self, model: Any, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        """Final norm, projection and unpatchify: the model's output sample."""
        ...


def _grid(*sizes: int) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64)


class DiTBlockwise:
    """``DiTTransformer2DModel.forward`` (ada_norm_zero, class labels)."""

    def num_blocks(self, model: Any) -> int:
        return len(model.transformer_blocks)

    def prologue(self, model: Any, inputs: Tensors) -> tuple[torch.Tensor, Tensors]:
        hidden = model.pos_embed(inputs["hidden_states"])
        return hidden, {"timestep": inputs["timestep"], "class_labels": inputs["class_labels"]}

    def block(self, model: Any, index: int, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        out: torch.Tensor = model.transformer_blocks[index](
            hidden, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
            timestep=ctx["timestep"], cross_attention_kwargs=None, class_labels=ctx["class_labels"],
        )
        return out

    def epilogue(self, model: Any, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        emb = model.transformer_blocks[0].norm1.emb
        conditioning = emb(ctx["timestep"], ctx["class_labels"], hidden_dtype=hidden.dtype)
        shift, scale = model.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
        hidden = model.norm_out(hidden) * (1 + scale[:, None]) + shift[:, None]
        hidden = model.proj_out_2(hidden)
        p, c = model.patch_size, model.out_channels
        side = int(hidden.shape[1] ** 0.5)
        hidden = hidden.reshape(shape=(-1, side, side, p, p, c))
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        return hidden.reshape(shape=(-1, c, side * p, side * p))


class PixArtBlockwise:
    """``PixArtTransformer2DModel.forward`` (ada_norm_single, cross-attention to T5 states)."""

    def num_blocks(self, model: Any) -> int:
        return len(model.transformer_blocks)

    def prologue(self, model: Any, inputs: Tensors) -> tuple[torch.Tensor, Tensors]:
        x = inputs["hidden_states"]
        mask = inputs["encoder_attention_mask"]
        bias = ((1 - mask.to(x.dtype)) * -10000.0).unsqueeze(1)
        p = model.config.patch_size
        hidden = model.pos_embed(x)
        timestep, embedded = model.adaln_single(
            inputs["timestep"], {"resolution": None, "aspect_ratio": None},
            batch_size=x.shape[0], hidden_dtype=hidden.dtype,
        )
        enc = inputs["encoder_hidden_states"]
        if model.caption_projection is not None:
            enc = model.caption_projection(enc).view(x.shape[0], -1, hidden.shape[-1])
        return hidden, {
            "timestep": timestep, "embedded_timestep": embedded, "encoder_hidden_states": enc,
            "encoder_attention_mask": bias, "grid": _grid(x.shape[-2] // p, x.shape[-1] // p),
        }

    def block(self, model: Any, index: int, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        out: torch.Tensor = model.transformer_blocks[index](
            hidden, attention_mask=None, encoder_hidden_states=ctx["encoder_hidden_states"],
            encoder_attention_mask=ctx["encoder_attention_mask"], timestep=ctx["timestep"],
            cross_attention_kwargs=None, class_labels=None,
        )
        return out

    def epilogue(self, model: Any, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        table = model.scale_shift_table
        shift, scale = (table[None] + ctx["embedded_timestep"][:, None]).chunk(2, dim=1)
        hidden = model.norm_out(hidden) * (1 + scale) + shift
        hidden = model.proj_out(hidden).squeeze(1)
        height, width = (int(v) for v in ctx["grid"])
        p, c = model.config.patch_size, model.out_channels
        hidden = hidden.reshape(shape=(-1, height, width, p, p, c))
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        return hidden.reshape(shape=(-1, c, height * p, width * p))


class WanBlockwise:
    """``WanTransformer3DModel.forward`` for Wan 2.1 text-to-video (no image embedding)."""

    def num_blocks(self, model: Any) -> int:
        return len(model.blocks)

    def prologue(self, model: Any, inputs: Tensors) -> tuple[torch.Tensor, Tensors]:
        x = inputs["hidden_states"]
        p_t, p_h, p_w = model.config.patch_size
        cos, sin = model.rope(x)
        hidden = model.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
        temb, proj, enc, _ = model.condition_embedder(
            inputs["timestep"], inputs["encoder_hidden_states"], None, timestep_seq_len=None
        )
        return hidden, {
            "temb": temb, "timestep_proj": proj.unflatten(1, (6, -1)), "encoder_hidden_states": enc,
            "rope_cos": cos, "rope_sin": sin,
            "grid": _grid(x.shape[0], x.shape[2] // p_t, x.shape[3] // p_h, x.shape[4] // p_w),
        }

    def block(self, model: Any, index: int, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        out: torch.Tensor = model.blocks[index](
            hidden, ctx["encoder_hidden_states"], ctx["timestep_proj"],
            (ctx["rope_cos"], ctx["rope_sin"]),
        )
        return out

    def epilogue(self, model: Any, hidden: torch.Tensor, ctx: Tensors) -> torch.Tensor:
        shift, scale = (model.scale_shift_table + ctx["temb"].unsqueeze(1)).chunk(2, dim=1)
        hidden = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        hidden = model.proj_out(hidden)
        batch, frames, height, width = (int(v) for v in ctx["grid"])
        p_t, p_h, p_w = model.config.patch_size
        hidden = hidden.reshape(batch, frames, height, width, p_t, p_h, p_w, -1)
        hidden = hidden.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def run_blocks(
    adapter: BlockwiseForward, model: Any, start: int, stop: int, hidden: torch.Tensor, ctx: Tensors
) -> torch.Tensor:
    """Blocks ``start`` to ``stop - 1``."""
    for index in range(start, stop):
        hidden = adapter.block(model, index, hidden, ctx)
    return hidden


def full_forward(adapter: BlockwiseForward, model: Any, inputs: Tensors) -> torch.Tensor:
    """The whole forward through the adapter (what ``model(**inputs)`` computes)."""
    hidden, ctx = adapter.prologue(model, inputs)
    hidden = run_blocks(adapter, model, 0, adapter.num_blocks(model), hidden, ctx)
    return adapter.epilogue(model, hidden, ctx)


def group_bounds(num_blocks: int, groups: int) -> list[tuple[int, int]]:
    """Split ``num_blocks`` into at most ``groups`` contiguous, near-equal ranges."""
    groups = max(1, min(groups, num_blocks))
    edges = [round(i * num_blocks / groups) for i in range(groups + 1)]
    return [(edges[i], edges[i + 1]) for i in range(groups)]
