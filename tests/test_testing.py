"""The public property-testing toolkit, ``functional_train.testing``.

* ``assert_sharded_equivalent`` passes for the library's transforms (adamw, clip_by_global_norm,
  adafactor) on 1-D and 2-D simulated meshes with uneven, nested and empty shards, plain leaves,
  frozen leaves, ``Partial`` gradients and a data axis;
* it FAILS, naming the step and the leaf path, for wrong transforms: a global-norm clip that
  computes its norm from the local shard only, one that reduces over only one of two mesh dims,
  state bugs, in-place mutation of inputs, updates in the wrong placements;
* the hypothesis strategies draw valid meshes and placements (checked against torch's own
  ``distribute_tensor``), ``None`` leaves appear, and the gradient rank is controlled (a
  factored-statistics bug that rank-1 gradients hide is found with full-rank ones);
* ``functional_train.testing`` imports without hypothesis.

All in one process: the sharded runs are simulated (``LocalTensorMode``).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from hypothesis import Phase, event, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import functional_train as ft
from functional_train.testing import (
    assert_sharded_equivalent,
    gather,
    gradients,
    gradients_like,
    leaf_placements,
    mesh_shapes,
    on_rank,
    placements,
    pytrees,
    replicated,
    shapes,
    sharded_cases,
    simulate,
    tensors,
    tree_placements,
)

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
# find() an example without shrinking it (drawing tensors over and over is slow)
NO_SHRINK = settings(max_examples=300, phases=[Phase.generate], database=None, derandomize=True)


def _tree(seed, spec):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen) for k, (shape, _) in spec.items()}


def _problem(spec, steps=3, seed=0):
    params = _tree(seed, spec)
    grads = [_tree(seed + 1 + t, spec) for t in range(steps)]
    pls = {k: pl for k, (_, pl) in spec.items()}
    return params, grads, pls


# uneven everywhere: 5 and 7 over 2 or 3 ranks, (2,) over 3 ranks leaves one rank empty
LAYOUT_1D = {  # mesh (3,)
    "w": ((5, 7), [S0]),
    "v": ((4, 5), [S1]),
    "b": ((2,), [S0]),  # empty shard on rank 2
    "e": ((2, 3, 5), [Shard(-1)]),
    "r": ((3, 2), [R]),
    "s": ((), None),  # 0-dim plain
}
LAYOUT_2D = {  # mesh (2, 2)
    "w": ((5, 7), [S0, S1]),
    "v": ((3, 5), [S1, S1]),  # nested: the columns split over both mesh dims
    "b": ((3,), [S0, R]),
    "e": ((2, 3, 5), [S2, S0]),
    "h": ((1, 4), [S0, S0]),  # empty row shards
    "p": ((2, 2), None),  # plain
}
REAL_TXS = {
    "adamw": lambda: ft.adamw(0.1, weight_decay=0.1),
    "clip_by_global_norm": lambda: ft.clip_by_global_norm(0.5),
    "clip+adamw": lambda: ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(0.1)),
    "adafactor": lambda: ft.adafactor(beta1=0.9, weight_decay=0.1),
}


# =============================================================================================
# the harness passes for the library's transforms
# =============================================================================================
@pytest.mark.parametrize("name", list(REAL_TXS))
@pytest.mark.parametrize(
    "mesh_shape,layout", [((3,), LAYOUT_1D), ((2, 2), LAYOUT_2D)], ids=["mesh3", "mesh2x2"]
)
def test_real_transforms_pass(name, mesh_shape, layout):
    params, grads, pls = _problem(layout)
    assert_sharded_equivalent(
        REAL_TXS[name](), params, grads, placements=pls, mesh_shape=mesh_shape
    )


def test_frozen_leaves_implicit_mesh_and_callable_placements():
    params, grads, _ = _problem(LAYOUT_2D, steps=2)
    for g in grads:
        g["v"] = None  # frozen
    pls = lambda path, x: None if x.ndim == 0 else [S0, R] if x.ndim == 1 else [S1, S0]  # noqa: E731
    assert_sharded_equivalent(
        ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(0.1)),
        params,
        grads,
        placements=pls,
        mesh_shape=(2, 2),
        explicit_mesh=False,
    )


def test_partial_gradients_and_data_axis():
    """``Partial`` gradient placements and per-replica contributions over a data axis: the
    harness generates contributions that reduce to the given gradients."""
    params, grads, _ = _problem({"w": ((5, 3), None), "b": ((7,), None), "n": ((3,), None)})
    pls = {"w": [R, S0], "b": [R, S0], "n": None}
    gpls = {"w": [R, S0], "b": [Partial(), Partial("avg")], "n": None}
    tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), every_k=2)
    assert_sharded_equivalent(
        tx,
        params,
        grads + grads[:1],
        placements=pls,
        grad_placements=gpls,
        mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"),
        data_axis="dp",
        ignore_state=lambda path: "acc_grads" in path,
    )


def test_shard_grad_for_replicated_param():
    params, grads, _ = _problem({"b": ((5,), None)})
    assert_sharded_equivalent(
        ft.adamw(0.1),
        params,
        grads,
        placements={"b": [R]},
        grad_placements={"b": [S0]},
        mesh_shape=(4,),
    )


# =============================================================================================
# the harness catches wrong transforms
# =============================================================================================
def _leaves(tree):
    import optree

    return optree.tree_flatten(tree, none_is_leaf=True)


def _rewrap(local, like):
    """``local`` as a DTensor in ``like``'s layout (a plain tensor for a plain ``like``)."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def buggy_clip_by_global_norm(max_norm, reduce_over=None):
    """``clip_by_global_norm`` done wrong: the norm is computed from each rank's local shards,
    with no all-reduce at all (``reduce_over=None``), or all-reduced over the mesh dims in
    ``reduce_over`` only."""

    def init(params):
        return ft.EmptyState()

    def update(updates, state, params=None, *, mesh=None, **extra):
        leaves, treedef = _leaves(updates)
        locs = [_local(g) for g in leaves if g is not None]
        sq = torch.stack([x.square().sum() for x in locs]).sum()
        dm = next((g.device_mesh for g in leaves if isinstance(g, DTensor)), None)
        if reduce_over is not None and dm is not None:
            for d in reduce_over:
                sq = funcol.wait_tensor(funcol.all_reduce(sq, "sum", (dm, d)))
        coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
        out = [None if g is None else _rewrap(_local(g) * coef, g) for g in leaves]
        return treedef.unflatten(out), state

    return ft.GradientTransformation(init, update)


