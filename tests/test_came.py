"""CAME: ``scale_by_came`` and the ``came`` alias (functional_train.came).

1. Reference: ``came`` equals ``came_pytorch.CAME`` over 20 steps on 0-D, 1-D, 2-D and 3-D leaves
   (came_pytorch factors every leaf with ndim >= 2, batching over the leading dims) with
   full-rank gradients, weight decay on / off, non-default betas / eps / clip: parameter change to
   a relative tolerance, states (second moments, exp_avg, confidence statistics) equal.
2. Sharded == unsharded in the one-process simulation (2x2 mesh with uneven, empty and nested
   shards; 1-D mesh; per-replica gradients over a data axis): updates, parameters and states,
   state placements derived from the parameter's.
3. Collective counts: a constant number of all-reduces per update, whatever the number of leaves.
4. Bad hyper-parameters and states raise clear errors.
"""

from __future__ import annotations

import math
import sys

import optree
import pytest
import torch
from came_pytorch import CAME as RefCAME  # the reference
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import functional_train as ft
from functional_train.came import ScaleByCameState, came, scale_by_came
from functional_train.testing import on_rank, simulate

SHAPES = {"w": (6, 5), "b": (7,), "t": (3, 4, 5), "row": (1, 8), "s": ()}

CONFIGS = [
    ("default", {"lr": 1e-2}),
    ("wd", {"lr": 1e-2, "weight_decay": 0.1}),
    (
        "custom",
        {
            "lr": 3e-2,
            "betas": (0.8, 0.99, 0.999),
            "eps": (1e-20, 1e-10),
            "clip_threshold": 0.5,
            "weight_decay": 0.05,
        },
    ),
]


def _alias(kw):
    kw = dict(kw)
    return came(kw.pop("lr"), **kw)


# =============================================================================================
# 1. against came_pytorch
# =============================================================================================
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,kw", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_matches_came_pytorch(name, kw, dtype):
    steps = 20
    params, grads = _values(SHAPES, steps, dtype)
    hp = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = RefCAME(list(hp.values()), **kw)
    tx = _alias(kw)
    state, p = run_with_reference(opt, hp, tx, params, grads)
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    st = state[0]
    assert isinstance(st, ScaleByCameState)
    assert st.count.item() == steps
    for k in SHAPES:
        want = hp[k].detach()
        _close(
            p[k] - params[k],
            want - params[k],
            rtol,
            steps * 2 * torch.finfo(dtype).eps * params[k].abs().max().item(),
            f"{k} change",
        )
        hs = opt.state[hp[k]]
        assert hs["step"] == steps
        _close(st.exp_avg[k], hs["exp_avg"], rtol, 1e-12, f"{k} exp_avg")
        if len(SHAPES[k]) >= 2:
            _close(st.v_row[k], hs["exp_avg_sq_row"], rtol, 0.0, f"{k} v_row")
            _close(st.v_col[k], hs["exp_avg_sq_col"], rtol, 0.0, f"{k} v_col")
            _close(st.res_row[k], hs["exp_avg_res_row"], rtol, 0.0, f"{k} res_row")
            _close(st.res_col[k], hs["exp_avg_res_col"], rtol, 0.0, f"{k} res_col")
            assert st.v[k].numel() == 0
        else:
            _close(st.v[k], hs["exp_avg_sq"], rtol, 0.0, f"{k} v")
            for f in (st.v_row, st.v_col, st.res_row, st.res_col):
                assert f[k].shape == (0,)


