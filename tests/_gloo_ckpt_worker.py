"""Worker for tests/test_checkpoint.py: optimizer states saved with torch.distributed.checkpoint
(and with ft.checkpoint, parameters too) from a dp=2 x tp=2 gloo run (tensor parallel leaves, ZeRO
over dp), for the test to load on another layout; and ft.checkpoint.load on every rank while the
checkpoint is replaced, with an error on one rank only, and with a damaged file."""

import os

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

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


def _filled(mesh, value):
    """Parameters (one sharded over the ranks, one plain) and adamw's state, every value
    ``value``."""
    params = {
        "w": distribute_tensor(torch.full((8, 3), float(value)), mesh, [Shard(0)]),
        "n": torch.full((5,), float(value)),
    }
    state = ft.adamw(1e-2, weight_decay=0.1).init(params)
    return params, optree.tree_map(lambda x: torch.full_like(x, value), state)


def _local_values(tree) -> list:
    return sorted(
        {
            float(v)
            for x in optree.tree_leaves(tree)
            for v in (x.to_local() if isinstance(x, DTensor) else x).flatten().tolist()
        }
    )


def _outcome(load) -> str:
    try:
        load()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def replaced_while_loading(rank, world, out):
    """1. Rank 0 renames another checkpoint into place (a save's two renames) after every rank
    read the manifest and before DCP reads the tensors: every rank starts again and loads the
    new checkpoint whole. 2. Templates that do not match on rank 1 only: rank 1 raises its
    ValueError, the others a RuntimeError naming it (none waits in DCP's collectives). 3. A
    truncated data file: every rank raises CheckpointError naming it."""
    mesh = init_device_mesh("cpu", (world,))
    ck = f"{out}/ck"
    ft.checkpoint.save(ck, params=_filled(mesh, 1)[0], state=_filled(mesh, 1)[1], step=1)
    ft.checkpoint.save(f"{out}/next", params=_filled(mesh, 2)[0], state=_filled(mesh, 2)[1], step=2)
    real, calls = ft.checkpoint.dcp.load, []

    def swapped_first(state_dict, **kw):
        calls.append(kw["checkpoint_id"])
        if rank == 0 and len(calls) == 1:
            os.rename(ck, f"{ck}.old-swapped")
            os.rename(f"{out}/next", ck)
        return real(state_dict, **kw)

    ft.checkpoint.dcp.load = swapped_first
    try:
        p, s, step, _ = ft.checkpoint.load(ck, *_filled(mesh, -1))
    finally:
        ft.checkpoint.dcp.load = real
    results = {"step": step, "values": _local_values((p, s)), "dcp_loads": len(calls)}

    params, state = _filled(mesh, -1)
    if rank == 1:
        params["extra"] = torch.zeros(2)
    results["one_rank_mismatch"] = _outcome(lambda: ft.checkpoint.load(ck, params, state))

    if rank == 0:
        path = f"{ck}/__1_0.distcp"
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 1)
    dist.barrier()
    results["truncated"] = _outcome(lambda: ft.checkpoint.load(ck, *_filled(mesh, -1)))
    return results
