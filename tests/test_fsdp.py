"""FSDP-style parameters: every optimizer alias on parameters sharded over the data axis.

FSDP2 / ZeRO-3 parameters are DTensors sharded over the data parallel mesh dim (here on top of
tensor parallel sharding over ``tp``); their gradients arrive reduce-scattered in the same
placements, while plain-tensor leaves (a norm gain) keep per-replica gradients that the first
reducing transform averages over ``data_axis``. Every alias, alone and inside ``multi_steps`` and
``zero_redundancy``, must give the one-process numbers: checked rank by rank, states included, by
``functional_train.testing.assert_sharded_equivalent`` over 3 steps with uneven shards.
"""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import functional_train as ft
from functional_train.testing import assert_sharded_equivalent

S0, S1, R = Shard(0), Shard(1), Replicate()

SHAPES = {"w": (7, 5), "v": (5, 6), "e": (9, 4), "b": (5,), "n": (3,)}
PLACEMENTS = {
    "w": [S0, S1],  # rows over dp (FSDP), columns over tp
    "v": [S1, S0],  # columns over dp, rows over tp
    "e": [S0, R],  # pure FSDP, uneven (9 rows on 2 ranks)
    "b": [S0, R],  # a 1-D FSDP leaf, uneven
    "n": None,  # a plain tensor: per-replica gradients averaged over dp
}

ALIASES = {
    "adamw": lambda: ft.adamw(1e-2, weight_decay=0.1),
    "adafactor": lambda: ft.adafactor(beta1=0.9, weight_decay=0.01),
    "came": lambda: ft.came(1e-2, weight_decay=0.01),
    "lamb": lambda: ft.lamb(1e-2, weight_decay=0.01),
    "galore_adamw": lambda: ft.galore_adamw(1e-2, rank=2, update_proj_gap=2, weight_decay=0.01),
    "clip_sgd": lambda: ft.chain(ft.clip_by_global_norm(0.5), ft.sgd(1e-1, momentum=0.9)),
}


def _problem(steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
    grads = [
        {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in SHAPES.items()}
        for _ in range(steps)
    ]
    return params, grads


@pytest.mark.parametrize("wrap", ["plain", "multi_steps", "zero"])
@pytest.mark.parametrize("name", list(ALIASES))
def test_fsdp_parameters(name, wrap):
    make = ALIASES[name]
    tx = {
        "plain": make,
        "multi_steps": lambda: ft.multi_steps(make(), 1),
        "zero": lambda: ft.zero_redundancy(make(), axis="dp"),
    }[wrap]()
    params, grads = _problem()
    assert_sharded_equivalent(
        tx,
        params,
        grads,
        placements=PLACEMENTS,
        mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"),
        data_axis="dp",
        rtol=1e-9,
        atol=1e-12,
        ignore_state=lambda path: "acc_grads" in path,
    )