def test_catches_norm_from_the_local_shard():
    params, grads, pls = _problem(LAYOUT_2D)
    with pytest.raises(AssertionError) as info:
        assert_sharded_equivalent(
            buggy_clip_by_global_norm(0.5), params, grads, placements=pls, mesh_shape=(2, 2)
        )
    msg = str(info.value)
    # optree orders dict keys: 'b' is the first leaf
    assert msg.startswith("sharded != unsharded: step 0, updates['b']: max abs error "), msg
    assert "placements [Shard(0), Replicate()] on mesh (2, 2)" in msg, msg
    assert re.search(r"at index \(\d+,\) on rank \d \(mesh coordinate \(\d, \d\)\)", msg), msg
    # the correct transform passes on the same problem
    assert_sharded_equivalent(
        ft.clip_by_global_norm(0.5), params, grads, placements=pls, mesh_shape=(2, 2)
    )


def test_catches_norm_from_the_local_shard_on_1d_mesh_and_plain_leaves():
    params, grads, pls = _problem(LAYOUT_1D)
    with pytest.raises(AssertionError, match=r"step 0, updates\['b'\]: max abs error"):
        assert_sharded_equivalent(
            buggy_clip_by_global_norm(0.5), params, grads, placements=pls, mesh_shape=(3,)
        )


def test_catches_a_reduction_over_one_of_two_mesh_dims():
    """Reducing over mesh dim 0 only: right on a 1-D mesh (where that is the whole mesh) when
    every leaf is sharded, wrong on a 2-D mesh that shards the leaves over both dims."""
    spec = {"w": ((5, 7), [S0, S1]), "v": ((6, 3), [S1, S0])}
    params, grads, pls = _problem(spec)
    tx = buggy_clip_by_global_norm(0.5, reduce_over=(0,))
    with pytest.raises(AssertionError) as info:
        assert_sharded_equivalent(tx, params, grads, placements=pls, mesh_shape=(2, 2))
    msg = str(info.value)
    assert "step 0, updates['v']" in msg and "mesh (2, 2)" in msg, msg
    # the same transform passes on a 1-D mesh: the bug needs a 2-D mesh to show
    assert_sharded_equivalent(tx, params, grads, placements={"w": [S0], "v": [S1]}, mesh_shape=(4,))
    # reducing over both dims is right
    assert_sharded_equivalent(
        buggy_clip_by_global_norm(0.5, reduce_over=(0, 1)),
        params,
        grads,
        placements=pls,
        mesh_shape=(2, 2),
    )


