"""Worker for tests/test_torch_optimizer_dist.py: ``ft.TorchOptimizer`` on the DTensor
parameters of a 2-rank gloo run, FSDP2 (``fully_shard``) and tensor parallel
(``parallelize_module``), with torch.distributed.checkpoint's ``get_optimizer_state_dict`` and
``dcp.save``; the FSDP2 checkpoint is also loaded back on the 2 ranks.

Returns, per layout: the full parameters at the start, after ``STEPS`` and after ``STEPS + MORE``
steps (and, for FSDP2, after reloading at ``STEPS`` and ``MORE`` steps more, and a
``full_state_dict=True`` get / set round trip), the optimizer state dict's keys, and what a
``get_optimizer_state_dict`` on a fresh optimizer left behind.
The checkpoints are ``<dir of out>/ckpt_<layout>``.
"""

import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import functional_train as ft
from functional_train.tree import tree_flatten

sys.path.insert(0, os.path.dirname(__file__))

STEPS, MORE = 3, 2
LAYOUTS = ("fsdp", "tp")


HIDDEN = {"fsdp": 15, "tp": 16}


def model(layout: str, seed: int = 0) -> torch.nn.Module:
    """FSDP2: 15 hidden units, uneven shards on 2 ranks (8 + 7 rows). Tensor parallel: 16
    (``RowwiseParallel`` rebuilds its input DTensor from the local shards assuming even ones:
    with 15 the rank-0 shard of 8 columns reads as a global 16)."""
    torch.manual_seed(seed)
    h = HIDDEN[layout]
    return torch.nn.Sequential(torch.nn.Linear(8, h), torch.nn.Tanh(), torch.nn.Linear(h, 5))


def make_tx():
    return ft.adamw(1e-2, weight_decay=0.1)


def batches(n: int = STEPS + MORE, seed: int = 1) -> list:
    """Global batches (FSDP2: rank r takes half r; tensor parallel: every rank all of it)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(12, 8, generator=gen), torch.randn(12, 5, generator=gen)) for _ in range(n)
    ]


def train(m, opt, data, rank=0, world=1, split=False) -> None:
    for x, y in data:
        if split:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()


def full(m) -> dict:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in m.named_parameters()
    }


def build(layout: str, mesh):
    m = model(layout)
    if layout == "fsdp":
        fully_shard(m[0], mesh=mesh)
        fully_shard(m[2], mesh=mesh)
        fully_shard(m, mesh=mesh)
    else:
        parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return m, ft.TorchOptimizer(m.named_parameters(), make_tx())


def main(rank, world, ckpt):
    mesh = init_device_mesh("cpu", (world,))
    data = batches()
    result = {}
    for layout in LAYOUTS:
        split = layout == "fsdp"
        m, opt = build(layout, mesh)
        r = result[layout] = {"start": full(m)}
        assert all(isinstance(p, DTensor) for p in m.parameters())
        # torch's state-dict helpers on a fresh optimizer: no zero-gradient "init" step
        fresh = get_optimizer_state_dict(m, opt)
        r["fresh"] = {
            "count": int(opt.ft_state.count),
            "grads": [p.grad is None for p in m.parameters()],
            "same": all(torch.equal(a, b) for a, b in zip(full(m).values(), r["start"].values())),
            "keys": sorted(fresh["state"]),
        }
        train(m, opt, data[:STEPS], rank, world, split)
        r["steps"] = full(m)
        osd = get_optimizer_state_dict(m, opt)
        r["state_keys"] = {k: sorted(v) for k, v in osd["state"].items()}
        r["params"] = list(osd["param_groups"][0]["params"])
        r["mu_placements"] = {k: str(v["exp_avg"].placements) for k, v in osd["state"].items()}
        dcp.save(
            {"model": get_model_state_dict(m), "optim": osd},
            checkpoint_id=os.path.join(ckpt, f"ckpt_{layout}"),
        )
        train(m, opt, data[STEPS:], rank, world, split)
        r["more"] = full(m)
        if layout == "fsdp":  # the 2-rank checkpoint back on 2 ranks
            m2, opt2 = build(layout, mesh)
            sd = {"model": get_model_state_dict(m2), "optim": get_optimizer_state_dict(m2, opt2)}
            dcp.load(sd, checkpoint_id=os.path.join(ckpt, f"ckpt_{layout}"))
            set_model_state_dict(m2, sd["model"])
            set_optimizer_state_dict(m2, opt2, optim_state_dict=sd["optim"])
            r["reloaded_count"] = int(opt2.ft_state.count)
            train(m2, opt2, data[STEPS:], rank, world, split)
            r["reloaded_more"] = full(m2)
            # full (unsharded) state dicts: gathered, then scattered into a fresh optimizer
            opts = StateDictOptions(full_state_dict=True)
            whole = get_optimizer_state_dict(m2, opt2, options=opts)
            r["full_mu"] = whole["state"]["0.weight"]["exp_avg"]
            opt3 = ft.TorchOptimizer(m2.named_parameters(), make_tx())
            set_optimizer_state_dict(m2, opt3, optim_state_dict=whole, options=opts)
            r["full_round_trip"] = all(
                torch.equal(a.to_local(), b.to_local())
                if isinstance(a, DTensor)
                else torch.equal(a, b)
                for a, b in zip(tree_flatten(opt2.ft_state)[0], tree_flatten(opt3.ft_state)[0])
            )
    return result
