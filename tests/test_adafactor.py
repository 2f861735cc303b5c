"""Adafactor: the primitives of :mod:`functional_train.factored` and the ``adafactor`` alias.

1. Reference: ``adafactor`` equals ``transformers.optimization.Adafactor`` over 20 steps on 0-D,
   1-D, 2-D and 3-D leaves with full-rank gradients, for every option (relative step on / off,
   beta1, weight decay, warmup_init, scale_parameter off, ...): parameter change to a relative
   tolerance, states (row / column / full second moments, first moment) equal HF's.
2. Primitives against their equations (block RMS clipping, parameter scaling, schedule, ema).
3. Sharded == unsharded in the one-process simulation (2x2 and 2-rank meshes, uneven and empty
   shards, nested sharding of one dim): updates, parameters and gathered states; state
   placements derived from the parameter's.
4. Collective counts: a constant number of all-reduces per update, whatever the number of leaves.
5. Bad hyper-parameters and states raise clear errors.
"""

from __future__ import annotations

import math
import sys

import optree
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from transformers.optimization import Adafactor as HFAdafactor  # the reference (test extra)

import functional_train as ft
from functional_train.factored import (
    EmaState,
    ScaleByFactoredRmsState,
    adafactor,
    clip_by_block_rms,
    ema,
    relative_step_schedule,
    scale_by_factored_rms,
    scale_by_param_block_rms,
)
from functional_train.testing import on_rank, simulate

SHAPES = {"w": (6, 5), "b": (7,), "t": (3, 4, 5), "row": (1, 8), "s": ()}

# (name, HF kwargs); ``lr`` is passed to adafactor as learning_rate
CONFIGS = [
    ("default", {}),
    ("lr", {"lr": 1e-2, "relative_step": False, "scale_parameter": False}),
    ("lr_scaled", {"lr": 3e-2, "relative_step": False}),
    ("beta1", {"beta1": 0.9}),
    ("wd", {"weight_decay": 0.1}),
    ("beta1_wd", {"beta1": 0.9, "weight_decay": 0.1}),
    ("lr_beta1_wd", {"lr": 3e-3, "relative_step": False, "beta1": 0.8, "weight_decay": 0.05}),
    (
        "lr_beta1_wd_noscale",
        {
            "lr": 3e-3,
            "relative_step": False,
            "beta1": 0.8,
            "weight_decay": 0.05,
            "scale_parameter": False,
        },
    ),
    ("warmup_init", {"warmup_init": True}),
    ("noscale", {"scale_parameter": False}),
    ("clip_decay", {"clip_threshold": 0.5, "decay_rate": -0.5, "eps": (1e-20, 1e-2)}),
]


def _alias(kw):
    kw = dict(kw)
    lr = kw.pop("lr", None)
    return adafactor(lr, **kw)


# =============================================================================================
# 1. against transformers' Adafactor
# =============================================================================================
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,kw", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_matches_transformers_adafactor(name, kw, dtype):
    steps = 20
    params, grads = _values(SHAPES, steps, dtype)
    hp = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = HFAdafactor(list(hp.values()), **kw)
    tx = _alias(kw)
    state, p = run_with_reference(opt, hp, tx, params, grads)
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    for k in SHAPES:
        want = hp[k].detach()
        # the parameter change, to a relative tolerance (float32 rounding of the parameter itself
        # accumulates over 20 steps: atol of a few ulps of |theta| per step)
        _close(
            p[k] - params[k],
            want - params[k],
            rtol,
            steps * 2 * torch.finfo(dtype).eps * params[k].abs().max().item(),
            f"{k} change",
        )
        hs = opt.state[hp[k]]
        fac = len(SHAPES[k]) >= 2
        st = state[0]
        assert isinstance(st, ScaleByFactoredRmsState)
        assert st.count.item() == steps == hs["step"]
        if fac:
            _close(st.v_row[k], hs["exp_avg_sq_row"], rtol, 0.0, f"{k} v_row")
            _close(st.v_col[k], hs["exp_avg_sq_col"], rtol, 0.0, f"{k} v_col")
            assert st.v[k].numel() == 0
        else:
            _close(st.v[k], hs["exp_avg_sq"], rtol, 0.0, f"{k} v")
            assert st.v_row[k].numel() == 0 and st.v_col[k].numel() == 0
        m = ft.tree_get(state, "ema")
        if kw.get("beta1") is None:
            assert m is None and "exp_avg" not in hs
        else:
            _close(m[k], hs["exp_avg"], rtol, 1e-12, f"{k} exp_avg")


