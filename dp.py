"""Data parallel over the trainer ranks: which rows of a batch each rank holds, and the sums across ranks.

Sample i of a step lives on rank i mod N (local_rows), at row i // N of its local batch; a minibatch drawn over all
samples (the same draw on every rank) is trained by each rank on its share (share). Losses divide by the
minibatch's global count and the gradients are summed over the ranks before the clip (optimizer_step), so a step
over N ranks equals the one-rank step. `group` is the trainer ranks' process group; None is one rank, and then
no function here runs a collective. Megatron ranks (a forward is a collective over the expert-parallel ranks)
take equal shares, padded with dummy rows whose loss mask is 0 (even).

Run: not by itself; ppo.py and critic.py call it (tests/test_trainer_group.py: N ranks equal one).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


# --- rows: this rank's share of a batch -------------------------------------------------------------------

def rank_world(group) -> tuple[int, int]:
    """(rank, world size) of this trainer rank; (0, 1) without a group."""
    return (0, 1) if group is None else (group.rank(), group.size())


def share(mb: list[int], group, even: bool = False) -> list[int]:
    """This rank's rows of minibatch mb: sample i lives on rank i % N, at row i // N of its local batch.
    even (Megatron ranks: every forward is a collective over the expert-parallel ranks, with equal token counts):
    padded to the largest rank's share with the local batch's last row, a dummy whose loss mask is 0."""
    rank, world = rank_world(group)
    rows = [i // world for i in mb if i % world == rank]
    most = max(sum(1 for i in mb if i % world == r) for r in range(world))
    return rows + [-1] * (most - len(rows)) if even else rows


def even(args, group) -> bool:
    """Megatron ranks (a forward is a collective over the expert-parallel ranks) take equal shares, padded."""
    return args.backend == "megatron" and group is not None


def local_rows(batch: dict, group, even: bool = False) -> dict:
    """The rows of this rank's samples (i = rank mod N); the whole batch on one rank. even: every rank gets
    ceil(B / N) + 1 rows, the extra ones dummies (copies of row 0 with every mask 0: they train nothing)."""
    rank, world = rank_world(group)
    out = {k: (v[rank::world] if torch.is_tensor(v) else v) for k, v in batch.items()}
    if even and world > 1:
        n_pad = -(-len(batch["mask"]) // world) + 1 - len(out["mask"])
        dummy = {k: v[:1].expand(n_pad, *v.shape[1:]) for k, v in batch.items() if torch.is_tensor(v)}
        dummy["mask"] = torch.zeros_like(dummy["mask"])  # m = 0: no loss, no statistic, no advantage
        out.update({k: torch.cat([out[k], dummy[k]]) for k in dummy})
    return out


# --- sums over the ranks -------------------------------------------------------------------------------

def dp_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """x summed over the trainer ranks of `group`."""
    if group is not None:
        x = x.detach().clone()
        dist.all_reduce(x, group=group)
    return x


def optimizer_step(model: nn.Module, optimizer, max_grad_norm: float, group=None) -> None:
    """Sum the grads over the ranks, clip by the global norm, step (the one-rank step on the whole minibatch).
    cluster.mcore_parallel.ShardedAdam (the Megatron backend over ranks) does all three itself: DDP's reduce-scatter
    over the data-parallel ranks, the norm over every model-parallel shard, Adam on this rank's shard; it is not a torch
    Optimizer (the megatron backend on one rank steps a torch Adam, so the fact is the class, not the backend)."""
    if not isinstance(optimizer, torch.optim.Optimizer):  # mcore_parallel.ShardedAdam
        optimizer.step(max_grad_norm)
        return
    allreduce_grads(model, group)
    nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()


def allreduce_grads(model: nn.Module, group=None) -> None:
    """Sum the gradients over the ranks (one flat fp32 buffer). A parameter no rank touched (an expert
    nobody routed to) keeps grad None, as on one rank, so Adam skips it there too."""
    if group is None:
        return
    params = list(model.parameters())
    used = dp_sum(torch.tensor([float(p.grad is not None) for p in params]), group) > 0
    params = [p for p, u in zip(params, used) if u]
    flat = dp_sum(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                             for p in params]), group)
    i = 0
    for p in params:
        p.grad = flat[i:i + p.numel()].view_as(p).to(p.dtype)
        i += p.numel()
