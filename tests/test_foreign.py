"""Transforms written without the engine compose correctly (issue: foreign transforms).

An optax-style transform (a ``tree_map`` over the updates) knows nothing of data axes or
``Partial`` placements. The combinators reduce unreduced gradients before any transform that has
not declared it accepts them (``functional_train.sharding.declare``), so it sees the values it
would see in one process, and every replica gets the same, right, result.
"""

import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import functional_train as ft
from functional_train.testing import assert_sharded_equivalent

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _gloo_foreign_worker as fw  # noqa: E402


def _one_process(make, params, grads):
    tx = make()
    state = tx.init(params)
    for step in grads:
        g = {k: (step[0][k] + step[1][k]) / 2 for k in params}  # the data-parallel mean
        u, state = tx.update(g, state, params)
        params = ft.apply_updates(params, u)
    return params


def test_issue_example_replicas_agree_on_the_mean():
    """The issue's reproduction, simulated: ``chain(tree_map scale 0.5, sgd(1.0))`` under
    ``data_axis="dp"`` at dp=2 x tp=2 on replica gradients 1 and 2 gives -0.75 everywhere."""
    params = {"w": torch.zeros(4, 2)}
    grads = [{"w": torch.full((4, 2), 1.5)}]  # the harness spreads it as 1.5 +- d per replica
    assert_sharded_equivalent(
        fw.compositions()["chain_scale_sgd"](),
        params,
        grads,
        placements={"w": None},
        mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"),
        data_axis="dp",
    )


@pytest.mark.parametrize("name", list(fw.compositions()))
def test_simulated(name):
    """Every composition on a simulated dp=2 x tp=2 mesh: plain, tensor parallel and Partial
    gradients, per-replica contributions over dp; sharded == unsharded, states included."""
    params, grads = fw.problem(2)
    mean = [{k: (s[0][k] + s[1][k]) / 2 for k in params} for s in grads]
    ignore = (lambda p: "acc_grads" in p) if name.startswith("multi_steps") else None
    assert_sharded_equivalent(
        fw.compositions()[name](),
        params,
        mean,
        placements={"w": [Replicate(), Shard(0)], "b": [Replicate(), Replicate()], "p": None},
        grad_placements={"w": [Replicate(), Shard(0)], "b": [Replicate(), Partial()], "p": None},
        mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"),
        data_axis="dp",
        ignore_state=ignore,
    )


def test_undeclared_transform_gets_reduced_gradients_not_partial():
    """What the foreign transform receives: DTensors in the parameter's placements (no
    ``Partial``) and, under a data axis, the mean."""
    seen = []

    def init_fn(params):
        return ft.EmptyState()

    def update_fn(updates, state, params=None, **extra):
        seen.append(updates)
        return updates, state

    spy = ft.GradientTransformation(init_fn, update_fn)
    params, grads = fw.problem(1)
    mean = [{k: (s[0][k] + s[1][k]) / 2 for k in params} for s in grads]
    assert_sharded_equivalent(
        ft.chain(spy, ft.sgd(0.1)),
        params,
        mean,
        placements={"w": [Replicate(), Shard(0)], "b": [Replicate(), Replicate()], "p": None},
        grad_placements={"w": [Replicate(), Shard(0)], "b": [Replicate(), Partial()], "p": None},
        mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"),
        data_axis="dp",
    )
    sharded = seen[-1]
    assert sharded["b"].placements == (Replicate(), Replicate()), sharded["b"].placements
    assert sharded["w"].placements == (Replicate(), Shard(0)), sharded["w"].placements


@pytest.mark.slow
def test_gloo_replicas_agree(ranks):
    """Real gloo ranks (dp=2 x tp=2): each composition equals the one-process run on the mean
    gradients, on every rank (tp and dp replicas agree)."""
    res = ranks.run(4, "_gloo_foreign_worker:main")[0]
    params0, grads = fw.problem()
    for name, make in fw.compositions().items():
        want = _one_process(make, dict(params0), grads)
        for rank, got in enumerate(res[name]):
            for k in params0:
                torch.testing.assert_close(
                    got[k],
                    want[k],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m: f"{name}, rank {rank}, {k}: {m}",
                )
