"""``assert_sharded_equivalent`` inside a real process group: 4 gloo ranks (CPU), real
collectives, a (2, 2) mesh. It passes for the library's chain (uneven and nested shards, a plain
leaf, ``Partial`` gradients, a data axis) and raises the same AssertionError on every rank for a
clip that computes its norm from the local shard only.

The 4 ranks are the session's (``tests/_ranks.py``); each runs :func:`_job` of this module.
"""

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # starts processes

HERE = Path(__file__).parent


def _buggy_clip(max_norm):
    """The global-norm clip without its all-reduce: the norm of each rank's local shards."""
    import optree
    from torch.distributed.tensor import DTensor

    import functional_train as ft

    def update(updates, state, params=None, *, mesh=None, **extra):
        leaves, treedef = optree.tree_flatten(updates, none_is_leaf=True)
        loc = [x.to_local() if isinstance(x, DTensor) else x for x in leaves]
        norm = torch.stack([x.square().sum() for x in loc]).sum().sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        out = [
            DTensor.from_local(
                local * coef,
                x.device_mesh,
                x.placements,
                run_check=False,
                shape=x.shape,
                stride=x.stride(),
            )
            if isinstance(x, DTensor)
            else local * coef
            for x, local in zip(leaves, loc)
        ]
        return treedef.unflatten(out), state

    return ft.GradientTransformation(lambda p: ft.EmptyState(), update)


def _job(rank, world):
    """A rank's part: both passing checks, then the failing one's message (returned)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    import functional_train as ft
    from functional_train.testing import assert_sharded_equivalent

    gen = torch.Generator().manual_seed(0)  # the same inputs on every rank
    shapes = {"w": (5, 7), "v": (3, 5), "b": (3,), "n": (2,)}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(3)]
    placements = {
        "w": [Shard(0), Shard(1)],
        "v": [Shard(1), Shard(1)],
        "b": [Replicate(), Shard(0)],
        "n": None,
    }
    kw = dict(placements=placements, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
    tx = ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(0.1, weight_decay=0.1))
    assert_sharded_equivalent(tx, params, grads, **kw)
    assert_sharded_equivalent(
        tx,
        params,
        grads,
        data_axis="dp",
        grad_placements={**placements, "b": [Replicate(), Partial()]},
        **kw,
    )
    try:
        assert_sharded_equivalent(_buggy_clip(0.5), params, grads, **kw)
        msg = "no error"
    except AssertionError as e:
        msg = str(e)
    return msg


def test_real_process_group(ranks):
    msgs = ranks.run(4, "test_testing_gloo:_job")
    assert len(set(msgs)) == 1, msgs  # every rank raises the same error
    assert msgs[0].startswith("sharded != unsharded (reported by rank "), msgs[0]
    assert "step 0, updates['b']: max abs error" in msgs[0], msgs[0]
