"""Job for tests/test_galore.py: ``galore_adamw`` on a real gloo mesh of ``world`` ranks (real
mesh coordinates, real all-gathers of uneven shards), 3 steps; every rank returns the full
parameters and each step's collectives."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import functional_train as ft
from functional_train.testing import count_collectives

PLACEMENTS = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}


def problem(spec):
    """``(params, grads)``: the leaves of ``spec`` (``{name: (shape, placement name or None)}``)
    and 3 steps of gradients, the same on every rank."""
    gen = torch.Generator().manual_seed(7)
    params = {k: torch.randn(s, generator=gen) for k, (s, _) in spec.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, (s, _) in spec.items()} for _ in range(3)]
    return params, grads


def make_tx():
    return ft.galore_adamw(1e-2, weight_decay=0.1, rank=2, update_proj_gap=2)


def main(rank, world, spec):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))

    def put(x, pl):
        if pl is None:
            return x.clone()
        return distribute_tensor(x, mesh, [PLACEMENTS[pl]], src_data_rank=None)

    params, grads = problem(spec)
    tx = make_tx()
    dp = {k: put(params[k], pl) for k, (_, pl) in spec.items()}
    state = tx.init(dp)
    counts = []
    for g in grads:
        dg = {k: put(g[k], pl) for k, (_, pl) in spec.items()}
        with count_collectives() as c:
            u, state = tx.update(dg, state, dp)
        counts.append(c.counts)
        dp = ft.apply_updates(dp, u)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in dp.items()}
    return {"params": full, "counts": counts}
