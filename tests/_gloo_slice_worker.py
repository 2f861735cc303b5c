"""Worker for tests/test_gloo.py: a (pp=2, dp=2, tp=2) mesh on 8 gloo ranks, where per-leaf
statistics are completed over two mesh dims (dp x tp, not pp): clip + lamb on each stage's own
leaves, per-replica gradients over dp, a weight matrix sharded over tp."""

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import functional_train as ft
from _gloo_common import replica_problem
from functional_train.engine.collectives import groups_over
from functional_train.testing import count_collectives


def problem(steps=3):
    """Per stage ``s``: params and per-dp-replica gradients of ``w`` (6, 4) and ``b`` (4,)."""
    stages = [replica_problem({"w": (6, 4), "b": (4,)}, steps, seed=s) for s in range(2)]
    params = {f"s{s}": stages[s][0] for s in range(2)}
    grads = [
        [{f"s{s}": stages[s][1][t][r] for s in range(2)} for r in range(2)] for t in range(steps)
    ]
    return params, grads


def make_tx():
    return ft.chain(ft.clip_by_global_norm(1.0), ft.lamb(1e-2, weight_decay=0.1))


def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    tp = mesh["tp"]

    def mine(tree):  # this stage's leaves: w sharded over tp, b a plain tensor
        return {
            "w": distribute_tensor(tree[f"s{pp}"]["w"], tp, [Shard(0)]),
            "b": tree[f"s{pp}"]["b"].clone(),
        }

    params, grads = problem()
    params = mine(params)
    tx = make_tx()
    state = tx.init(params)
    fmesh = ft.Mesh(mesh, data_axis="dp", pipeline_axis="pp")
    counts = []
    for step in grads:
        g = mine(step[dp])  # this dp replica's contribution
        with count_collectives() as c:
            params, state = ft.step(tx, g, state, params, mesh=fmesh)
        counts.append(c.counts)
    stage = {"w": params["w"].full_tensor(), "b": params["b"]}
    every = [None] * 2
    dist.all_gather_object(every, stage, group=mesh.get_group("pp"))
    return {
        "params": {f"s{s}": every[s] for s in range(2)},
        "counts": counts,
        "norm": ft.tree_get(state, "global_norm"),
        "groups": len(groups_over(mesh, [1, 2])),
    }
