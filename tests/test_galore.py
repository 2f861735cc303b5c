"""GaLore: :func:`galore`, :func:`galore_adamw`, :func:`galore_param_labels`.

1. Reference: ``galore_adamw`` equals ``galore_torch.GaLoreAdamW`` over 20 steps with
   ``update_proj_gap=5`` (refreshes inside the run), 2-D leaves with m > n, m < n and m == n
   (both projection sides), every proj_type, a 1-D leaf with plain AdamW, weight decay,
   full-rank gradients, float32 and float64: parameter change to a relative tolerance, states
   (``exp_avg`` / ``exp_avg_sq`` vs the inner ``mu`` / ``nu``, the projector) equal
   galore-torch's. Also Colossal-AI style groups (``galore_param_labels``: a no-decay group) and
   a learning-rate schedule.
2. The projection equations, the state layout, purity, frozen leaves, bf16, no SVD between
   refreshes.
3. Sharded == unsharded in the one-process simulation (2x2 and 2-rank meshes, uneven and empty
   shards, nested sharding, plain and 3-D leaves, per-replica gradients over a data axis),
   several steps including a refresh: updates, parameters, gathered states and their placements.
4. Collective counts: a refresh gathers only sharded leaves; other steps issue one all-reduce
   per mesh-dim set sharding a contracted dim, none otherwise; constant in the number of leaves.
5. Bad input.
6. A real 2-process gloo run (no simulation) equals the one-process run.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import functional_train as ft
from functional_train.galore import GaLoreState, galore, galore_adamw, galore_param_labels
from functional_train.spec import transform_spec
from functional_train.testing import count_collectives, gather, per_rank, simulate

with warnings.catch_warnings():  # galore-torch imports bitsandbytes, which warns without a GPU
    warnings.simplefilter("ignore")
    from galore_torch import GaLoreAdamW  # the reference (test extra)

from _layouts import (  # noqa: E402
    LEAVES_2,
    MIXED,
    S0,
    S1,
    LEAVES_2x2,
    R,
    run_on_tp_submesh,
)
from _layouts import close as _close  # noqa: E402
from _layouts import run_steps as _run
from _layouts import shard as _shard  # noqa: E402
from _layouts import values as _values

SHAPES = {"tall": (8, 5), "wide": (4, 9), "square": (6, 6), "bias": (7,)}
GALORE_KEYS = ("tall", "wide", "square")


def _galore_state(state) -> GaLoreState:
    """The GaLoreState inside a galore_adamw state (partition -> chain -> first)."""
    st = state.inner_states["galore"][0]
    assert isinstance(st, GaLoreState)
    return st


def _reference(params, grads, groups, lr=1e-2, weight_decay=0.1, lr_of_step=None):
    """Run galore_torch.GaLoreAdamW; ``groups``: list of (keys, extra group options)."""
    hp = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = GaLoreAdamW(
            [dict(params=[hp[k] for k in keys], **kw) for keys, kw in groups],
            lr=lr,
            weight_decay=weight_decay,
        )
    for t, g in enumerate(grads):
        if lr_of_step is not None:
            for group in opt.param_groups:
                group["lr"] = lr_of_step(t)
        for k in hp:
            hp[k].grad = g[k].clone()
        opt.step()
    return hp, opt


# =============================================================================================
# 1. against galore_torch.GaLoreAdamW
# =============================================================================================
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right"])
def test_matches_galore_torch(proj_type, dtype):
    steps, rank, gap = 20, 3, 5
    params, grads = _values(SHAPES, steps, dtype)
    galore_group = {"rank": rank, "update_proj_gap": gap, "scale": 0.25, "proj_type": proj_type}
    hp, opt = _reference(params, grads, [(["bias"], {}), (GALORE_KEYS, galore_group)])
    tx = galore_adamw(1e-2, weight_decay=0.1, rank=rank, update_proj_gap=gap, proj_type=proj_type)
    _, state, p = _run(tx, params, grads)
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    for k in SHAPES:
        want = hp[k].detach()
        _close(
            p[k] - params[k],
            want - params[k],
            rtol,
            steps * 2 * torch.finfo(dtype).eps * params[k].abs().max().item(),
            f"{k} change",
        )
    st = _galore_state(state)
    assert st.count.item() == steps and st.count.device.type == "cpu"
    inner = st.inner_state
    assert inner.count.item() == steps
    for k in GALORE_KEYS:
        hs = opt.state[hp[k]]
        assert hs["step"] == steps
        _close(inner.mu[k], hs["exp_avg"], rtol, 1e-12, f"{k} exp_avg")
        _close(inner.nu[k], hs["exp_avg_sq"], rtol, 1e-14, f"{k} exp_avg_sq")
        # galore-torch stores the projector cast to the gradient's dtype; ours is the float32 SVD
        # output itself (the same values); the last refresh (step 16) saw the same gradient
        ortho = hs["projector"].ortho_matrix
        assert st.projectors[k].dtype == torch.float32
        _close(st.projectors[k].to(dtype), ortho, 1e-6, 0.0, f"{k} projector")
    adam = state.inner_states["decay"][0]
    hs = opt.state[hp["bias"]]
    _close(adam.mu["bias"], hs["exp_avg"], rtol, 1e-12, "bias exp_avg")
    _close(adam.nu["bias"], hs["exp_avg_sq"], rtol, 1e-14, "bias exp_avg_sq")
    assert st.projectors["bias"] is None


def test_matches_galore_torch_colossalai_groups_and_schedule():
    """Colossal-AI's ``get_galore_param_groups`` groups (GaLore with decay, others with decay,
    ``bias`` / ``LayerNorm.weight`` without), a decreasing learning rate, rank above min(m, n)."""
    shapes = {
        "attn.wq.weight": (8, 5),
        "attn.wq.bias": (8,),
        "mlp.up.weight": (3, 9),
        "LayerNorm.weight": (5,),
        "head.scale": (4,),
    }
    steps = 12
    params, grads = _values(shapes, steps, torch.float64, seed=3)
    labels = galore_param_labels(params, no_decay=("bias", "LayerNorm.weight"))
    assert labels == {
        "attn.wq.weight": "galore",
        "attn.wq.bias": "no_decay",
        "mlp.up.weight": "galore",
        "LayerNorm.weight": "no_decay",
        "head.scale": "decay",
    }

    def sched(count):
        return 2e-2 / torch.sqrt(1.0 + count.to(torch.float64))

    galore_group = {"rank": 4, "update_proj_gap": 4, "scale": 0.5, "proj_type": "std"}
    hp, opt = _reference(
        params,
        grads,
        [
            (["attn.wq.weight", "mlp.up.weight"], galore_group),
            (["head.scale"], {}),
            (["attn.wq.bias", "LayerNorm.weight"], {"weight_decay": 0.0}),
        ],
        weight_decay=0.2,
        lr_of_step=lambda t: float(sched(torch.tensor(t))),
    )
    tx = galore_adamw(sched, weight_decay=0.2, rank=4, update_proj_gap=4, scale=0.5, labels=labels)
    _, state, p = _run(tx, params, grads)
    for k in shapes:
        want = hp[k].detach()
        _close(p[k] - params[k], want - params[k], 1e-9, 1e-13, f"{k} change")
    # rank 4 > min(3, 9): the projector of mlp.up is U[:, :3]
    assert _galore_state(state).projectors["mlp.up.weight"].shape == (3, 3)
    assert set(state.inner_states) == {"galore", "decay", "no_decay"}


def test_labels_callable_and_other_strings():
    """A callable labels function; any label but "galore" / "no_decay" means plain AdamW with
    weight decay; a 1-D leaf labelled "galore" gets plain AdamW with decay."""
    params, grads = _values({"w": (6, 4), "v": (5, 3), "b": (4,)}, 3, torch.float64)
    ref = galore_adamw(
        1e-2,
        weight_decay=0.1,
        rank=2,
        update_proj_gap=2,
        labels={"w": "galore", "v": "decay", "b": "decay"},
    )
    got = galore_adamw(
        1e-2,
        weight_decay=0.1,
        rank=2,
        update_proj_gap=2,
        labels=lambda p: {"w": "galore", "v": "other", "b": "galore"},
    )
    _, _, want = _run(ref, params, grads)
    _, _, p = _run(got, params, grads)
    for k in params:
        torch.testing.assert_close(p[k], want[k], rtol=1e-12, atol=1e-14)


# =============================================================================================
# 2. equations, state layout, purity
# =============================================================================================
@pytest.mark.parametrize(
    "proj_type,shape,side",
    [
        ("std", (7, 4), "right"),
        ("std", (3, 6), "left"),
        ("reverse_std", (7, 4), "left"),
        ("reverse_std", (3, 6), "right"),
        ("left", (7, 4), "left"),
        ("right", (3, 6), "right"),
    ],
)
def test_projection_equations(proj_type, shape, side):
    """galore(identity): u = scale * g P^T P (right) or scale * P P^T g (left), P from the SVD
    of the gradient of the last refresh step."""
    gen = torch.Generator().manual_seed(1)
    gs = [torch.randn(shape, generator=gen) for _ in range(3)]
    tx = galore(ft.identity(), rank=2, update_proj_gap=2, scale=0.5, proj_type=proj_type)
    state = tx.init(torch.zeros(shape))
    assert state.count.dtype == torch.int64 and state.count.ndim == 0
    assert state.count.device.type == "cpu"
    for t, g in enumerate(gs):
        u, state = tx.update(g, state)
        src = gs[t - t % 2]  # refreshed on steps 1 and 3
        U, _, Vh = torch.linalg.svd(src, full_matrices=False)
        if side == "right":
            P = Vh[:2]
            want = 0.5 * (g @ P.T) @ P
        else:
            P = U[:, :2]
            want = 0.5 * P @ (P.T @ g)
        torch.testing.assert_close(state.projectors, P)
        torch.testing.assert_close(u, want)


def test_state_layout_frozen_leaves_purity_bf16():
    params = {
        "w": torch.randn(6, 4, dtype=torch.bfloat16),
        "v": torch.randn(3, 8),
        "b": torch.randn(5),
        "f": torch.randn(4, 4),
        "e": torch.randn(0, 3),
    }
    tx = galore(ft.scale_by_adam(), rank=2, update_proj_gap=3)
    state = tx.init(params)
    assert state.projectors["w"].shape == (2, 4) and state.projectors["v"].shape == (3, 2)
    assert state.projectors["b"] is None and state.projectors["e"] is None
    assert all(state.projectors[k].dtype == torch.float32 for k in ("w", "v", "f"))
    inner = state.inner_state
    assert inner.mu["w"].shape == (6, 2) and inner.mu["v"].shape == (2, 8)
    assert inner.mu["b"].shape == (5,) and inner.mu["w"].dtype == torch.float32
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    grads["f"] = None
    snap = {k: v.clone() for k, v in grads.items() if v is not None}
    psnap = {k: v.clone() for k, v in params.items()}
    u, new = tx.update(grads, state, params)
    assert u["f"] is None
    assert u["w"].dtype == torch.bfloat16 and u["w"].shape == (6, 4)
    assert new.projectors["f"] is state.projectors["f"]  # the frozen leaf keeps its projector
    assert torch.equal(new.projectors["f"], torch.zeros(2, 4))
    assert new.projectors["w"].abs().sum() > 0
    for k, v in snap.items():
        assert torch.equal(grads[k], v)
    for k, v in psnap.items():
        assert torch.equal(params[k], v)
    assert torch.equal(state.inner_state.mu["v"], torch.zeros(2, 8))
    assert state.count.item() == 0 and new.count.item() == 1


def test_reverse_std_wide_leaf_with_rank_above_rows():
    """reverse_std on a wide (3, 8) leaf with rank 4 >= 3: a right projection by Vh[:3]
    (galore-torch raises here, projecting back on the wrong side); every leaf frozen: no step."""
    g = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    tx = galore(ft.identity(), rank=4, update_proj_gap=2, scale=1.0, proj_type="reverse_std")
    state = tx.init(torch.zeros(3, 8))
    u, new = tx.update(g, state)
    Vh = torch.linalg.svd(g, full_matrices=False)[2]
    assert new.projectors.shape == (3, 8)
    torch.testing.assert_close(u, g @ Vh.T @ Vh)  # Vh is 3 x 8 with orthonormal rows: u == g
    torch.testing.assert_close(u, g)
    u, same = tx.update(None, new)
    assert u is None and same is new


def test_svd_only_on_refresh_steps(monkeypatch):
    calls = []
    svd = torch.linalg.svd

    def counting_svd(*args, **kwargs):
        calls.append(1)
        return svd(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", counting_svd)
    params, grads = _values({"a": (5, 4), "b": (3, 7), "c": (6,)}, 7, torch.float32)
    tx = galore_adamw(rank=2, update_proj_gap=3)
    state = tx.init(params)
    per_step = []
    for g in grads:
        n = len(calls)
        _, state = tx.update(g, state, params)
        per_step.append(len(calls) - n)
    assert per_step == [2, 0, 0, 2, 0, 0, 2]


# =============================================================================================
# 3. sharded == unsharded (simulation)
# =============================================================================================
def _low_rank_placements(pl, side):
    c = 1 if side == "right" else 0
    return [R if isinstance(p, Shard) and p.dim == c else p for p in pl]


def _side(shape, proj_type):
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    return proj_type


def _check_sharded(leaves, mesh_shape, names, proj_type, steps=3, seed=1):
    """galore_adamw with refreshes on steps 1 and 3, sharded vs unsharded."""
    shapes = {k: s for k, (s, _) in leaves.items()}
    params, grads = _values(shapes, steps, torch.float32, seed)

    def make():
        return galore_adamw(1e-2, weight_decay=0.1, rank=2, update_proj_gap=2, proj_type=proj_type)

    ref_ups, ref_state, ref_p = _run(make(), params, grads)
    with simulate(math.prod(mesh_shape)):
        m = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        dp = {k: _shard(params[k], m, pl) for k, (_, pl) in leaves.items()}
        dg = [{k: _shard(g[k], m, pl) for k, (_, pl) in leaves.items()} for g in grads]
        ups, state, out = _run(make(), dp, dg)
        st = _galore_state(state)
        for k, (shape, pl) in leaves.items():
            if pl is None:
                continue
            assert list(ups[-1][k].placements) == list(pl)
            assert list(out[k].placements) == list(pl)
            if len(shape) == 2:
                side = _side(shape, proj_type)
                assert list(st.projectors[k].placements) == [R] * len(pl)
                assert list(st.inner_state.mu[k].placements) == _low_rank_placements(pl, side)
        got_ups, got_state, got_out = gather(ups), gather(state), gather(out)
    for t in range(steps):
        for k in shapes:
            _close(got_ups[t][k], ref_ups[t][k], 1e-5, 1e-7, f"step {t} update {k}")
    for k in shapes:
        _close(got_out[k], ref_p[k], 1e-5, 1e-7, f"param {k}")
    g, r = _galore_state(got_state), _galore_state(ref_state)
    g_adam, r_adam = got_state.inner_states["decay"][0], ref_state.inner_states["decay"][0]
    for k, shape in shapes.items():
        if len(shape) == 2:  # projected: the projector and the moments of R
            _close(g.projectors[k], r.projectors[k], 1e-5, 0.0, f"projector {k}")
            got, want = g.inner_state, r.inner_state
        else:  # plain AdamW
            assert g.projectors[k] is None and r.projectors[k] is None
            got, want = g_adam, r_adam
        for field in ("mu", "nu"):
            _close(getattr(got, field)[k], getattr(want, field)[k], 1e-5, 1e-12, f"{field} {k}")


@pytest.mark.parametrize("proj_type", ["std", "reverse_std"])
def test_sharded_equals_unsharded_2x2(proj_type):
    _check_sharded(LEAVES_2x2, (2, 2), ("dp", "tp"), proj_type)


@pytest.mark.parametrize("proj_type", ["left", "right"])
def test_sharded_equals_unsharded_1d(proj_type):
    leaves = dict(LEAVES_2, c=((3, 8), [S0]), d=((9, 4), [R]))
    _check_sharded(leaves, (2,), ("tp",), proj_type)


def test_data_axis_and_sub_mesh_leaves():
    """Leaves on the ``tp`` sub-mesh of a dp x tp mesh with per-replica gradients (averaged over
    ``Mesh.data_axis`` first): equal to the unsharded run on the mean gradient."""
    leaves = {"a": ((5, 7), [S0]), "b": ((7, 5), [S1]), "g": ((9,), [S0]), "r": ((3, 4), [R])}
    shapes = {k: s for k, (s, _) in leaves.items()}
    steps = 3
    params, grads = _values(shapes, steps, torch.float32, seed=5)
    _, deltas = _values(shapes, steps, torch.float32, seed=6)

    def make():
        return galore_adamw(1e-2, weight_decay=0.1, rank=2, update_proj_gap=2)

    mean = [{k: ((g[k] + d[k]) + (g[k] - d[k])) / 2 for k in shapes} for g, d in zip(grads, deltas)]
    ref_ups, ref_state, ref_p = _run(make(), params, mean)
    got_ups, got_state, got_out = run_on_tp_submesh(
        make, leaves, params, grads, deltas, lambda u, st, o: (gather(u), gather(st), gather(o))
    )
    for k in shapes:
        for t in range(steps):
            _close(got_ups[t][k], ref_ups[t][k], 1e-5, 1e-7, f"step {t} update {k}")
        _close(got_out[k], ref_p[k], 1e-5, 1e-7, f"param {k}")
    g, r = _galore_state(got_state), _galore_state(ref_state)
    for k in ("a", "b", "r"):
        _close(g.inner_state.mu[k], r.inner_state.mu[k], 1e-5, 1e-12, f"mu {k}")


# =============================================================================================
# 4. collective counts
# =============================================================================================
def _step_collectives(spec, mesh_shape=(2,), names=("tp",), make=None, steps=2):
    """Collectives of each of ``steps`` updates of ``make()`` (default galore(scale_by_adam)
    with update_proj_gap=3: update 1 refreshes, update 2 does not)."""
    make = make or (lambda: galore(ft.scale_by_adam(), rank=2, update_proj_gap=3))
    # values made outside the simulation: torch.randn inside it gives a different tensor per
    # simulated rank, which the replicated() helper would then nest (16 computations per op)
    gen = torch.Generator().manual_seed(0)
    pv = [torch.randn(s, generator=gen) for s, _ in spec]
    gv = [torch.randn(s, generator=gen) for s, _ in spec]
    with simulate(math.prod(mesh_shape)):
        m = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        params = {f"l{i}": _shard(x, m, pl) for i, (x, (_, pl)) in enumerate(zip(pv, spec))}
        grads = {f"l{i}": _shard(x, m, pl) for i, (x, (_, pl)) in enumerate(zip(gv, spec))}
        tx = make()
        state = tx.init(params)
        counts = []
        for _ in range(steps):
            with count_collectives() as c:
                _, state = tx.update(grads, state, params)
            counts.append(c.counts)
    return counts


def test_collectives_row_and_column_sharded():
    """Tensor parallel over one mesh dim. std projects (8, 6) on the right (contracts the
    columns) and (6, 8) on the left (contracts the rows). Refresh: the sharded leaves are
    gathered in one all-gather, no all-reduce. Other steps: the leaves whose contracted dim is
    sharded (column-sharded (8, 6), row-sharded (6, 8)) share one all-reduce."""
    spec = [((8, 6), [S0]), ((8, 6), [S1]), ((6, 8), [S0]), ((6, 8), [S1]), ((4,), [S0])]
    assert _step_collectives(spec) == [{"all_gather_into_tensor": 1}, {"all_reduce": 1}]
    assert _step_collectives(spec * 3) == [{"all_gather_into_tensor": 1}, {"all_reduce": 1}]
    # galore_adamw adds nothing: Adam, the learning rate and the decay are local
    adamw = lambda: galore_adamw(rank=2, update_proj_gap=3, weight_decay=0.1)  # noqa: E731
    assert _step_collectives(spec, make=adamw) == [{"all_gather_into_tensor": 1}, {"all_reduce": 1}]


def test_collectives_none_when_contracted_dims_are_whole():
    """Only the non-contracted dim sharded: the other steps issue no collective."""
    spec = [((8, 6), [S0]), ((6, 8), [S1])]
    assert _step_collectives(spec, steps=3) == [{"all_gather_into_tensor": 1}, {}, {}]


def test_collectives_replicated_leaves_no_gather():
    """Replicated DTensors and their refresh: no communication at all."""
    spec = [((8, 6), [R]), ((6, 8), [R]), ((5,), [R])]
    assert _step_collectives(spec) == [{}, {}]
    spec2 = [((8, 6), [R, R]), ((6, 8), [R, R])]
    assert _step_collectives(spec2, (2, 2), ("dp", "tp")) == [{}, {}]


def test_collectives_2x2_constant_in_the_number_of_leaves():
    """2x2 mesh, the mixed layouts: refresh gathers over (dp, tp) for [S0, S1] and [S1, S1]
    leaves (2 all-gathers), tp for [R, S1] (1) and dp for [S0, R] (1): 4; other steps: the
    contracted dims are sharded over {dp} ((5, 7) left-projected, rows on dp) and {tp} ((7, 3)
    right-projected, columns on tp), and ONE all-reduce completes every partial projection
    (written at its global offsets, see Prepared.leaf_sums). 10 leaves or 20."""
    want = [{"all_gather_into_tensor": 4}, {"all_reduce": 1}]
    assert _step_collectives(MIXED, (2, 2), ("dp", "tp")) == want
    assert _step_collectives(MIXED * 2, (2, 2), ("dp", "tp")) == want


# =============================================================================================
# 5. bad input
# =============================================================================================
@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: galore(ft.scale_by_adam(), rank=0), ValueError, "rank must be >= 1"),
        (lambda: galore(ft.scale_by_adam(), rank=-3), ValueError, "rank must be >= 1"),
        (lambda: galore(ft.scale_by_adam(), rank=2.5), TypeError, "rank must be an int"),
        (lambda: galore(ft.scale_by_adam(), 4, update_proj_gap=0), ValueError, "update_proj_gap"),
        (lambda: galore(ft.scale_by_adam(), 4, proj_type="full"), ValueError, "proj_type"),
        (lambda: galore(ft.scale_by_adam(), 4, proj_type="Std"), ValueError, "proj_type"),
        (lambda: galore(ft.scale_by_adam(), 4, scale="0.25"), TypeError, "scale"),
        (lambda: galore(lambda g: g, 4), TypeError, "inner must be a GradientTransformation"),
        (lambda: galore_adamw(rank=0), ValueError, "rank"),
        (lambda: galore_adamw(update_proj_gap=-1), ValueError, "update_proj_gap"),
        (lambda: galore_adamw(proj_type="diagonal"), ValueError, "proj_type"),
        (lambda: galore_adamw(weight_decay=-0.1), ValueError, "weight_decay"),
        (lambda: galore_adamw(-1e-3), ValueError, "learning_rate"),
        (lambda: galore_adamw(b1=1.0), ValueError, "b1"),
        (lambda: galore_adamw(eps=-1.0), ValueError, "eps"),
        (
            lambda: galore_param_labels({"a": torch.zeros(2, 2)}, no_decay="bias"),
            TypeError,
            "no_decay",
        ),
    ],
)
def test_invalid_hyper_parameters(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_state_for_other_params_names_the_leaf():
    tx = galore(ft.scale_by_adam(), rank=2)
    st = tx.init({"w": torch.zeros(4, 5), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="'w'"):
        tx.update({"w": torch.zeros(6, 5), "b": torch.zeros(3)}, st)
    with pytest.raises(ValueError, match="'b'"):
        tx.update({"w": torch.zeros(4, 5), "b": torch.zeros(3, 2)}, st)
    with pytest.raises(ValueError, match="expected the GaLoreState"):
        tx.update({"w": torch.zeros(4, 5), "b": torch.zeros(3)}, ft.EmptyState())
    bad = galore_adamw(labels={"w": "galore", "b": 3})
    with pytest.raises(TypeError, match="'b'"):
        bad.init({"w": torch.zeros(4, 5), "b": torch.zeros(3)})


# =============================================================================================
# 6. real collectives (gloo, 2 processes)
# =============================================================================================
_GLOO_LEAVES = {
    "a": ((5, 7), "S0"),
    "b": ((7, 3), "S1"),
    "c": ((3, 8), "S0"),
    "d": ((8, 3), "S0"),
    "e": ((9,), "S0"),
    "f": ((4, 3), None),
    "r": ((3, 5), "R"),
}


@pytest.mark.slow
def test_gloo_2_processes_match_one_process(ranks):
    """galore_adamw on a real 2-process gloo mesh (the path without simulation: real mesh
    coordinates, real all-gathers of uneven shards) equals the one-process run."""
    import _gloo_galore_worker as worker

    res = ranks.run(2, "_gloo_galore_worker:main", _GLOO_LEAVES)[0]
    params, grads = worker.problem(_GLOO_LEAVES)
    _, _, want = _run(worker.make_tx(), params, grads)
    for k in params:
        _close(res["params"][k] - params[k], want[k] - params[k], 1e-5, 1e-7, f"param {k}")
    # refreshes (steps 1, 3): the sharded 2-D leaves a, b, c, d share one all-gather;
    # step 2: a (5, 7) left-projected with rows sharded and b (7, 3) right-projected with
    # columns sharded: one all-reduce (c, d: only the kept dim sharded)
    assert res["counts"] == [
        {"all_gather_into_tensor": 1},
        {"all_reduce": 1},
        {"all_gather_into_tensor": 1},
    ]


# =============================================================================================
# 8-bit moments (the seed's 8-bit GaLore)
# =============================================================================================
def test_galore_adamw_8bit_moments():
    """``optim_bits=8``: the Adam moments of the projected gradients are uint8 block-wise codes
    (projected shapes), the run stays within a few percent of the 32-bit one, and it is exact
    under sharding (2x2 mesh, uneven shards, a refresh inside the run)."""
    from torch.distributed.tensor import Replicate as Rep

    from functional_train.quantization import ScaleByAdam8bitState
    from functional_train.testing import assert_sharded_equivalent

    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(24, 10, generator=gen), "b": torch.randn(10, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(6)]

    def run(bits):
        tx = galore_adamw(
            1e-2, rank=4, update_proj_gap=3, weight_decay=0.01, optim_bits=bits, min_8bit_size=8
        )
        p, s = dict(params), tx.init(params)
        for g in grads:
            u, s = tx.update(g, s, p)
            p = ft.apply_updates(p, u)
        return p, s

    p8, s8 = run(8)
    p32, _ = run(32)
    adam = s8.inner_states["galore"][0].inner_state
    assert isinstance(adam, ScaleByAdam8bitState)
    assert adam.mu_codes["w"].dtype == torch.uint8 and adam.mu_codes["w"].shape == (24, 4)
    assert adam.mu["w"] is None
    for k in params:
        d8, d32 = p8[k] - params[k], p32[k] - params[k]
        assert (d8 - d32).norm() / d32.norm() < 0.05, k
    assert_sharded_equivalent(
        galore_adamw(1e-2, rank=4, update_proj_gap=3, optim_bits=8, min_8bit_size=8),
        params,
        grads[:4],
        mesh_shape=(2, 2),
        rtol=1e-6,
        atol=1e-7,
        placements={"w": [S0, S1], "b": [Rep(), S0]},
    )


# =============================================================================================
# the randomized refresh (stretch goal): O(k (m + n)) communication per leaf
# =============================================================================================
@pytest.mark.parametrize("shape", [(12, 7), (7, 12)])
def test_randomized_refresh_recovers_a_low_rank_subspace(shape):
    """For a gradient of rank <= k the range finder spans exactly the top-r singular subspace:
    the projector's span equals the SVD's (left and right sides)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(shape[0], 3, generator=gen) @ torch.randn(3, shape[1], generator=gen)
    spans = {}
    for refresh in ("svd", "randomized"):
        tx = galore(ft.scale_by_adam(), rank=3, update_proj_gap=5, refresh=refresh, oversample=2)
        params = {"w": torch.zeros(shape)}
        _, state = tx.update({"w": g}, tx.init(params), params)
        p = state.projectors["w"]
        spans[refresh] = p.T @ p if p.shape[0] == 3 else p @ p.T  # the orthogonal projection
    torch.testing.assert_close(spans["randomized"], spans["svd"], rtol=0, atol=1e-5)


