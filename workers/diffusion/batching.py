"""Step-level batching of diffusion jobs: which chunks share a forward, and the shared forward.

Every transformer input of a pass carries a leading batch dimension (CFG included), so the pass
inputs of several jobs concatenate along dim 0 and the output splits back by each job's rows;
so do the final latents of several jobs in one VAE decode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from workers.diffusion.blockwise import BlockwiseForward, full_forward
from workers.diffusion.components import DiffusionComponents
from workers.diffusion.families import PipelineFamily
from workers.errors import ModelConfigError

Tensors = dict[str, torch.Tensor]
Signature = tuple[tuple[str, torch.dtype, tuple[int, ...], str], ...]


def batch_groups(keys: Sequence[str | None], max_batch: int) -> list[list[int]]:
    """Positions of ``keys`` grouped by equal key, in order of first appearance, each group cut
    into consecutive runs of at most ``max_batch``; a None key is a group of its own."""
    if max_batch < 1:
        raise ValueError(f"max_batch is {max_batch}; it must be at least 1")
    by_key: dict[str, list[int]] = {}
    groups: list[list[int]] = []
    for position, key in enumerate(keys):
        if key is None:
            groups.append([position])
        elif key not in by_key:
            by_key[key] = [position]
            groups.append(by_key[key])
        else:
            by_key[key].append(position)
    return [group[i:i + max_batch] for group in groups for i in range(0, len(group), max_batch)]


def batch_rows(inputs: Tensors) -> int:
    """The rows of one job's pass inputs: the leading dimension that every tensor shares."""
    rows = {name: int(x.shape[0]) if x.ndim else -1 for name, x in inputs.items()}
    if not rows or len(set(rows.values())) != 1 or -1 in rows.values():
        raise ModelConfigError(f"pass inputs do not share a leading batch dimension: {rows}; "
                               "this model cannot be batched, run it with max_batch=1")
    return next(iter(rows.values()))


def joinable(inputs: Tensors) -> Tensors:
    """``inputs`` as they join a shared forward: the timestep as float32.

    Schedulers disagree on the timestep's dtype (int64, float32, float64), and every adapter hands
    it only to diffusers' ``get_timestep_embedding``, whose first operation is ``.float()``; so
    jobs of different schedulers share a forward with the same embedding they get alone.
    """
    timestep = inputs.get("timestep")
    if timestep is None or timestep.dtype == torch.float32:
        return inputs
    return {**inputs, "timestep": timestep.to(torch.float32)}


def signature(inputs: Tensors) -> Signature:
    """What must agree for two jobs' pass inputs to concatenate without a cast or a pad."""
    return tuple((name, x.dtype, tuple(x.shape[1:]), str(x.device))
                 for name, x in sorted(inputs.items()))


def forward_together(adapter: BlockwiseForward, model: Any, inputs: Sequence[Tensors]
                     ) -> list[torch.Tensor]:
    """One forward over the jobs' concatenated pass inputs; each job's rows of the output."""
    sizes = [batch_rows(x) for x in inputs]
    if len(inputs) == 1:
        return [full_forward(adapter, model, inputs[0])]
    parts = [joinable(x) for x in inputs]
    joined = {name: torch.cat([x[name] for x in parts], dim=0) for name in parts[0]}
    return list(torch.split(full_forward(adapter, model, joined), sizes, dim=0))


def run_passes_together(adapter: BlockwiseForward, model: Any, passes: Sequence[list[Tensors]]
                        ) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Every pass of every job, pass ``p`` of all jobs that have one in shared forwards.

    Jobs whose pass inputs still differ in dtype or trailing shape after :func:`joinable` run in
    separate forwards rather than be cast or padded. Returns each job's pass outputs and
    the number of jobs in the first forward each one ran in.
    """
    outputs: list[list[torch.Tensor]] = [[] for _ in passes]
    shared_with = [0] * len(passes)
    for p in range(max(len(job) for job in passes)):
        riders: dict[Signature, list[int]] = {}
        for job, job_passes in enumerate(passes):
            if p < len(job_passes):
                riders.setdefault(signature(joinable(job_passes[p])), []).append(job)
        for jobs in riders.values():
            for job, out in zip(jobs, forward_together(adapter, model,
                                                       [passes[j][p] for j in jobs]), strict=True):
                outputs[job].append(out)
                shared_with[job] = shared_with[job] or len(jobs)
    return outputs, shared_with


def decode_together(family: PipelineFamily, c: DiffusionComponents,
                    params: Sequence[Mapping[str, Any]], latents: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
    """Each job's pixels as :func:`~workers.diffusion.families.decode_job` gives them alone, from
    one VAE decode over all jobs' rows; only the VAE call is shared."""
    inputs = [family.vae_input(c, p, x) for p, x in zip(params, latents, strict=True)]
    decoded = torch.split(family.vae_decode(c, torch.cat(inputs, dim=0)),
                          [len(x) for x in inputs], dim=0)
    return [family.pixels(c, p, rows) for p, rows in zip(params, decoded, strict=True)]