def test_default_adafactor_state_layout_and_bf16():
    """States are float32 for bf16 params; the update has the params' dtype."""
    params = {
        "w": torch.randn(4, 6, dtype=torch.bfloat16),
        "b": torch.randn(6, dtype=torch.bfloat16),
    }
    tx = adafactor()
    st = tx.init(params)[0]
    assert st.count.dtype == torch.int64 and st.count.ndim == 0
    assert st.v_row["w"].shape == (4,) and st.v_col["w"].shape == (6,) and st.v["w"].shape == (0,)
    assert st.v["b"].shape == (6,) and st.v_row["b"].shape == (0,)
    assert all(x.dtype == torch.float32 for x in (st.v_row["w"], st.v_col["w"], st.v["b"]))
    u, _ = tx.update({k: torch.randn_like(v) for k, v in params.items()}, tx.init(params), params)
    assert u["w"].dtype == torch.bfloat16 and u["b"].dtype == torch.bfloat16


def test_frozen_leaves_pass_through_and_update_is_pure():
    params, grads = _values({"w": (5, 4), "v": (3,), "f": (2, 2)}, 2, torch.float32)
    tx = adafactor(beta1=0.9, weight_decay=0.1)
    state = tx.init(params)
    g = dict(grads[0], f=None)
    snap = ([x.clone() for x in grads[0].values()], [x.clone() for x in params.values()])
    u, new = tx.update(g, state, params)
    assert u["f"] is None
    # the frozen leaf's statistics are untouched; the input tensors are unmodified
    assert new[0].v_row["f"] is state[0].v_row["f"] and torch.equal(
        new[0].v_row["f"], torch.zeros(2)
    )
    for a, b in zip(grads[0].values(), snap[0]):
        assert torch.equal(a, b)
    for a, b in zip(params.values(), snap[1]):
        assert torch.equal(a, b)
    assert torch.equal(state[0].v_row["w"], torch.zeros(5))


# =============================================================================================
# 2. primitives against their equations
# =============================================================================================
def test_clip_by_block_rms_equation():
    g = {"a": torch.randn(4, 5) * 3, "b": torch.randn(7) * 0.01, "c": None}
    u, _ = clip_by_block_rms(0.5).update(g, clip_by_block_rms(0.5).init(g))
    for k in ("a", "b"):
        rms = g[k].pow(2).mean().sqrt()
        torch.testing.assert_close(u[k], g[k] / torch.clamp(rms / 0.5, min=1.0))
    assert u["c"] is None


def test_scale_by_param_block_rms_equation():
    p = {"a": torch.randn(4, 5), "z": torch.zeros(3)}
    g = {"a": torch.randn(4, 5), "z": torch.randn(3)}
    tx = scale_by_param_block_rms(1e-3)
    u, _ = tx.update(g, tx.init(p), p)
    torch.testing.assert_close(u["a"], g["a"] * p["a"].pow(2).mean().sqrt())
    torch.testing.assert_close(u["z"], g["z"] * 1e-3)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(g, tx.init(p))


@pytest.mark.parametrize("warmup_init", [False, True])
def test_relative_step_schedule(warmup_init):
    sched = relative_step_schedule(warmup_init)
    for count in [0, 1, 5, 99, 10_000, 2_000_000]:
        t = count + 1
        want = min(1e-6 * t if warmup_init else 1e-2, 1.0 / math.sqrt(t))
        got = sched(torch.tensor(count))
        assert got.dtype == torch.float64 and got.ndim == 0
        assert math.isclose(got.item(), want, rel_tol=1e-12)


@pytest.mark.parametrize("debias", [False, True])
def test_ema_equation(debias):
    xs = [torch.randn(3, 2) for _ in range(4)]
    tx = ema(0.7, debias=debias)
    state = tx.init(xs[0])
    m = torch.zeros(3, 2)
    for t, x in enumerate(xs, 1):
        u, state = tx.update(x, state)
        m = 0.7 * m + 0.3 * x
        torch.testing.assert_close(state.ema, m)
        torch.testing.assert_close(u, m / (1 - 0.7**t) if debias else m)
    assert isinstance(state, EmaState) and state.count.item() == 4


