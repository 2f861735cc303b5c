"""Worker for tests/test_foreign.py: transforms written without the engine (optax-style
``tree_map``s that know nothing of meshes) inside the combinators, on real gloo collectives.

4 ranks, ``dp=2 x tp=2``: a tensor parallel leaf (``Shard(0)`` over ``tp``), a ``Partial`` over
``tp`` gradient of a replicated bias, and a plain-tensor leaf, with per-replica gradients over
``dp``; ``tp`` and ``dp`` replicas are compared on rank 0 (every rank gathers its full params).
"""

import optree
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import functional_train as ft
from _gloo_common import replica_problem


def foreign_sign() -> ft.GradientTransformation:
    """A transform as a user writes it from optax's docs: ``tree_map`` of a nonlinear function
    (the sign of the mean gradient is not the mean of the signs)."""

    def init_fn(params):
        return ft.EmptyState()

    def update_fn(updates, state, params=None, **extra):
        return optree.tree_map(
            lambda g: None if g is None else torch.sign(g), updates, none_is_leaf=True
        ), state

    return ft.GradientTransformation(init_fn, update_fn)


def foreign_scale(s) -> ft.GradientTransformation:
    def init_fn(params):
        return ft.EmptyState()

    def update_fn(updates, state, params=None, **extra):
        return optree.tree_map(
            lambda g: None if g is None else g * s, updates, none_is_leaf=True
        ), state

    return ft.GradientTransformation(init_fn, update_fn)


def compositions():
    """name -> builder of a transform with a foreign piece in each combinator."""
    return {
        "chain_scale_sgd": lambda: ft.chain(foreign_scale(0.5), ft.sgd(1.0)),
        "chain_sign_sgd": lambda: ft.chain(foreign_sign(), ft.sgd(0.1)),
        "chain_clip_sign_adam": lambda: ft.chain(
            ft.clip_by_global_norm(1.0), foreign_sign(), ft.adam(1e-2)
        ),
        "named_chain": lambda: ft.named_chain(("sign", foreign_sign()), ("sgd", ft.sgd(0.1))),
        "multi_steps": lambda: ft.multi_steps(ft.chain(foreign_sign(), ft.sgd(0.1)), 2),
        "multi_steps_foreign_inner": lambda: ft.multi_steps(foreign_sign(), 2),
        "partition": lambda: ft.partition(
            {"a": ft.chain(foreign_sign(), ft.sgd(0.1)), "b": ft.adamw(1e-2)},
            {"w": "a", "b": "b", "p": "a"},
        ),
        "masked": lambda: ft.chain(
            ft.masked(foreign_sign(), {"w": True, "b": False, "p": True}), ft.sgd(0.1)
        ),
        "zero_redundancy": lambda: ft.zero_redundancy(
            ft.chain(foreign_sign(), ft.adam(1e-2)), "dp"
        ),
    }


def problem(steps=4):
    return replica_problem({"w": (6, 3), "b": (5,), "p": (4,)}, steps)


def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    dp_rank = mesh.get_local_rank("dp")
    params0, grads = problem()
    place = {"w": [Shard(0)], "b": [Replicate()]}
    fmesh = ft.Mesh(mesh, data_axis="dp")
    results = {}
    for name, make in compositions().items():
        params = {
            k: distribute_tensor(v, tp, place[k]) if k in place else v.clone()
            for k, v in params0.items()
        }
        tx = make()
        state = tx.init(params)
        for step in grads:
            g = step[dp_rank]
            dg = {
                "w": distribute_tensor(g["w"], tp, [Shard(0)]),
                # each tp rank holds half of this replica's value, unreduced
                "b": DTensor.from_local(g["b"] / 2, tp, [Partial()], run_check=False),
                "p": g["p"],
            }
            updates, state = tx.update(dg, state, params, mesh=fmesh)
            params = ft.apply_updates(params, updates)
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in params.items()}
        every = [None] * world
        dist.all_gather_object(every, full)
        results[name] = every
    return results