class SquaredNormState(NamedTuple):
    sq_norm: torch.Tensor  # a plain scalar: must be the same global value on every rank
    total: dict  # params-shaped running sums of the gradients (DTensors)


def running_sum(local_norm_bug=False, layout_bug=False):
    """Identity updates; the state keeps the squared gradient norm and running gradient sums.
    Bugs: the norm from the local shard only (a plain state leaf that differs per rank), or the
    running sums stored as local shards rewrapped as replicated DTensors (wrong layout)."""

    def init(params):
        zeros = {k: torch.zeros_like(v) for k, v in params.items()}
        return SquaredNormState(torch.zeros(()), zeros)

    def update(updates, state, params=None, *, mesh=None, **extra):
        if local_norm_bug:
            sq = sum(_local(g).square().sum() for g in updates.values())
        else:
            sq = ft.global_norm(updates, mesh=mesh).square()
        total = {}
        for k, g in updates.items():
            s = _local(state.total[k]) + _local(g)
            if layout_bug and isinstance(g, DTensor):
                total[k] = DTensor.from_local(
                    s, g.device_mesh, [R] * g.device_mesh.ndim, run_check=False
                )
            else:
                total[k] = _rewrap(s, g)
        return updates, SquaredNormState(sq, total)

    return ft.GradientTransformation(init, update)


def test_catches_state_bugs():
    params, grads, pls = _problem({"w": ((5, 7), [S0, S1]), "b": ((3,), [R, S0])})
    assert_sharded_equivalent(
        running_sum(), params, grads, placements=pls, mesh_shape=(2, 2), rtol=1e-4
    )
    with pytest.raises(AssertionError) as info:
        assert_sharded_equivalent(
            running_sum(local_norm_bug=True),
            params,
            grads,
            placements=pls,
            mesh_shape=(2, 2),
            rtol=1e-4,
        )
    msg = str(info.value)
    assert "step 0, state['sq_norm']" in msg, msg
    assert "a plain tensor on mesh (2, 2): every rank must hold the unsharded value" in msg, msg
    with pytest.raises(
        AssertionError,
        match=r"step 0, state\['total.b'\]: global shape "
        r"\(per-rank \{0: 2, 1: 1, 2: 2, 3: 1\},\), "
        r"unsharded \(3,\)",
    ):
        assert_sharded_equivalent(
            running_sum(layout_bug=True),
            params,
            grads,
            placements=pls,
            mesh_shape=(2, 2),
            rtol=1e-4,
        )
    # compare_state=False looks at updates and params only
    assert_sharded_equivalent(
        running_sum(local_norm_bug=True),
        params,
        grads,
        placements=pls,
        mesh_shape=(2, 2),
        compare_state=False,
    )


def test_catches_in_place_mutation_and_wrong_placements():
    params, grads, pls = _problem({"w": ((5, 3), [S0])})

    def scales_its_input():
        def update(updates, state, params=None, *, mesh=None, **extra):
            for g in updates.values():
                _local(g).mul_(0.5)  # modifies the caller's gradients
            return updates, state

        return ft.GradientTransformation(lambda p: ft.EmptyState(), update)

    with pytest.raises(AssertionError, match=r"step 0, grads\['w'\] was modified in place"):
        assert_sharded_equivalent(
            scales_its_input(), params, grads, placements=pls, mesh_shape=(2,)
        )

    def replicates():
        def update(updates, state, params=None, *, mesh=None, **extra):
            return {
                k: g.redistribute(g.device_mesh, [R]) if isinstance(g, DTensor) else g
                for k, g in updates.items()
            }, state

        return ft.GradientTransformation(lambda p: ft.EmptyState(), update)

    with pytest.raises(
        AssertionError,
        match=r"step 0, updates\['w'\]: the sharded update has "
        r"placements \[Replicate\(\)\], its parameter "
        r"\[Shard\(0\)\]",
    ):
        assert_sharded_equivalent(replicates(), params, grads, placements=pls, mesh_shape=(2,))
    assert_sharded_equivalent(
        replicates(), params, grads, placements=pls, mesh_shape=(2,), check_placements=False
    )