def test_randomized_refresh_sharded_equals_unsharded_and_communicates_less():
    """2x2 mesh, uneven shards on either dim: the same projectors and updates as one process
    (the same Gaussian directions); a refresh issues two all-reduces (range, then B) and no
    all-gather, plus the usual one for the sharded contracted dims."""
    from functional_train.testing import assert_sharded_equivalent

    gen = torch.Generator().manual_seed(1)
    params = {
        "w": torch.randn(9, 5, generator=gen),
        "v": torch.randn(5, 11, generator=gen),
        "b": torch.randn(5, generator=gen),
    }
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(4)]
    placements = {"w": [S0, S1], "v": [S1, R], "b": [R, S0]}
    assert_sharded_equivalent(
        galore(ft.scale_by_adam(), 2, update_proj_gap=2, refresh="randomized"),
        params,
        grads,
        mesh_shape=(2, 2),
        placements=placements,
        rtol=1e-4,
        atol=1e-5,
    )
    assert_sharded_equivalent(
        galore_adamw(1e-2, rank=2, update_proj_gap=2, refresh="randomized"),
        params,
        grads,
        mesh_shape=(2, 2),
        placements=placements,
        rtol=1e-4,
        atol=1e-5,
    )
    with simulate(4):
        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        p = {
            k: distribute_tensor(
                per_rank(4, lambda r, v=v: v), m, placements[k], src_data_rank=None
            )
            for k, v in params.items()
        }
        g = {
            k: distribute_tensor(
                per_rank(4, lambda r, v=v: v), m, placements[k], src_data_rank=None
            )
            for k, v in grads[0].items()
        }
        tx = galore(ft.scale_by_adam(), 2, update_proj_gap=2, refresh="randomized")
        with count_collectives() as c:
            tx.update(g, tx.init(p), p)
    assert c.counts == {"all_reduce": 3}, c.counts


