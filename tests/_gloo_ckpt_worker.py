"""Worker for tests/test_checkpoint.py: optimizer states saved with torch.distributed.checkpoint
(and with ft.checkpoint, parameters too) from a dp=2 x tp=2 gloo run (tensor parallel leaves, ZeRO
over dp), for the test to load on another layout."""

import optree
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import functional_train as ft
from functional_train.tree import tree_paths

PLACE = {"wq": [Shard(0)], "wo": [Shard(1)], "b": [Shard(0)], "n": [Replicate()], "e": None}


def optimizers():
    return {
        "adafactor": lambda: ft.adafactor(beta1=0.9),
        "came": lambda: ft.came(1e-2),
        "galore_adamw": lambda: ft.galore_adamw(1e-2, rank=2, update_proj_gap=2),
        "adamw8": lambda: ft.adamw(1e-2, optim_bits=8, min_8bit_size=16, block_size=4),
    }


def problem(steps=3):
    g = torch.Generator().manual_seed(0)
    params = {
        "wq": torch.randn(6, 5, generator=g),
        "wo": torch.randn(5, 7, generator=g),
        "b": torch.randn(7, generator=g),
        "n": torch.randn(5, generator=g),
        "e": torch.randn(9, 4, generator=g),
    }
    grads = [
        {k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(steps)
    ]
    return params, grads


def flat(state):
    """The tensor leaves of a state as a flat dict for torch.distributed.checkpoint."""
    vals = optree.tree_leaves(state, none_is_leaf=True)
    return {p: v for p, v in zip(tree_paths(state), vals) if isinstance(v, torch.Tensor)}


def main(rank, world, out):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fmesh = ft.Mesh(mesh, data_axis="dp")
    params, grads = problem()

    def place(x, k):
        return x.clone() if PLACE[k] is None else distribute_tensor(x, mesh["tp"], PLACE[k])

    for name, make in optimizers().items():
        p = {k: place(v, k) for k, v in params.items()}
        tx = ft.zero_redundancy(make())
        state = tx.init(p)
        for g in grads:  # every replica gets the same gradient: the mean is g
            updates, state = tx.update({k: place(v, k) for k, v in g.items()}, state, p, mesh=fmesh)
            p = ft.apply_updates(p, updates)
        dcp.save(flat(state), checkpoint_id=f"{out}/{name}")
        ft.checkpoint.save(f"{out}/ft-{name}", params=p, state=state, step=len(grads))