def test_transform_errors_carry_a_note():
    params, grads, pls = _problem({"w": ((4,), [S0])})

    def fails_sharded():
        def update(updates, state, params=None, *, mesh=None, **extra):
            if isinstance(updates["w"], DTensor):
                raise RuntimeError("boom")
            return updates, state

        return ft.GradientTransformation(lambda p: ft.EmptyState(), update)

    with pytest.raises(RuntimeError, match="boom") as info:
        assert_sharded_equivalent(fails_sharded(), params, grads, placements=pls, mesh_shape=(2,))
    assert "raised by the sharded run at step 0" in "".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(placements={"w": [S0, S1]}, mesh_shape=(2,)), ValueError, "has 2 placements"),
        (dict(placements={"w": [S2]}, mesh_shape=(2,)), ValueError, r"Shard\(2\).*shape \(4, 3\)"),
        (dict(placements={"x": [S0]}, mesh_shape=(2,)), ValueError, "structure of params"),
        (dict(placements={"w": [Partial()]}, mesh_shape=(2,)), ValueError, "only grad_placements"),
        (dict(placements={"w": [S0]}), ValueError, "mesh_shape is required"),
        (dict(placements={"w": [S0]}, mesh_shape=(2,), data_axis="dp"), ValueError, "data_axis"),
        (dict(placements={"w": ["S0"]}, mesh_shape=(2,)), TypeError, "sequence of placements"),
        (dict(placements={"w": [S0], "b": None}, mesh_shape=(2,)), ValueError, "extra key"),
    ],
)
def test_bad_arguments(kwargs, err, match):
    params, grads, _ = _problem({"w": ((4, 3), None)}, steps=1)
    with pytest.raises(err, match=match):
        assert_sharded_equivalent(ft.sgd(0.1), params, grads, **kwargs)


def test_not_inside_simulate():
    params, grads, pls = _problem({"w": ((4, 3), [S0])}, steps=1)
    with simulate(2):
        with pytest.raises(RuntimeError, match="outside simulate"):
            assert_sharded_equivalent(ft.sgd(0.1), params, grads, placements=pls, mesh_shape=(2,))


def test_freed_sub_meshes_do_not_lend_their_coordinates():
    """torch 2.13's LocalTensorMode caches mesh coordinates by ``id(mesh)`` without holding the
    mesh: a new sub-mesh given a freed one's id got its coordinates (``mesh["tp"]`` answered
    with dp coordinates, and ``distribute_tensor`` gave rank 2 rank 1's shard). ``simulate``
    caches them with the mesh itself: every new tp sub-mesh, made after dp sub-mesh after dp
    sub-mesh was dropped, gets tp's shards, and the meshes are let go with the block."""
    import gc
    import weakref

    with simulate(4):
        root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        made = []
        for i in range(40):
            dp = root["dp"]
            dp.get_coordinate()
            del dp
            if i % 10 == 0:
                gc.collect()
            tp = root["tp"]
            x = distribute_tensor(replicated(4, torch.arange(5.0)), tp, [S0], src_data_rank=None)
            got = [on_rank(x._local_tensor, r).tolist() for r in range(4)]
            assert got == [[0, 1, 2], [3, 4]] * 2, (i, got)
            made.append(weakref.ref(tp))
            del x, tp
    gc.collect()
    assert all(ref() is None for ref in made)


def test_grads_must_be_shaped_like_params():
    params, grads, pls = _problem({"w": ((4, 3), [S0])}, steps=1)
    with pytest.raises(ValueError, match=r"grads_per_step\[0\] does not have the structure"):
        assert_sharded_equivalent(
            ft.sgd(0.1), params, [{"v": grads[0]["w"]}], placements=pls, mesh_shape=(2,)
        )
    with pytest.raises(TypeError, match="list of gradient trees"):
        assert_sharded_equivalent(ft.sgd(0.1), params, grads[0], placements=pls, mesh_shape=(2,))


# =============================================================================================
# the strategies
# =============================================================================================
@given(shape=mesh_shapes())
def test_mesh_shapes_are_small_1d_and_2d(shape):
    assert len(shape) in (1, 2) and all(s >= 2 for s in shape) and math.prod(shape) <= 8


def test_mesh_shapes_cover_1d_2d_and_8_ranks():
    assert find(mesh_shapes(), lambda s: len(s) == 2) == (2, 2)  # shrinks to the smallest
    find(mesh_shapes(), lambda s: math.prod(s) == 8 and len(s) == 2)
    find(mesh_shapes(), lambda s: s == (8,))
    with pytest.raises(ValueError):
        mesh_shapes(max_ranks=3, ndims=(2,))


