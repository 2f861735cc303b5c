"""Worker for tests/test_muon.py::test_owners_on_4_gloo_ranks: ``ft.muon`` on a 2 x 2
(dp, tp) mesh of real gloo ranks, 3 steps, in three layouts of its matrices -- tensor parallel
(``Replicate`` over dp), FSDP + tensor parallel (``Shard(0)`` over dp too) and tensor parallel
inside ``zero_redundancy`` over dp -- with Newton-Schulz at owner ranks and, for comparison,
gathered onto every rank (``muon._DISTRIBUTED = False``). Two stacked expert leaves
``(E, d_out, d_in)`` come with them: ``experts``, tensor parallel on ``d_out`` (at owners), and
``routed``, split over both mesh dims on its expert axis only (each rank orthogonalises its own
expert, in every layout and scheme).

Per layout and scheme every rank returns the full parameters after 3 steps and, from every rank, the
first update's collectives and their input bytes, the Newton-Schulz multiply-adds the rank ran
(``newton_schulz`` patched to count them) and the bytes of its local Muon-managed parameters.
"""

import importlib
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import functional_train as ft
from functional_train.testing import count_collectives

fm = importlib.import_module("functional_train.muon")  # (ft.muon is the function)


# two layers: tensor parallel Shard(0) for wq / wk / wv / w1 / w3, Shard(1) for wo / w2;
# odd sizes, so shards are uneven
LAYER = {
    "wq": (25, 16),
    "wk": (25, 16),
    "wv": (25, 16),
    "wo": (16, 25),
    "w1": (41, 16),
    "w3": (41, 16),
    "w2": (16, 41),
}
SHAPES = {f"l{i}.{k}": s for i in range(2) for k, s in LAYER.items()}
SHAPES["experts"] = (2, 16, 25)
SHAPES["routed"] = (4, 25, 16)  # one expert per rank
SHAPES["norm"] = (16,)
STEPS = 3
LAYOUTS = ("tp", "fsdp+tp", "zero+tp")


def problem():
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=g) for k, s in SHAPES.items()} for _ in range(STEPS)]
    return params, grads


def make_tx(layout=None):
    tx = ft.muon(2e-2, weight_decay=0.1)
    return ft.zero_redundancy(tx, axis="dp") if layout == "zero+tp" else tx


def placements(name, layout):
    if name == "norm":
        return [Replicate(), Replicate()]
    if name == "routed":
        return [Shard(0), Shard(0)]
    tp = Shard(1) if name.endswith(("wo", "w2", "experts")) else Shard(0)
    return [Shard(0) if layout == "fsdp+tp" else Replicate(), tp]


def ns_cost(shape):
    """Newton-Schulz multiply-adds per iteration of a leaf's matrices (the last two axes)."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * (2 * m * m * n + m * m * m)


def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flops = [0]
    real_ns = fm.newton_schulz

    def counting_ns(x, *args, **kwargs):
        flops[0] += ns_cost(tuple(x.shape))
        return real_ns(x, *args, **kwargs)

    distributed = fm._DISTRIBUTED
    fm.newton_schulz = counting_ns
    try:
        return _runs(mesh, world, flops)
    finally:  # the ranks run other jobs after this one
        fm.newton_schulz, fm._DISTRIBUTED = real_ns, distributed


def _runs(mesh, world, flops):
    result = {}
    for layout in LAYOUTS:
        for scheme in ("owners", "gather"):
            fm._DISTRIBUTED = scheme == "owners"
            params0, grads = problem()
            params = {
                k: distribute_tensor(v, mesh, placements(k, layout)) for k, v in params0.items()
            }
            tx = make_tx(layout)
            state = tx.init(params)
            m = ft.Mesh(mesh, data_axis="dp") if layout == "zero+tp" else ft.Mesh(mesh)
            for step, g in enumerate(grads):
                g = {k: distribute_tensor(v, mesh, placements(k, layout)) for k, v in g.items()}
                flops[0] = 0
                with count_collectives() as c:
                    params, state = ft.step(tx, g, state, params, mesh=m)
                if step == 0:
                    stats = dict(
                        counts=c.counts,
                        bytes=c.bytes,
                        flops=flops[0],
                        share=sum(
                            v.to_local().numel() * 4 for k, v in params.items() if k != "norm"
                        ),
                    )
            every = [None] * world
            dist.all_gather_object(every, stats)
            full = {k: v.full_tensor() for k, v in params.items()}
            result[(layout, scheme)] = dict(params=full, ranks=every)
    return result