def test_randomized_refresh_bad_input():
    with pytest.raises(ValueError, match="refresh"):
        galore(ft.scale_by_adam(), 2, refresh="power")
    with pytest.raises(ValueError, match="oversample"):
        galore(ft.scale_by_adam(), 2, refresh="randomized", oversample=-1)


# =============================================================================================
# ft.step's per-leaf path
# =============================================================================================
from _layouts import check_fused_step  # noqa: E402

_GALORE_SHAPES = {
    "w": (6, 5),
    "b": (7,),
    "s": (),
    "tall": (400, 300),
    "wide": (200, 600),
    "vec": (60000,),
    "stack": (2, 90, 100),
    "frozen": (40, 30),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kw",
    [
        dict(weight_decay=0.1),
        dict(weight_decay=0.0, proj_type="reverse_std"),
        dict(weight_decay=0.1, learning_rate="schedule", optim_bits=8),
        dict(weight_decay=0.05, labels=True, scale=0.3),
    ],
    ids=["decay", "no_decay_reverse", "schedule_8bit", "labels_scale"],
)
def test_step_per_leaf_path_equals_the_chain(kw, dtype, monkeypatch):
    """``ft.step(galore_adamw(...))`` between refreshes (update_proj_gap=2: steps 2 and 4)
    finishes each projected leaf in cache (``fused_galore_step``): its back-projection into a
    scratch buffer, then the label's tail (learning rate, decay) and the add in one kernel
    call of the tail's own parts. float32: bit for bit the chain's update + apply_updates;
    bfloat16 (the kernel rounds ``p + u`` once, the chain rounds ``u`` first): to float
    rounding; the states bit for bit; pure and donated. Refresh steps (1 and 3) take the
    general path. Right and left projections, a 3-D leaf, a vector, the "no_decay" label, a
    schedule, 8-bit moments."""
    kw = dict(kw)
    if kw.get("learning_rate") == "schedule":
        kw["learning_rate"] = ft.schedules.linear_schedule(1e-2, 1e-3, 10)
    if kw.pop("labels", False):
        kw["labels"] = {k: ("no_decay" if k in ("b", "vec") else "galore") for k in _GALORE_SHAPES}
    check_fused_step(
        lambda: galore_adamw(rank=8, update_proj_gap=2, **kw),
        dtype,
        monkeypatch,
        "fused_galore_step",
        shapes=_GALORE_SHAPES,
        steps=4,
        taken_at=[False, True, False, True],
        # (bfloat16: p + u rounded once in the kernel, where update + apply_updates rounds u)
        param_rounding=dtype == torch.bfloat16,
    )