@settings(max_examples=10)
@given(data=st.data())
def test_placements_are_valid_for_torch(data):
    """Drawn placements lay out with torch's own ``distribute_tensor``, and every rank's shard is
    the slice the harness expects (uneven, nested and empty shards included)."""
    from functional_train.testing.equivalence import _region, _unravel

    mesh_shape = data.draw(mesh_shapes(max_ranks=4), label="mesh_shape")
    shape = data.draw(shapes(), label="shape")
    pl = data.draw(leaf_placements(shape, mesh_shape, plain=False), label="placements")
    assert len(pl) == len(mesh_shape)
    for p in pl:
        assert isinstance(p, (Shard, Replicate))
        if isinstance(p, Shard):
            assert len(shape) > 0 and -len(shape) <= p.dim < len(shape)
            sz, n = shape[p.dim], mesh_shape[pl.index(p)]
            if sz % n:
                event("uneven shard")
            if sz < n:
                event("empty shard")
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    world = math.prod(mesh_shape)
    with simulate(world):
        m = init_device_mesh("cpu", mesh_shape)
        d = distribute_tensor(replicated(world, x), m, list(pl), src_data_rank=None)
        locs = [on_rank(d._local_tensor, r).clone() for r in range(world)]
    for r, loc in enumerate(locs):
        torch.testing.assert_close(loc, x[_region(shape, pl, mesh_shape, _unravel(r, mesh_shape))])


def test_placement_options():
    find(placements(2, 2), lambda pl: pl == (S0, S0))  # nested
    find(placements(3, 1), lambda pl: pl == (Shard(-1),))  # negative dims
    with pytest.raises(NoSuchExample):
        find(placements(2, 2, nested=False), lambda pl: pl == (S0, S0))
    with pytest.raises(NoSuchExample):
        find(placements(2, 1, replicate=False), lambda pl: pl == (R,))
    assert find(placements(0, 2), lambda pl: True) == (R, R)  # 0-dim: only Replicate
    assert find(leaf_placements((3,), (2,)), lambda pl: pl is None) is None  # plain leaves


def test_pytrees_have_none_0d_1d_3d_leaves_and_dtypes():
    import optree

    leaves = lambda t: optree.tree_leaves(t, none_is_leaf=True)  # noqa: E731
    find(pytrees(), lambda t: any(x is None for x in leaves(t)), settings=NO_SHRINK)
    for nd in (0, 1, 3):
        find(
            pytrees(),
            lambda t: any(x is not None and x.ndim == nd for x in leaves(t)),
            settings=NO_SHRINK,
        )
    t = find(
        pytrees(dtypes=(torch.float64, torch.bfloat16), none_leaves=False),
        lambda t: {x.dtype for x in leaves(t)} == {torch.float64, torch.bfloat16},
        settings=NO_SHRINK,
    )
    assert all(x is not None for x in leaves(t))
    assert (
        find(tensors((2, 3), dtype=torch.int32), lambda x: True, settings=NO_SHRINK).dtype
        == torch.int32
    )


@given(data=st.data())
def test_tree_placements_and_gradients_like_follow_the_tree(data):
    import optree

    tree = data.draw(pytrees(max_leaves=3), label="params")
    mesh_shape = data.draw(mesh_shapes(max_ranks=4), label="mesh_shape")
    pls = data.draw(tree_placements(tree, mesh_shape), label="placements")
    grads = data.draw(gradients_like(tree, rank=1, none=True), label="grads")
    pleaves, ptd = optree.tree_flatten(tree, none_is_leaf=True)
    gleaves, gtd = optree.tree_flatten(grads, none_is_leaf=True)
    assert gtd == ptd
    for p, g in zip(pleaves, gleaves):
        if p is None:
            assert g is None
        elif g is not None:
            assert g.shape == p.shape and g.dtype == p.dtype
    from functional_train.testing.equivalence import _flatten, _resolve_placements

    paths, _, _ = _flatten(tree)
    out = _resolve_placements(pls, "placements", paths, pleaves, ptd, len(mesh_shape), False)
    assert len(out) == len(pleaves)


@given(
    g=gradients((3, 4, 6), rank=1),
    full=gradients((4, 6)),
    mid=gradients((6, 5), rank=2),
    zero=gradients((2, 3), rank=0),
    vec=gradients((5,), rank=1),
)
def test_gradient_rank_is_controlled(g, full, mid, zero, vec):
    rank = lambda x: torch.linalg.matrix_rank(x, rtol=1e-5).tolist()  # noqa: E731  (float32)
    assert rank(g) == [1, 1, 1]
    assert rank(full) == 4
    assert rank(mid) == 2
    assert not zero.any()
    assert vec.shape == (5,)


