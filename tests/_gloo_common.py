"""What every gloo worker of the test suite does the same way: the per-replica problem, the
process group's start from the command line ``rank world init_file out``, and the end (rank 0
saves the result, every rank waits for it)."""

import sys

import torch
import torch.distributed as dist


def replica_problem(shapes: dict, steps: int, replicas: int = 2, seed: int = 0):
    """``(params, grads)``: standard normal params of ``shapes`` and, per step, one gradient tree
    per data-parallel replica (their mean is what one process applies)."""
    g = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = [
        [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(replicas)]
        for _ in range(steps)
    ]
    return params, grads


def start():
    """Join the gloo process group named by ``sys.argv``; returns ``(rank, world, out)``."""
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return rank, world, out


def finish(rank: int, result, out: str) -> None:
    """Rank 0 saves ``result`` to ``out``; every rank waits, then leaves the group."""
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()