def test_step_per_leaf_path_declines_small_leaves(monkeypatch):
    """Leaves averaging under 64 KiB: the general path (per-leaf Python work would not pay)."""
    import sys

    step_module = sys.modules["functional_train.step"]
    taken = []
    real = step_module.fused_galore_step
    monkeypatch.setattr(
        step_module, "fused_galore_step", lambda *a: taken.append(real(*a)) or taken[-1]
    )
    params = {"w": torch.randn(20, 30), "b": torch.randn(30)}
    tx = galore_adamw(1e-2, rank=4, update_proj_gap=5)
    s = tx.init(params)
    p = params
    for _ in range(2):
        p, s = ft.step(tx, {k: torch.randn_like(v) for k, v in params.items()}, s, p)
    assert taken == [None, None]


@pytest.mark.parametrize(
    "kw",
    [dict(eps_before_correction=True), dict(), dict(bias_correction=False, eps=1e-3)],
    ids=["hf", "torch", "no_correction"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_leaf_equals_scale_by_adam(kw, dtype):
    """``scale_by_adam``'s one-leaf form (its spec's ``adam_leaf``, used by the per-leaf GaLore
    step) gives the update's moments and output bit for bit over 3 steps, in place and into
    other buffers, for bfloat16 gradients with float32 moments too."""
    tx = ft.scale_by_adam(0.8, 0.95, **kw)
    adam = transform_spec(tx).adam_leaf
    assert adam is not None
    gen = torch.Generator().manual_seed(1)
    g = {
        "a": torch.randn(30, 40, generator=gen).to(dtype),
        "b": torch.randn(7, generator=gen).to(dtype),
    }
    s = tx.init(g)
    mu = {k: v.clone() for k, v in s.mu.items()}
    nu = {k: v.clone() for k, v in s.nu.items()}
    for step in range(3):
        u, s = tx.update(g, s)
        factors = adam.factors(s.count)
        for k in g:
            if step % 2:
                mu_out, nu_out = mu[k], nu[k]
            else:
                mu_out, nu_out = torch.empty_like(mu[k]), torch.empty_like(nu[k])
            r = adam.step(g[k], mu[k], nu[k], mu_out, nu_out, torch.empty_like(nu[k]), factors)
            mu[k], nu[k] = mu_out, nu_out
            for x, y in ((r, u[k]), (mu[k], s.mu[k]), (nu[k], s.nu[k])):
                assert x.dtype == y.dtype
                torch.testing.assert_close(x, y, rtol=0, atol=0)
        g = {k: v * 0.5 + 0.1 for k, v in g.items()}
    assert getattr(ft.scale_by_adam(amsgrad=True).update, "leafwise", None) is None
    assert getattr(ft.scale_by_adam(optim_bits=8).update, "leafwise", None) is None


def test_prefix_labels_equal_the_full_labels():
    """``labels`` may be a prefix of the params tree (a label for a subtree applies to each of
    its leaves, as optax's ``partition``): two steps bit for bit the full tree's."""
    gen = torch.Generator().manual_seed(3)
    params = {
        "enc": {"w": torch.randn(6, 4, generator=gen), "b": torch.randn(6, generator=gen)},
        "dec": {"w": torch.randn(5, 4, generator=gen), "v": torch.randn(5, 3, generator=gen)},
    }
    full = {"enc": {"w": "no_decay", "b": "no_decay"}, "dec": {"w": "galore", "v": "galore"}}
    runs = []
    for labels in (full, {"enc": "no_decay", "dec": "galore"}):
        tx = ft.galore_adamw(1e-2, rank=2, update_proj_gap=1, labels=labels)
        p, s = params, tx.init(params)
        for t in range(2):
            g = {
                k: {n: torch.full_like(x, 0.1 * (t + 1)) + x for n, x in v.items()}
                for k, v in p.items()
            }
            p, s = ft.step(tx, g, s, p)
        runs.append(p)
    for k in params:
        for n in params[k]:
            assert torch.equal(runs[0][k][n], runs[1][k][n]), (k, n)
    with pytest.raises(ValueError, match="galore_adamw: labels"):
        ft.galore_adamw(1e-2, labels={"enc": "no_decay"}).init(params)