def buggy_factored_rms():
    """One step of Adafactor's factored normalisation ``g / sqrt(r c^T / sum(r))`` (row and
    column mean squares ``r``, ``c``) for 2-D leaves sharded ``[Shard(1)]`` (columns split), with
    the bug: the row statistic is the mean over the LOCAL columns, never all-reduced. For a
    rank-1 gradient ``u v^T`` the local factor cancels between ``r`` and ``sum(r)`` exactly, so
    the bug is invisible; full-rank gradients show it."""

    def update(updates, state, params=None, *, mesh=None, **extra):
        leaves, treedef = _leaves(updates)
        out = []
        for g in leaves:
            x = _local(g).double()
            r = x.square().mean(1, keepdim=True)  # BUG: local columns only
            c = x.square().mean(0, keepdim=True)  # rows are whole: right
            v = r * c / r.sum()
            out.append(_rewrap((x / v.sqrt()).to(g.dtype), g))
        return treedef.unflatten(out), state

    return ft.GradientTransformation(lambda p: ft.EmptyState(), update)


_FACTORED_PARAMS = pytrees(ndims=(2,), sizes=(3, 4, 5), max_leaves=2, none_leaves=False)


@settings(max_examples=5)
@given(data=st.data(), mesh_shape=st.sampled_from([(2,), (3,)]), params=_FACTORED_PARAMS)
def test_rank1_gradients_hide_a_factored_statistics_bug(data, mesh_shape, params):
    grads = [data.draw(gradients_like(params, rank=1), label=f"grads {t}") for t in range(2)]
    assert_sharded_equivalent(
        buggy_factored_rms(),
        params,
        grads,
        placements=lambda p, x: [S1],
        mesh_shape=mesh_shape,
        rtol=1e-4,
        atol=1e-5,
    )


@settings(max_examples=5)
@given(data=st.data(), mesh_shape=st.sampled_from([(2,), (3,)]), params=_FACTORED_PARAMS)
def test_full_rank_gradients_show_the_factored_statistics_bug(data, mesh_shape, params):
    grads = [data.draw(gradients_like(params, rank=None), label=f"grads {t}") for t in range(2)]
    with pytest.raises(AssertionError, match=r"step 0, updates\['"):
        assert_sharded_equivalent(
            buggy_factored_rms(),
            params,
            grads,
            placements=lambda p, x: [S1],
            mesh_shape=mesh_shape,
            rtol=1e-4,
            atol=1e-5,
        )


# =============================================================================================
# strategies + harness together: drawn problems pass for real transforms
# =============================================================================================
_SMALL_MESHES = st.sampled_from([(2,), (3,), (2, 2), (4,)])


@given(case=sharded_cases(mesh_shapes=_SMALL_MESHES, steps=2))
def test_drawn_cases_pass_for_clip_and_adamw(case):
    event(f"mesh {case.mesh_shape}")
    assert_sharded_equivalent(ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(0.1)), **case)


@settings(max_examples=5)
@given(case=sharded_cases(steps=2, max_leaves=3))
def test_drawn_cases_up_to_8_ranks_pass_for_adafactor(case):
    event(f"mesh {case.mesh_shape}")
    assert_sharded_equivalent(ft.adafactor(beta1=0.9), rtol=1e-4, atol=1e-5, **case)


def test_sharded_case_repr_is_short_and_readable():
    case = find(sharded_cases(max_leaves=2), lambda c: True, settings=NO_SHRINK)
    text = repr(case)
    assert text.startswith("ShardedCase(mesh_shape=(2,)") and "tensor(" not in text, text
    assert set(case) == {"params", "grads_per_step", "mesh_shape", "placements"}


def test_gather_of_a_harness_layout():
    """(sanity) the simulation's ``gather`` reassembles what the harness lays out."""
    x = torch.arange(35.0).reshape(5, 7)
    with simulate(4):
        m = init_device_mesh("cpu", (2, 2))
        d = distribute_tensor(replicated(4, x), m, [S1, S1], src_data_rank=None)
        got = gather({"x": d})["x"]
    torch.testing.assert_close(got, x)


@pytest.mark.slow
def test_imports_without_hypothesis():
    code = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "import functional_train.testing as t\n"
        "assert callable(t.assert_sharded_equivalent)\n"
        "try:\n    t.mesh_shapes\nexcept ImportError as e:\n"
        "    assert 'functional-train[test]' in str(e)\n"
        "else:\n    raise SystemExit('strategies imported without hypothesis')\n"
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr
