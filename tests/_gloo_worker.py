"""Worker for tests/test_gloo.py: the core transforms on real gloo collectives (4 ranks).

Each rank builds the same reference problem, runs the chain sharded over a dp=2 x tp=2 mesh with
per-replica gradients, and returns the gathered results for the test to compare against the
one-process run.
"""

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import functional_train as ft
from _gloo_common import replica_problem
from functional_train.testing import count_collectives


def problem(steps=4):
    return replica_problem({"w": (5, 3), "b": (7,), "n": (3,)}, steps)


def make_tx():
    return ft.multi_steps(
        ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1)), 2
    )


def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    dp_rank = mesh.get_local_rank("dp")
    params, grads = problem()
    place = {"w": [Shard(0)], "b": [Shard(0)], "n": [Replicate()]}
    dparams = {k: distribute_tensor(v, tp, place[k]) for k, v in params.items()}
    tx = make_tx()
    state = tx.init(dparams)
    fmesh = ft.Mesh(mesh, data_axis="dp")
    counts = []
    for step in grads:
        g = step[dp_rank]
        dg = {
            # this dp replica's contribution, sharded over tp
            "w": distribute_tensor(g["w"], tp, [Shard(0)]),
            # unreduced over tp as well: each tp rank holds half of the replica's value
            "b": DTensor.from_local(g["b"] / 2, tp, [Partial()], run_check=False),
            # a Shard(0) gradient for a Replicate parameter
            "n": distribute_tensor(g["n"], tp, [Shard(0)]),
        }
        with count_collectives() as c:
            updates, state = tx.update(dg, state, dparams, mesh=fmesh)
        counts.append(c.counts)
        assert all(updates[k].placements == dparams[k].placements for k in params), updates
        dparams = ft.apply_updates(dparams, updates)
    full = {k: v.full_tensor() for k, v in dparams.items()}
    return {"params": full, "norm": ft.tree_get(state, "global_norm"), "counts": counts}
