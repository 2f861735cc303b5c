"""What the gloo jobs of the test suite share: the per-replica problem. (The jobs run on the
session's ranks, ``tests/_ranks.py``: each is a ``main(rank, world, ...)`` that returns what the
test checks.)"""

import torch


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
