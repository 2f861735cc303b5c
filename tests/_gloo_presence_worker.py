"""Worker for tests/test_unusual_input.py: gradients that are ``None`` on some data-parallel
ranks only (a parameter unused on a rank's micro-batch, as DDP's ``find_unused_parameters``
meets it), on real gloo ranks.

2 ranks, ``dp=2``, plain tensors. Leaf ``b`` has no gradient on rank 1 at step 0 and on rank 0
at step 2, leaf ``c`` has none anywhere (frozen); rank ``r``'s gradient otherwise is the
problem's replica ``r``. Every rank records its params after each transform and returns all
ranks' results (gathered) so the test compares them with a one-process run in which an absent
gradient counts as zero in the mean.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import functional_train as ft
from _gloo_common import replica_problem

SHAPES = {"a": (4, 3), "b": (5,), "c": (2, 2)}
ABSENT = {(0, 1), (2, 0)}  # (step, rank) where b has no gradient


def problem():
    return replica_problem(SHAPES, steps=4, replicas=2, seed=3)


def grads_of(step_grads, step, rank):
    g = dict(step_grads[rank])
    g["c"] = None
    if (step, rank) in ABSENT:
        g["b"] = None
    return g


def transforms():
    return {
        "chain_clip_adamw": lambda: ft.chain(
            ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1)
        ),
        "sgd_momentum": lambda: ft.sgd(0.1, momentum=0.9),
        "multi_steps": lambda: ft.multi_steps(ft.adamw(1e-2), 2),
    }


def main(rank, world):
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    mesh = ft.Mesh(dm, data_axis="dp")
    params0, grads = problem()
    result = {}
    runs = [(name, "update", make) for name, make in transforms().items()]
    runs += [
        ("chain_clip_adamw", "step", transforms()["chain_clip_adamw"]),
        ("zero_adamw", "update", lambda: ft.zero_redundancy(ft.adamw(1e-2), "dp", device_mesh=dm)),
    ]
    for name, how, make in runs:
        tx = make()
        params = {k: v.clone() for k, v in params0.items()}
        state = tx.init(params)
        for step, sg in enumerate(grads):
            g = grads_of(sg, step, rank)
            if how == "step":
                params, state = ft.step(tx, g, state, params, mesh=mesh)
            else:
                u, state = tx.update(g, state, params, mesh=mesh)
                params = ft.apply_updates(params, u)
        flat = torch.cat([params[k].reshape(-1) for k in SHAPES])
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        result[f"{name}/{how}"] = [
            dict(zip(SHAPES, torch.split(e, [torch.Size(s).numel() for s in SHAPES.values()])))
            for e in every
        ]
    return result