def test_scale_by_came_equations_two_steps():
    """scale_by_came on one 2-D leaf against the paper's equations written out."""
    g1, g2 = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64) * 5
    b1, b2, b3, e1, e2, d = 0.9, 0.95, 0.99, 1e-30, 1e-16, 0.7
    tx = scale_by_came((b1, b2, b3), (e1, e2), d)
    st = tx.init(g1)
    r, rr = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    c, cc = torch.zeros(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    m = torch.zeros(3, 8, dtype=torch.float64)
    for g in (g1, g2):
        out, st = tx.update(g, st)
        G = g * g + e1
        r = b2 * r + (1 - b2) * G.mean(-1)
        c = b2 * c + (1 - b2) * G.mean(-2)
        u = g * (r / r.mean()).rsqrt()[:, None] * c.rsqrt()[None, :]
        u = u / torch.clamp(u.pow(2).mean().sqrt() / d, min=1.0)
        m = b1 * m + (1 - b1) * u
        U = (u - m) ** 2 + e2
        rr = b3 * rr + (1 - b3) * U.mean(-1)
        cc = b3 * cc + (1 - b3) * U.mean(-2)
        want = m * (rr / rr.mean()).rsqrt()[:, None] * cc.rsqrt()[None, :]
        torch.testing.assert_close(out, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(st.res_row, rr, rtol=1e-12, atol=0)
    torch.testing.assert_close(st.res_col, cc, rtol=1e-12, atol=0)
    torch.testing.assert_close(st.exp_avg, m, rtol=1e-12, atol=0)


def test_state_layout_bf16_frozen_and_purity():
    params = {
        "w": torch.randn(4, 6, dtype=torch.bfloat16),
        "b": torch.randn(6, dtype=torch.bfloat16),
        "f": torch.randn(2, 3),
    }
    tx = came(1e-3, weight_decay=0.1)
    st = tx.init(params)[0]
    assert st.count.dtype == torch.int64 and st.count.ndim == 0
    assert st.res_row["w"].shape == (4,) and st.res_col["w"].shape == (6,)
    assert st.res_row["b"].shape == (0,) and st.exp_avg["b"].shape == (6,)
    assert all(x.dtype == torch.float32 for x in (st.res_row["w"], st.exp_avg["w"], st.v["b"]))
    g = {
        "w": torch.randn(4, 6, dtype=torch.bfloat16),
        "b": torch.randn(6, dtype=torch.bfloat16),
        "f": None,
    }
    snap = [x.clone() for x in params.values()]
    state = tx.init(params)
    u, new = tx.update(g, state, params)
    assert u["w"].dtype == torch.bfloat16 and u["b"].dtype == torch.bfloat16 and u["f"] is None
    assert new[0].res_row["f"] is state[0].res_row["f"]
    assert torch.equal(state[0].exp_avg["w"], torch.zeros(4, 6))
    for a, b in zip(params.values(), snap):
        assert torch.equal(a, b)


def test_learning_rate_schedule():
    params, grads = _values({"w": (4, 3), "b": (3,)}, 3, torch.float64)
    a = _run(
        came(lambda c: 0.01 + 0 * torch.as_tensor(c, dtype=torch.float64), weight_decay=0.1),
        params,
        grads,
    )[2]
    b = _run(came(0.01, weight_decay=0.1), params, grads)[2]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=0)


# =============================================================================================
# 2. sharded == unsharded (simulation)
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
    """The slices of the global tensor that rank ``r`` of a root mesh holds."""
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
    """Per rank, ``(local shard, index into the global tensor)`` of every leaf (compared in
    place: ``full_tensor`` of nested uneven shards is unreliable in the simulation)."""

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
        got, w = loc.detach().to(torch.float64), w.detach().to(torch.float64)
        err = (got - w).abs().max().item() if got.numel() else 0.0
        tol = atol + rtol * (want.abs().max().item() if want.numel() else 0.0)
        assert err <= tol, f"{what} rank {r}: max abs err {err:.3e} > {tol:.3e}"


FIELDS = ("v_row", "v_col", "v", "exp_avg", "res_row", "res_col")


def _check_state_views(got_state, ref_state, shapes):
    for k in shapes:
        for field in FIELDS:
            _close_views(
                getattr(got_state[0], field)[k],
                getattr(ref_state[0], field)[k],
                1e-5,
                1e-12,
                f"{field} {k}",
            )


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
        st = state[0]
        for k, (shape, pl) in leaves.items():
            if pl is None:
                continue
            if len(shape) >= 2:
                rows, cols = _row_col_placements(pl, len(shape))
                for f in (st.v_row, st.res_row):
                    assert list(f[k].placements) == rows, (k, f[k].placements)
                    assert f[k].shape == shape[:-1]
                for f in (st.v_col, st.res_col):
                    assert list(f[k].placements) == cols, (k, f[k].placements)
                    assert f[k].shape == shape[:-2] + shape[-1:]
            else:
                assert list(st.v[k].placements) == list(pl)
            assert list(st.exp_avg[k].placements) == list(pl)
            assert list(ups[-1][k].placements) == list(pl)
            assert list(out[k].placements) == list(pl)
        got_ups = [_per_rank(u, world) for u in ups]
        got_state, got_out = _per_rank(state, world), _per_rank(out, world)
    for t in range(steps):
        for k in shapes:
            _close_views(got_ups[t][k], ref_ups[t][k], 1e-5, 1e-7, f"step {t} update {k}")
    for k in shapes:
        _close_views(got_out[k], ref_p[k], 1e-5, 1e-7, f"param {k}")
    _check_state_views(got_state, ref_state, shapes)


SHARDED_CONFIGS = [CONFIGS[0], CONFIGS[2]]


@pytest.mark.parametrize("name,kw", SHARDED_CONFIGS, ids=[c[0] for c in SHARDED_CONFIGS])
def test_sharded_equals_unsharded_2x2(name, kw):
    _check_sharded(LEAVES_2x2, (2, 2), ("dp", "tp"), lambda: _alias(kw))


def test_sharded_equals_unsharded_1d():
    _check_sharded(LEAVES_2, (2,), ("tp",), lambda: _alias(CONFIGS[1][1]))


def test_data_axis_and_sub_mesh_leaves():
    """Leaves on the ``tp`` sub-mesh of a dp x tp mesh with per-replica gradients (averaged over
    ``Mesh.data_axis`` once): equal to the unsharded run on the mean gradient."""
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
    kw = CONFIGS[1][1]
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
    _check_state_views(got_state, ref_state, shapes)


# =============================================================================================
# 3. collective counts
# =============================================================================================
_MIXED = MIXED


def _count(n_leaves, kw, mesh_shape=(2, 2), names=("dp", "tp"), mixed=_MIXED):
    return update_collectives(lambda: _alias(kw), n_leaves, mesh_shape, names, mixed)


def test_collectives_constant_in_the_number_of_leaves():
    """2x2 mesh, leaves sharded over {tp}, {dp} and {dp, tp}: ONE all-reduce for the
    second-moment statistics of every leaf, one for the RMS clipping (all leaves' sums), one for
    the confidence statistics: 3, for 4 leaves (the first 4 of the mixed layouts already span
    those mesh-dim sets) or 12, weight decay or not."""
    assert _count(4, {"lr": 1e-2}) == _count(12, {"lr": 1e-2}) == {"all_reduce": 3}
    assert _count(4, {"lr": 1e-2, "weight_decay": 0.1}) == {"all_reduce": 3}


def test_collectives_tensor_parallel_one_dim():
    """Tensor parallel over one mesh dim (colwise, rowwise, sharded and replicated biases): one
    all-reduce per stage: second moment, clipping, confidence = 3."""
    tp = [((8, 6), [S0]), ((6, 8), [S1]), ((8,), [S0]), ((6,), [R])]
    assert _count(8, {"lr": 1e-2}, (2,), ("tp",), tp) == {"all_reduce": 3}
    assert _count(32, {"lr": 1e-2}, (2,), ("tp",), tp) == {"all_reduce": 3}


# =============================================================================================
# 4. errors
# =============================================================================================
@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: came(None), ValueError, "learning_rate is required"),
        (lambda: came(0.0), ValueError, "learning_rate must be >"),
        (lambda: came(-1e-3), ValueError, "learning_rate must be >"),
        (lambda: came(1e-3, weight_decay=-0.1), ValueError, "weight_decay"),
        (lambda: came(1e-3, betas=(0.9, 0.999)), TypeError, "betas must be a tuple of 3"),
        (lambda: came(1e-3, betas=(1.0, 0.999, 0.9999)), ValueError, r"betas\[0\]"),
        (lambda: came(1e-3, betas=(0.9, -0.1, 0.9999)), ValueError, r"betas\[1\]"),
        (lambda: came(1e-3, betas=(0.9, 0.999, 1.5)), ValueError, r"betas\[2\]"),
        (lambda: came(1e-3, eps=1e-30), TypeError, "eps must be a tuple of 2"),
        (lambda: came(1e-3, eps=(-1.0, 1e-16)), ValueError, r"eps\[0\]"),
        (lambda: came(1e-3, eps=(1e-30, float("nan"))), ValueError, r"eps\[1\]"),
        (lambda: came(1e-3, clip_threshold=0.0), ValueError, "clip_threshold"),
        (lambda: scale_by_came(clip_threshold=-1.0), ValueError, "clip_threshold"),
        (lambda: came("0.1"), TypeError, "learning_rate must be a real number"),
    ],
)
def test_invalid_hyper_parameters(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_state_for_other_params_names_the_leaf():
    tx = scale_by_came()
    st = tx.init({"w": torch.zeros(4, 5), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="'w'"):
        tx.update({"w": torch.zeros(6, 5), "b": torch.zeros(3)}, st)
    with pytest.raises(ValueError, match="expected the ScaleByCameState"):
        tx.update({"w": torch.zeros(4, 5), "b": torch.zeros(3)}, ft.EmptyState())


# =============================================================================================
# ft.step's fused per-leaf path
# =============================================================================================
from _layouts import check_fused_step  # noqa: E402


@pytest.mark.parametrize(
    "kw",
    [
        {"learning_rate": 2e-4},
        {"learning_rate": 2e-4, "weight_decay": 0.01},
        {
            "learning_rate": lambda c: 1e-3 / (c + 1.0),
            "clip_threshold": 0.5,
            "betas": (0.8, 0.99, 0.999),
        },
    ],
    ids=["default", "wd", "schedule"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_step_fused_path_equals_the_chain(kw, dtype, monkeypatch):
    """``ft.step`` of came in one process finishes each leaf in cache (as ``came_pytorch``'s
    loop), running the chain's definitions (the momentum part, the tail's parts and
    ``apply_updates`` in one kernel call per leaf): bit for bit the chain's own ``ft.step``,
    pure and donated, and for float32 / float64 the chain's update + apply_updates too (see
    ``check_fused_step``; its leaves average under the 64 KiB the path asks for, which is
    lowered here)."""
    monkeypatch.setattr(sys.modules["functional_train.came"], "MIN_MEAN_BYTES", 0)
    check_fused_step(
        lambda: came(**kw), dtype, monkeypatch, "fused_came_step", engine_reference=True
    )
    if dtype != torch.bfloat16:
        check_fused_step(lambda: came(**kw), dtype, monkeypatch, "fused_came_step")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_fused_path_after_a_clip(dtype, monkeypatch):
    """``chain(clip_by_global_norm, came(...))`` takes it too (the clip's numbers first)."""
    monkeypatch.setattr(sys.modules["functional_train.came"], "MIN_MEAN_BYTES", 0)
    check_fused_step(
        lambda: ft.chain(ft.clip_by_global_norm(0.5), came(2e-4, weight_decay=0.01)),
        dtype,
        monkeypatch,
        "fused_came_step",
        engine_reference=True,
    )


def test_step_small_leaves_take_the_chain(monkeypatch):
    """Leaves averaging under 64 KiB: the chain's batched operations (``fused_came_step``
    declines), same numbers."""
    taken = []
    step_module = sys.modules["functional_train.step"]
    real = step_module.fused_came_step
    monkeypatch.setattr(
        step_module, "fused_came_step", lambda *a: taken.append(real(*a)) or taken[-1]
    )
    params = {"w": torch.randn(64, 68), "b": torch.randn(64)}
    g = {"w": torch.randn(64, 68), "b": torch.randn(64)}
    tx = came(2e-4)
    p, _ = ft.step(tx, g, tx.init(params), params)
    u, _ = tx.update(g, tx.init(params), params)
    assert taken == [None] and torch.equal(p["w"], params["w"] + u["w"])
