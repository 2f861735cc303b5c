"""Worker for tests/test_gloo.py: every optimizer alias under ZeRO over dp=2 with tp=2, on real
gloo collectives (4 ranks). Returns the gathered parameters and the collective counts."""

import contextlib

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import functional_train as ft
from _gloo_common import replica_problem
from functional_train.testing import count_collectives

PLACE = {"wq": [Shard(0)], "wo": [Shard(1)], "b": [Shard(0)], "n": [Replicate()], "e": None}


def aliases():
    out = {
        "adamw": lambda: ft.adamw(1e-2, weight_decay=0.1),
        "adafactor": lambda: ft.adafactor(beta1=0.9),
        "came": lambda: ft.came(1e-2),
        "lamb": lambda: ft.lamb(1e-2),
    }
    if hasattr(ft, "galore_adamw"):
        out["galore_adamw"] = lambda: ft.galore_adamw(1e-2, rank=2, update_proj_gap=2)
    return out


def problem(steps=3):
    return replica_problem({"wq": (6, 5), "wo": (5, 7), "b": (7,), "n": (5,), "e": (9, 4)}, steps)


def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    dp_rank = mesh.get_local_rank("dp")
    fmesh = ft.Mesh(mesh, data_axis="dp")
    params, grads = problem()

    def place(x, k):  # (a copy: a Replicate DTensor's local would be x, which a donated step
        # writes)
        return x.clone() if PLACE[k] is None else distribute_tensor(x.clone(), tp, PLACE[k])

    def stepped(tx, donate, counter):
        """ft.step over the steps, each inside ``counter()``: (gathered params, counts)."""
        p = {k: place(v, k) for k, v in params.items()}
        state = tx.init(p)
        counts = []
        for step in grads:
            g = {k: place(v, k) for k, v in step[dp_rank].items()}
            with counter() as c:
                p, state = ft.step(tx, g, state, p, mesh=fmesh, donate=donate)
            counts.append(c.counts)
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in p.items()}
        return full, counts

    results = {}
    for name, make in aliases().items():
        p = {k: place(v, k) for k, v in params.items()}
        tx = ft.zero_redundancy(make())
        state = tx.init(p)
        counts = []
        for step in grads:
            g = {k: place(v, k) for k, v in step[dp_rank].items()}  # this replica's gradient
            with count_collectives() as c:
                updates, state = tx.update(g, state, p, mesh=fmesh)
            counts.append(c.counts)
            p = ft.apply_updates(p, updates)
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in p.items()}
        results[name] = {"params": full, "counts": counts}
        # ft.step: the inner's step on the zero view, the new parameter chunks gathered
        for donate in (False, True):
            full, counts = stepped(tx, donate, count_collectives)
            results[f"{name} step donate={donate}"] = {"params": full, "counts": counts}
        # the donated step again, uncounted: eagerly on gloo each all-gather is one broadcast
        # per rank of its group (engine.collectives.all_gather), counted here by wrapping
        # torch.distributed.broadcast
        full, broadcasts = stepped(tx, True, _counting_broadcasts)
        results[f"{name} step eager"] = {"params": full, "broadcasts": broadcasts}
    return results


class _Broadcasts:
    counts = 0


@contextlib.contextmanager
def _counting_broadcasts():
    """Counts the calls of ``torch.distributed.broadcast`` inside the block (``.counts``)."""
    real = dist.broadcast
    n = _Broadcasts()

    def counted(*args, **kwargs):
        n.counts += 1
        return real(*args, **kwargs)

    dist.broadcast = counted
    try:
        yield n
    finally:
        dist.broadcast = real