def test_factored_rms_constant_beta2_and_min_dim():
    """beta2 replaces 1 - t^decay_rate; min_dim_size_to_factor keeps small leaves unfactored."""
    g1, g2 = torch.randn(3, 8), torch.randn(3, 8)
    tx = scale_by_factored_rms(beta2=0.9, eps=1e-30)
    st = tx.init(g1)
    _, st = tx.update(g1, st)
    u, st = tx.update(g2, st)
    r = 0.9 * 0.1 * (g1**2).mean(-1) + 0.1 * (g2**2).mean(-1)
    c = 0.9 * 0.1 * (g1**2).mean(-2) + 0.1 * (g2**2).mean(-2)
    torch.testing.assert_close(st.v_row, r)
    torch.testing.assert_close(st.v_col, c)
    torch.testing.assert_close(u, g2 * (r / r.mean()).rsqrt()[:, None] * c.rsqrt()[None, :])
    tx = scale_by_factored_rms(min_dim_size_to_factor=4)
    st = tx.init(g1)
    u, st = tx.update(g1, st)
    assert st.v.shape == (3, 8) and st.v_row.shape == (0,)
    torch.testing.assert_close(u, g1 * (g1**2 + 1e-30).rsqrt())


# =============================================================================================
# 3. sharded == unsharded (simulation)
# =============================================================================================
from _layouts import (  # noqa: E402
    LEAVES_2,
    MIXED,
    S0,
    S1,
    S2,
    LEAVES_2x2,
    R,
    run_on_tp_submesh,
    run_with_reference,
    update_collectives,
)
from _layouts import close as _close  # noqa: E402
from _layouts import run_steps as _run  # noqa: E402
from _layouts import shard as _shard  # noqa: E402
from _layouts import values as _values  # noqa: E402

SHARDED_CONFIGS = [
    ("default", {}),
    ("lr_beta1_wd", {"lr": 3e-2, "relative_step": False, "beta1": 0.9, "weight_decay": 0.1}),
    ("beta1_wd_noscale", {"beta1": 0.8, "weight_decay": 0.1, "scale_parameter": False}),
    ("wd_warmup", {"weight_decay": 0.1, "warmup_init": True}),
]


def _row_col_placements(pl, ndim):
    rows, cols = [], []
    for p in pl:
        if isinstance(p, Shard):
            d = p.dim % ndim
            rows.append(R if d == ndim - 1 else Shard(d))
            cols.append(R if d == ndim - 2 else Shard(d - 1 if d == ndim - 1 else d))
        else:
            rows.append(R), cols.append(R)
    return rows, cols


def _shard_index(x: DTensor, r: int) -> tuple:
    """The slices of the global tensor that rank ``r`` of a root mesh holds (torch's nested
    chunking: mesh dims left to right, ``torch.chunk`` sizes, trailing shards possibly empty)."""
    coords, rr = [], r
    for s in reversed(x.device_mesh.shape):
        coords.append(rr % s)
        rr //= s
    coords.reverse()
    ranges = [(0, int(s)) for s in x.shape]
    for i, p in enumerate(x.placements):
        if isinstance(p, Shard):
            d = p.dim % x.ndim
            off, ln = ranges[d]
            cs = -(-ln // x.device_mesh.size(i))
            start = min(coords[i] * cs, ln)
            ranges[d] = (off + start, min(start + cs, ln) - start)
    return tuple(slice(o, o + n) for o, n in ranges)


def _per_rank(tree, world):
    """Per rank, what it holds of each leaf: ``(local shard, index into the global tensor)``.

    Not ``testing.gather``: ``full_tensor`` of a nested uneven ``[Shard(0), Shard(0)]`` DTensor
    of size 2 on a 2x2 mesh returns wrong values in the simulation once the mesh has been
    flattened (``DeviceMesh._flatten``, which the reductions do), so shards are compared in place.
    """

    def one(x):
        if isinstance(x, DTensor):
            return [(on_rank(x._local_tensor, r), _shard_index(x, r)) for r in range(world)]
        return [(on_rank(x, r), ...) for r in range(world)]

    return optree.tree_map(
        one, tree, none_is_leaf=True, is_leaf=lambda x: isinstance(x, torch.Tensor)
    )


def _close_views(views, want, rtol, atol, what):
    for r, (loc, idx) in enumerate(views):
        w = want[idx]
        assert tuple(loc.shape) == tuple(w.shape), f"{what} rank {r}: shard shape"
        got = loc.detach().to(torch.float64)
        w = w.detach().to(torch.float64)
        err = (got - w).abs().max().item() if got.numel() else 0.0
        tol = atol + rtol * (want.abs().max().item() if want.numel() else 0.0)
        assert err <= tol, f"{what} rank {r}: max abs err {err:.3e} > {tol:.3e}"


def _check_sharded(leaves, mesh_shape, names, tx_fn, steps=3, seed=1):
    shapes = {k: s for k, (s, _) in leaves.items()}
    params, grads = _values(shapes, steps, torch.float32, seed)
    ref_ups, ref_state, ref_p = _run(tx_fn(), params, grads)
    world = math.prod(mesh_shape)
    with simulate(world):
        m = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        dp = {k: _shard(params[k], m, pl) for k, (_, pl) in leaves.items()}
        dg = [{k: _shard(g[k], m, pl) for k, (_, pl) in leaves.items()} for g in grads]
        ups, state, out = _run(tx_fn(), dp, dg)
        # state placements: R like the rows, C like the columns, V like the parameter
        st = state[0]
        for k, (shape, pl) in leaves.items():
            if pl is None:
                continue
            if len(shape) >= 2:
                rows, cols = _row_col_placements(pl, len(shape))
                assert list(st.v_row[k].placements) == rows, (k, st.v_row[k].placements)
                assert list(st.v_col[k].placements) == cols, (k, st.v_col[k].placements)
                assert st.v_row[k].shape == shape[:-1]
                assert st.v_col[k].shape == shape[:-2] + shape[-1:]
            else:
                assert list(st.v[k].placements) == list(pl)
            assert list(ups[-1][k].placements) == list(pl)
            assert list(out[k].placements) == list(pl)
        got_ups = [_per_rank(u, world) for u in ups]
        got_state, got_out = _per_rank(state, world), _per_rank(out, world)
    for t in range(steps):
        for k in shapes:
            _close_views(got_ups[t][k], ref_ups[t][k], 1e-5, 1e-7, f"step {t} update {k}")
    for k in shapes:
        _close_views(got_out[k], ref_p[k], 1e-5, 1e-7, f"param {k}")
        for field in ("v_row", "v_col", "v"):
            _close_views(
                getattr(got_state[0], field)[k],
                getattr(ref_state[0], field)[k],
                1e-5,
                0.0,
                f"{field} {k}",
            )
    m_ref = ft.tree_get(ref_state, "ema")
    if m_ref is not None:
        m_got = ft.tree_get(got_state, "ema")
        for k in shapes:
            _close_views(m_got[k], m_ref[k], 1e-5, 1e-9, f"ema {k}")


@pytest.mark.parametrize("name,kw", SHARDED_CONFIGS, ids=[c[0] for c in SHARDED_CONFIGS])
def test_sharded_equals_unsharded_2x2(name, kw):
    _check_sharded(LEAVES_2x2, (2, 2), ("dp", "tp"), lambda: _alias(kw))


@pytest.mark.parametrize("name,kw", SHARDED_CONFIGS[:2], ids=[c[0] for c in SHARDED_CONFIGS[:2]])
def test_sharded_equals_unsharded_1d(name, kw):
    _check_sharded(LEAVES_2, (2,), ("tp",), lambda: _alias(kw))


def test_data_axis_and_sub_mesh_leaves():
    """Leaves on the ``tp`` sub-mesh of a dp x tp mesh with per-replica gradients (averaged over
    ``Mesh.data_axis`` by the first transform): equal to the unsharded run on the mean gradient."""
    leaves = {
        "a": ((5, 7), [S0]),
        "b": ((5, 7), [S1]),
        "e": ((3, 5, 6), [S2]),
        "g": ((9,), [S0]),
        "r": ((3, 4), [R]),
    }
    shapes = {k: s for k, (s, _) in leaves.items()}
    params, grads = _values(shapes, 2, torch.float32, seed=5)
    _, deltas = _values(shapes, 2, torch.float32, seed=6)
    kw = {"beta1": 0.9, "weight_decay": 0.1}
    ref_ups, ref_state, ref_p = _run(_alias(kw), params, grads)
    got_ups, got_state, got_out = run_on_tp_submesh(
        lambda: _alias(kw),
        leaves,
        params,
        grads,
        deltas,
        lambda u, st, o: ([_per_rank(x, 4) for x in u], _per_rank(st, 4), _per_rank(o, 4)),
    )
    for k in shapes:
        for t in range(2):
            _close_views(got_ups[t][k], ref_ups[t][k], 1e-5, 1e-7, f"step {t} update {k}")
        _close_views(got_out[k], ref_p[k], 1e-5, 1e-7, f"param {k}")
        for field in ("v_row", "v_col", "v"):
            _close_views(
                getattr(got_state[0], field)[k],
                getattr(ref_state[0], field)[k],
                1e-5,
                0.0,
                f"{field} {k}",
            )


@pytest.mark.parametrize("seed", [0, 12, 19, 20])
def test_leaves_are_independent_mixed_dtypes(seed):
    """adafactor on a tree of float32 / float64 / bf16 leaves equals adafactor on each leaf,
    bit for bit: a float32 leaf's RMS is not computed in float64 because another leaf is
    float64 (seeds 12, 19 and 20 differed by 1 ulp when ``leaf_totals`` returned float64)."""
    torch.manual_seed(seed)
    params = {
        "a": torch.randn(4, 3),
        "b": torch.randn(5, dtype=torch.float64),
        "c": torch.randn(2, 3, 4, dtype=torch.bfloat16),
        "d": torch.randn(3, 3, dtype=torch.float64),
    }
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(3)]
    kw = {"beta1": 0.9, "weight_decay": 0.1}
    _, st, whole = _run(_alias(kw), params, grads)
    assert st[0].v["b"].dtype == torch.float64 and st[0].v_row["c"].dtype == torch.float32
    assert st[0].v_col["d"].dtype == torch.float64
    for k in params:
        alone = _run(_alias(kw), params[k], [g[k] for g in grads])[2]
        assert whole[k].dtype == params[k].dtype
        torch.testing.assert_close(whole[k], alone, rtol=0, atol=0)


def test_sharded_primitives_2x2():
    """The primitives on their own (constant beta2, debiased ema, clip, parameter scaling)."""

    def tx():
        return ft.chain(
            scale_by_factored_rms(beta2=0.95, eps=1e-20),
            clip_by_block_rms(0.3),
            scale_by_param_block_rms(0.5),
            ema(0.5, debias=True),
        )

    _check_sharded(LEAVES_2x2, (2, 2), ("dp", "tp"), tx, steps=2, seed=3)


# =============================================================================================
# 4. collective counts
# =============================================================================================
_MIXED = MIXED


def _count(n_leaves, kw, mesh_shape=(2, 2), names=("dp", "tp"), mixed=_MIXED):
    return update_collectives(lambda: _alias(kw), n_leaves, mesh_shape, names, mixed)


def test_collectives_constant_in_the_number_of_leaves():
    """Default adafactor on a 2x2 mesh, leaves sharded over {tp}, {dp} and {dp, tp}: ONE
    all-reduce for the factored statistics of every leaf (written at their global offsets),
    ONE for the RMS of every update and of every parameter: 2, for 6 leaves or 18."""
    assert _count(6, {}) == _count(18, {}) == {"all_reduce": 2}


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({"scale_parameter": False}, 2),
        ({"weight_decay": 0.1}, 2),
        # the weight decay after the momentum recomputes RMS(param): 1 more
        ({"beta1": 0.9, "weight_decay": 0.1}, 3),
        ({"beta1": 0.9}, 2),
    ],
)
def test_collectives_per_option(kw, expected):
    # the first 4 leaves of _MIXED already span the mesh-dim sets {tp}, {dp}, {dp, tp}
    assert _count(4, kw) == {"all_reduce": expected}


def test_collectives_uniform_placements():
    """Every leaf sharded over the same mesh dims, or tensor parallel over one mesh dim: the
    same 2 all-reduces."""
    uniform = [((5, 7), [S0, S1]), ((6, 9), [S0, S1]), ((3, 4, 5), [S1, S2])]
    assert _count(6, {}, mixed=uniform) == {"all_reduce": 2}
    # tensor parallel over one mesh dim (colwise, rowwise, replicated and sharded biases): 2
    tp = [((8, 6), [S0]), ((6, 8), [S1]), ((8,), [S0]), ((6,), [R])]
    assert _count(8, {}, (2,), ("tp",), tp) == {"all_reduce": 2}


# =============================================================================================
# 5. errors
# =============================================================================================
@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: adafactor(1e-3), ValueError, "relative_step=True"),
        (lambda: adafactor(relative_step=False), ValueError, "learning_rate is required"),
        (lambda: adafactor(0.0, relative_step=False), ValueError, "learning_rate must be >"),
        (
            lambda: adafactor(warmup_init=True, relative_step=False, learning_rate=1e-3),
            ValueError,
            "warmup_init=True requires relative_step=True",
        ),
        (lambda: adafactor(eps=1e-30), TypeError, "eps must be a pair"),
        (lambda: adafactor(eps=(-1.0, 1e-3)), ValueError, r"eps\[0\]"),
        (lambda: adafactor(clip_threshold=0.0), ValueError, "clip_threshold"),
        (lambda: adafactor(decay_rate=0.8), ValueError, "decay_rate"),
        (lambda: adafactor(beta1=1.0), ValueError, "beta1"),
        (lambda: adafactor(weight_decay=-0.1), ValueError, "weight_decay"),
        (lambda: adafactor(relative_step=1), TypeError, "relative_step must be a bool"),
        (lambda: scale_by_factored_rms(beta2=1.5), ValueError, "beta2"),
        (lambda: scale_by_factored_rms(min_dim_size_to_factor=-1), ValueError, "min_dim"),
        (lambda: clip_by_block_rms(0.0), ValueError, "threshold"),
        (lambda: scale_by_param_block_rms(-1.0), ValueError, "min_scale"),
        (lambda: ema(1.0), ValueError, "decay"),
        (lambda: relative_step_schedule("yes"), TypeError, "warmup_init"),
    ],
)
def test_invalid_hyper_parameters(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_state_for_other_params_names_the_leaf():
    tx = scale_by_factored_rms()
    st = tx.init({"w": torch.zeros(4, 5), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"v_row: leaf 'w' has shape \(4,\), expected \(6,\)"):
        tx.update({"w": torch.zeros(6, 5), "b": torch.zeros(3)}, st)
    with pytest.raises(ValueError, match="expected the ScaleByFactoredRmsState"):
        tx.update({"w": torch.zeros(4, 5), "b": torch.zeros(3)}, ft.EmptyState())


def test_learning_rate_schedule_with_relative_step_off():
    """A schedule as learning_rate (an extension: HF takes a float) gives the float's numbers
    when constant."""
    params, grads = _values({"w": (4, 3), "b": (3,)}, 3, torch.float64)
    a = _run(
        adafactor(
            lambda c: 0.01 + 0 * torch.as_tensor(c, dtype=torch.float64),
            relative_step=False,
            beta1=0.5,
            weight_decay=0.1,
        ),
        params,
        grads,
    )[2]
    b = _run(adafactor(0.01, relative_step=False, beta1=0.5, weight_decay=0.1), params, grads)[2]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=0)


# =============================================================================================
# 5. ft.step's fused per-leaf path
# =============================================================================================
_STEP = sys.modules["functional_train.step"]
from _layouts import check_fused_step  # noqa: E402


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"weight_decay": 0.1},
        {"scale_parameter": False},
        {"lr": 1e-2, "relative_step": False, "clip_threshold": 0.5},
    ],
    ids=["default", "wd", "noscale", "lr_clip"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_step_fused_path_equals_the_chain(kw, dtype, monkeypatch):
    """``ft.step`` of adafactor (no beta1) in one process finishes each leaf in cache: bit for
    bit the chain's own ``ft.step`` through the engine (its tail's leaf function and
    ``apply_updates`` in one kernel, as the engine's last stage; for float32 / float64 also
    the chain's update + apply_updates, bit for bit), pure (inputs unchanged) and donated, for
    leaves above and below the size finished one at a time (64 KiB), factored and not, with a
    None gradient; the fused path is taken at every step."""
    check_fused_step(
        lambda: _alias(kw), dtype, monkeypatch, "fused_adafactor_step", engine_reference=True
    )
    if dtype != torch.bfloat16:
        check_fused_step(lambda: _alias(kw), dtype, monkeypatch, "fused_adafactor_step")


@pytest.mark.parametrize("per_leaf", [True, False])
def test_injected_zero_weight_decay_decays_by_zero(per_leaf, monkeypatch):
    """Under ``inject_hyperparams`` (what TorchOptimizer builds) a zero weight decay is
    injected too: the tail then decays by ``0 * p`` (its factor computed, not skipped: the
    chain once handed the tail the unscaled step, ``p * step`` added to every update), through
    the per-leaf path and through the engine alike: the plain alias's numbers."""
    if not per_leaf:
        monkeypatch.setattr(_STEP, "fused_adafactor_step", lambda *a: None)
    params, grads = _values({"w": (40, 30), "b": (30,), "m": (300, 70)}, 3, torch.float32)
    injected = ft.inject_hyperparams(adafactor)(1e-2, relative_step=False, weight_decay=0.0)
    plain = adafactor(1e-2, relative_step=False)
    got, want = params, params
    s_got, s_want = injected.init(params), plain.init(params)
    for g in grads:
        got, s_got = ft.step(injected, g, s_got, got)
        want, s_want = ft.step(plain, g, s_want, want)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_step_fused_path_after_a_clip(dtype, monkeypatch):
    """``chain(clip_by_global_norm, adafactor())`` (the main job's chain) takes it too."""
    check_fused_step(
        lambda: ft.chain(ft.clip_by_global_norm(0.5), adafactor()),
        dtype,
        monkeypatch,
        "fused_adafactor_step",
        engine_reference=True,
    )


def test_step_fused_path_only_where_it_applies(monkeypatch):
    """With beta1, or on DTensors, the general path runs (same numbers)."""
    taken = []
    real = _STEP.fused_adafactor_step
    monkeypatch.setattr(
        _STEP, "fused_adafactor_step", lambda *a: taken.append(real(*a)) or taken[-1]
    )
    params = {"w": torch.randn(4, 3)}
    g = {"w": torch.randn(4, 3)}
    for tx in (adafactor(beta1=0.9), ft.chain(ft.clip_by_global_norm(1.0), adafactor(beta1=0.5))):
        p, _ = ft.step(tx, g, tx.init(params), params)
        u, _ = tx.update(g, tx.init(params), params)
        assert torch.equal(p["w"], params["w"] + u["w"])
    assert taken == []
    with simulate(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        dp = {"w": _shard(params["w"], mesh, [S0])}
        dg = {"w": _shard(g["w"], mesh, [S0])}
        tx = adafactor()
        ft.step(tx, dg, tx.init(dp), dp)
    assert taken == [None]


# ---------------------------------------------------------------------------------------------
# the update from the factored statistics: an engine part, its vectors read by rows
# ---------------------------------------------------------------------------------------------
FACTORED_SHAPES = {
    "w": (17, 33),
    "t": (3, 4, 5),  # batch dims: each batch's own column statistic
    "row": (1, 8),  # one row: its row factor a single value
    "col": (6, 1),  # one column
    "b": (7,),  # the full second moment
    "s": (),
    "big": (64, 300),
}


def _factored_chains():
    return {
        "alone": lambda: ft.chain(scale_by_factored_rms(), ft.scale(-0.1)),
        "min_dim": lambda: ft.chain(
            scale_by_factored_rms(min_dim_size_to_factor=5), ft.scale_by_learning_rate(0.1)
        ),
        "beta1": lambda: adafactor(beta1=0.9, weight_decay=0.1),
        "masked": lambda: ft.chain(
            ft.masked(scale_by_factored_rms(), lambda p: {k: k != "w" for k in p}),
            ft.scale(-0.05),
        ),
        # torch.optim-style param groups: adafactor's leaves beside adamw's in one pass
        "partition": lambda: ft.partition(
            {"a": adafactor(beta1=0.9), "b": ft.adamw(1e-2)},
            lambda p: {k: "a" if k in ("w", "t", "big") else "b" for k in p},
        ),
        # adamw's parts first: the factored part in their stage, their moments absent (None)
        # at its leaves, left out of its kernel's inputs
        "partition_after": lambda: ft.partition(
            {"a": ft.adamw(1e-2), "b": adafactor(beta1=0.9)},
            lambda p: {k: "b" if k in ("w", "t", "big") else "a" for k in p},
        ),
    }


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("name", sorted(_factored_chains()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_factored_update_runs_in_the_engine(name, mode, dtype, monkeypatch):
    """``scale_by_factored_rms`` is an elementwise part whose leaf function multiplies the update
    by its statistics' factors, a value per row and one per column (``factored.factored_update``):
    a chain holding it runs as the engine's stages, the factored leaves' kernels called by rows
    (``fuse.Kernel.by_rows``: a row's factor a per-leaf value, the column factors a vector), the
    other leaves' as ever (none leaf by leaf in torch); the numbers and states equal the same
    definitions run leaf by leaf in torch (the kernels off): bit for bit in float32; float64
    within 1e-12 of the parameter change (adamw's multiply-adds); bfloat16, computed in float
    and rounded once as every kernel does, within 2% of the change plus 2 units in the last
    place; over 4 steps."""
    from functional_train.engine import elementwise as E
    from functional_train.engine import fuse

    rows, whole, torch_leaves = [], [], []
    real_rows, real_call = fuse.Kernel.by_rows, fuse.Kernel.__call__
    monkeypatch.setattr(
        fuse.Kernel,
        "by_rows",
        lambda self, i, *a, **k: rows.append(len(i[0])) or real_rows(self, i, *a, **k),
    )
    monkeypatch.setattr(
        fuse.Kernel,
        "__call__",
        lambda self, i, *a, **k: whole.append(len(i[0])) or real_call(self, i, *a, **k),
    )
    real_groups = E._broadcast_groups

    def grouped(ins, keys, n_per_leaf, plain, groups):
        real_groups(ins, keys, n_per_leaf, plain, groups)
        torch_leaves.extend(idx for sig, idx in groups.items() if not sig[0])

    gen = torch.Generator().manual_seed(3)
    params = {k: torch.randn(s, generator=gen).to(dtype) for k, s in FACTORED_SHAPES.items()}
    grads = [
        {k: (torch.randn(s, generator=gen) * 0.1).to(dtype) for k, s in FACTORED_SHAPES.items()}
        for _ in range(4)
    ]
    make = _factored_chains()[name]

    def run():
        tx = make()
        p, s = {k: v.clone() for k, v in params.items()}, tx.init(params)
        for g in grads:
            g = {k: v.clone() for k, v in g.items()}
            if mode == "update":
                u, s = tx.update(g, s, p)
                p = ft.apply_updates(p, u)
            else:
                p, s = ft.step(tx, g, s, p, donate=mode == "donate")
        return p, s

    monkeypatch.setattr(E, "_broadcast_groups", grouped)
    got, got_state = run()
    assert rows and whole
    assert not torch_leaves, "a leaf ran leaf by leaf in torch"
    monkeypatch.setattr(fuse, "ENABLED", False)
    want, want_state = run()
    # float32: bit for bit; float64: adamw's kernel rounds a multiply-add torch rounds twice;
    # bfloat16: the kernels compute in float and round once, torch rounds every operation
    rtol = {torch.float32: 0.0, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    for x, y in zip(optree.tree_leaves(got_state), optree.tree_leaves(want_state)):
        scale = y.double().abs().max().item() if y.numel() and y.is_floating_point() else 0.0
        torch.testing.assert_close(x, y, rtol=0, atol=rtol * scale)
    for k in params:
        change = (want[k].double() - params[k].double()).abs().max().item()
        ulp = torch.finfo(dtype).eps * want[k].double().abs().max().item()
        atol = rtol * change + (2 * ulp if dtype == torch.bfloat16 else 0.0)
        torch.testing.assert_close(got[k].double(), want[k].double(), rtol=0, atol=atol)
