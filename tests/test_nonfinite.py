"""Non-finite gradients: ``apply_if_finite`` and ``zero_nans`` against optax (float64), the skip
decision global and free of extra collectives where a clip runs, and ``dynamic_loss_scale``
against ``torch.amp.GradScaler`` + ``torch.optim.AdamW`` in float16 autocast."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import functional_train as ft
from _layouts import close, step_by_mode  # noqa: E402
from functional_train.testing import (
    assert_sharded_equivalent,
    count_collectives,
    on_rank,
    per_rank,
    simulate,
)

NAN, INF = float("nan"), float("inf")


def _problem(steps=9, bad=None, dtype=torch.float64):
    """Params {w (5, 3), b (4,)} and ``steps`` gradient trees; ``bad[t] = (leaf, index, value)``
    poisons step ``t``."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(5, 3, generator=gen, dtype=dtype),
        "b": torch.randn(4, generator=gen, dtype=dtype),
    }
    grads = []
    for t in range(steps):
        g = {k: torch.randn(v.shape, generator=gen, dtype=dtype) for k, v in params.items()}
        for leaf, idx, val in (bad or {}).get(t, []):
            g[leaf][idx] = val
        grads.append(g)
    return params, grads


# steps 1, 3, 4, 5 non-finite: with max_consecutive_errors=2 step 5 (the third in a row) is
# applied anyway and poisons the parameters, as in optax
_BAD = {
    1: [("w", (2, 1), NAN)],
    3: [("b", (0,), INF)],
    4: [("w", (0, 0), -INF)],
    5: [("b", (3,), NAN), ("w", (4, 2), INF)],
}


def _torch_clip(lib, max_norm):
    """``clip_by_global_norm`` with torch's factor ``min(1, max_norm / (norm + 1e-6))`` (ours;
    optax's is ``max_norm / max(norm, max_norm)``) for the optax side of a comparison."""
    if lib is ft:
        return ft.clip_by_global_norm(max_norm)
    import jax
    import jax.numpy as jnp
    import optax

    def update(u, s, params=None):
        coef = jnp.minimum(1.0, max_norm / (optax.tree.norm(u) + 1e-6))
        return jax.tree.map(lambda g: g * coef, u), s

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _optax_run(make, params, grads):
    import jax.numpy as jnp
    import optax

    tx = make(optax)
    p = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    s = tx.init(p)
    out = []
    for g in grads:
        u, s = tx.update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, s, p)
        p = optax.apply_updates(p, u)
        out.append(({k: np.asarray(v) for k, v in p.items()}, s))
    return out


_OPTAX_RUNS: dict = {}


@pytest.mark.parametrize("clip", [False, True], ids=["adamw", "clip+adamw"])
@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
def test_apply_if_finite_equals_optax(clip, mode, x64):
    params, grads = _problem(bad=_BAD)

    def make(lib):
        inner = lib.adamw(1e-2, weight_decay=0.1)
        if clip:
            inner = lib.chain(_torch_clip(lib, 1.0), inner)
        return lib.apply_if_finite(inner, 2)

    want = _OPTAX_RUNS.get(clip)  # (optax's run depends on the chain only: once per chain)
    if want is None:
        want = _OPTAX_RUNS[clip] = _optax_run(make, params, grads)
    tx = make(ft)
    state, p = tx.init(params), {k: v.clone() for k, v in params.items()}
    for t, g in enumerate(grads):
        g = {k: v.clone() for k, v in g.items()}
        p, state = step_by_mode(tx, g, state, p, mode)
        wp, ws = want[t]
        for k in p:
            np.testing.assert_allclose(
                p[k].numpy(), wp[k], rtol=1e-12, atol=1e-14, err_msg=f"step {t}, {k}"
            )
        assert int(state.notfinite_count) == int(ws.notfinite_count), t
        assert bool(state.last_finite) == bool(ws.last_finite), t
        assert int(state.total_notfinite) == int(ws.total_notfinite), t
    assert int(state.total_notfinite) == 4 and bool(torch.isnan(p["b"]).any())


def test_skipped_step_leaves_inner_state_and_params_unchanged():
    params, grads = _problem(steps=3, bad={1: [("w", (0, 0), NAN)]}, dtype=torch.float32)
    tx = ft.apply_if_finite(ft.chain(ft.clip_by_global_norm(1.0), ft.adam(1e-2)), 5)
    s0 = tx.init(params)
    u, s1 = tx.update(grads[0], s0, params)
    p1 = ft.apply_updates(params, u)
    u, s2 = tx.update(grads[1], s1, p1)
    assert all(torch.equal(x, torch.zeros_like(x)) for x in u.values())
    assert torch.equal(ft.apply_updates(p1, u)["w"], p1["w"])
    for a, b in zip(
        torch.utils._pytree.tree_leaves(s2.inner_state[1]),
        torch.utils._pytree.tree_leaves(s1.inner_state[1]),
    ):
        assert torch.equal(a, b)
    assert int(s2.notfinite_count) == 1 and not bool(s2.last_finite)
    # the whole inner state is kept, the clip's norm included (as optax keeps it)
    assert float(ft.tree_get(s2, "global_norm")) == float(ft.tree_get(s1, "global_norm"))


def test_zero_nans_equals_optax(x64):
    import optax

    params, grads = _problem(steps=2, bad={0: [("w", (1, 1), NAN), ("b", (2,), INF)]})
    tx = ft.zero_nans()
    s = tx.init(params)
    u, s = tx.update(grads[0], s, params)
    ref_tx = optax.zero_nans()
    import jax.numpy as jnp

    ru, rs = ref_tx.update(
        {k: jnp.asarray(v.numpy()) for k, v in grads[0].items()},
        ref_tx.init({k: jnp.asarray(v.numpy()) for k, v in params.items()}),
    )
    for k in u:
        np.testing.assert_array_equal(u[k].numpy(), np.asarray(ru[k]))
        assert bool(s.found_nan[k]) == bool(rs.found_nan[k])
    assert bool(s.found_nan["w"]) and not bool(s.found_nan["b"])
    _, s = tx.update(grads[1], s, params)
    assert not bool(s.found_nan["w"])


# ---------------------------------------------------------------------------------------------
# sharded: a NaN on one rank's shard makes every rank skip
# ---------------------------------------------------------------------------------------------
def _sharded_problem():
    gen = torch.Generator().manual_seed(3)
    params = {
        "a": torch.randn(7, 5, generator=gen),
        "b": torch.randn(3, 6, generator=gen),
        "c": torch.randn(4, generator=gen),
    }
    grads = []
    for t in range(5):
        g = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        if t == 1:
            g["a"][6, 4] = NAN  # the last rows: one rank's shard only
        if t == 2:
            g["b"][0, 5] = INF
        grads.append(g)
    return params, grads


_PLACEMENTS = {"a": [Shard(0), Shard(1)], "b": [Replicate(), Shard(1)], "c": None}


@pytest.mark.parametrize("inner", ["adamw", "clip+adamw", "lamb"])
@pytest.mark.parametrize("step", [None, "pure"])
def test_apply_if_finite_sharded_equals_unsharded(inner, step):
    params, grads = _sharded_problem()
    make = {
        "adamw": lambda: ft.adamw(1e-2, weight_decay=0.1),
        "clip+adamw": lambda: ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2)),
        "lamb": lambda: ft.lamb(1e-2, weight_decay=0.1),
    }[inner]
    assert_sharded_equivalent(
        ft.apply_if_finite(make(), 3),
        params,
        grads,
        placements=_PLACEMENTS,
        mesh_shape=(2, 2),
        step=step,
    )


def test_dynamic_loss_scale_sharded_equals_unsharded():
    params, grads = _sharded_problem()
    grads = [{k: v * 1024 for k, v in g.items()} for g in grads]
    tx = ft.dynamic_loss_scale(ft.adamw(1e-2), init_scale=1024.0, growth_interval=2)
    assert_sharded_equivalent(
        tx, params, grads, placements=_PLACEMENTS, mesh_shape=(2, 2), data_axis="d0"
    )


@pytest.mark.parametrize("clip", [False, True])
def test_apply_if_finite_collectives(clip):
    """One scalar all-reduce decides for every rank; none more where the clip's norm does."""
    with simulate(4):
        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        gen = torch.Generator().manual_seed(0)
        vals = [torch.randn(6, 4, generator=gen) for _ in range(12)]
        params = {
            f"l{i}": distribute_tensor(
                per_rank(4, lambda r, v=v: v),
                m,
                [Shard(0), Shard(1)] if i % 2 else [Replicate(), Shard(0)],
                src_data_rank=None,
            )
            for i, v in enumerate(vals)
        }

        # leaf 3 is Shard(0), Shard(1): its element [5, 3] lives on rank 3 alone
        gvals = [v * 0.1 for v in vals]
        gvals[3][5, 3] = NAN
        grads = {
            f"l{i}": distribute_tensor(
                per_rank(4, lambda r, v=v: v), m, params[f"l{i}"].placements, src_data_rank=None
            )
            for i, v in enumerate(gvals)
        }
        inner = ft.adamw(1e-2)
        if clip:
            inner = ft.chain(ft.clip_by_global_norm(1.0), inner)
        tx = ft.apply_if_finite(inner, 3)
        state = tx.init(params)
        with count_collectives() as c:
            u, state = tx.update(grads, state, params, mesh=ft.Mesh(m))
        finite = [bool(on_rank(state.last_finite, r)) for r in range(4)]
        zeros = [bool((on_rank(u[k]._local_tensor, r) == 0).all()) for k in u for r in range(4)]
    assert c.counts == {"all_reduce": 1}, c
    assert finite == [False] * 4 and all(zeros)


@pytest.mark.parametrize("step", [None, "pure", "donate"])
def test_zero_nans_sharded_equals_unsharded(step):
    """``chain(zero_nans, adamw)`` on a simulated 2 x 2 mesh, a NaN on one rank's shard: the
    flags (state) and the numbers equal the unsharded run's at every step."""
    params, grads = _sharded_problem()
    tx = ft.chain(ft.zero_nans(), ft.clip_by_global_norm(1.0), ft.adamw(1e-2))
    assert_sharded_equivalent(
        tx, params, grads, placements=_PLACEMENTS, mesh_shape=(2, 2), step=step
    )


@pytest.mark.parametrize("with_step", [False, True])
def test_zero_nans_flags_collectives(with_step):
    """The per-leaf NaN flags: ONE all-reduce for every leaf (a NaN on one rank's shard of a
    leaf flags that leaf on every rank, and no other); none more in ``ft.step`` with a clip
    (its norm's all-reduce is the second)."""
    with simulate(4):
        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        gen = torch.Generator().manual_seed(0)
        vals = [torch.randn(6, 4, generator=gen) for _ in range(12)]
        lay = lambda i: [Shard(0), Shard(1)] if i % 2 else [Replicate(), Shard(0)]  # noqa: E731
        params = {
            f"l{i}": distribute_tensor(per_rank(4, lambda r, v=v: v), m, lay(i), src_data_rank=None)
            for i, v in enumerate(vals)
        }
        gvals = [v * 0.1 for v in vals]
        gvals[3][5, 3] = NAN  # (leaf 3 is Shard(0), Shard(1): element [5, 3] on rank 3 alone)
        gvals[4][0, 0] = INF
        grads = {
            f"l{i}": distribute_tensor(per_rank(4, lambda r, v=v: v), m, lay(i), src_data_rank=None)
            for i, v in enumerate(gvals)
        }
        tx = ft.chain(ft.zero_nans(), ft.clip_by_global_norm(1.0), ft.adamw(1e-2))
        state = tx.init(params)
        with count_collectives() as c:
            if with_step:
                _, state = ft.step(tx, grads, state, params, mesh=ft.Mesh(m), donate=True)
            else:
                _, state = tx.update(grads, state, params, mesh=ft.Mesh(m))
        flags = {k: [bool(on_rank(f, r)) for r in range(4)] for k, f in state[0].found_nan.items()}
    assert c.counts == {"all_reduce": 2}, c
    assert flags == {f"l{i}": [i == 3] * 4 for i in range(12)}


# ---------------------------------------------------------------------------------------------
# dynamic loss scaling against torch.amp.GradScaler
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["update", "donate"])
def test_dynamic_loss_scale_matches_grad_scaler(mode):
    """float16 autocast training of a small MLP: the scale, the growth tracker and every skip
    decision equal torch's, and the parameters agree to float32 rounding (torch's AdamW and
    this one order their float32 operations differently)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**21, growth_interval=3)
    tx = ft.dynamic_loss_scale(
        ft.adamw(1e-2, weight_decay=0.1), init_scale=2.0**21, growth_interval=3
    )
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    p0 = {k: v.clone() for k, v in params.items()}
    state = tx.init(params)

    def loss_of(m, p, x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x) if p is None else torch.func.functional_call(m, p, (x,))
            return torch.nn.functional.mse_loss(out.float(), y)

    skipped = 0
    gen = torch.Generator().manual_seed(1)
    for t in range(14):
        x = torch.randn(32, 8, generator=gen) * (100.0 if t == 7 else 1.0)
        y = torch.randn(32, 4, generator=gen)
        opt.zero_grad()
        scaler.scale(loss_of(ref, None, x, y)).backward()
        scaler.step(opt)
        torch_skipped = scaler._found_inf_per_device(opt)[torch.device("cpu")].item() > 0
        scaler.update()
        g = torch.func.grad(lambda p: loss_of(model, p, x, y) * ft.loss_scale(state))(params)
        params, state = step_by_mode(tx, g, state, params, mode)  # ("donate")
        assert float(state.scale) == scaler.get_scale(), t
        assert int(state.growth_tracker) == int(scaler._growth_tracker), t
        assert bool(state.last_finite) == (not torch_skipped), t
        skipped += torch_skipped
        for k, v in ref.named_parameters():
            torch.testing.assert_close(
                params[k] - p0[k], v.detach() - p0[k], rtol=1e-5, atol=1e-6, msg=f"step {t}, {k}"
            )
    assert 2 <= skipped <= 10 and int(state.total_notfinite) == skipped


@pytest.mark.parametrize("growth, backoff", [(1.1, 0.3), (3.0, 0.7)])
@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
def test_dynamic_loss_scale_updates_equal_grad_scaler_bitwise(growth, backoff, mode):
    """Factors that float32 does not hold exactly (1.1, 0.3, 0.7): over 50 steps whose scale
    changes at every step (growth_interval=1, a non-finite gradient every third step), the
    scale equals ``GradScaler``'s bit for bit (torch multiplies in float64 and rounds once),
    as do the growth tracker, the skip decisions and SGD's parameters."""
    shape = (3, 4)
    ref = torch.nn.Parameter(torch.zeros(shape))
    opt = torch.optim.SGD([ref], lr=0.1)
    kw = dict(init_scale=1024.0, growth_factor=growth, backoff_factor=backoff, growth_interval=1)
    scaler = torch.amp.GradScaler("cpu", **kw)
    tx = ft.dynamic_loss_scale(ft.sgd(0.1), **kw)
    params = {"w": torch.zeros(shape)}
    state = tx.init(params)
    gen = torch.Generator().manual_seed(0)
    for t in range(50):
        g = torch.randn(shape, generator=gen) * float(scaler.scale(torch.ones(())))
        if t % 3 == 2:
            g[t % 3, t % 4] = INF if t % 2 else NAN
        ref.grad = g.clone()
        scaler.step(opt)
        scaler.update()
        params, state = step_by_mode(tx, {"w": g}, state, params, mode)
        want = torch.tensor(scaler.get_scale(), dtype=torch.float32)
        assert torch.equal(state.scale, want), (t, state.scale.item(), want.item())
        assert int(state.growth_tracker) == int(scaler._growth_tracker), t
        assert bool(state.last_finite) == (t % 3 != 2), t
        close(params["w"], ref, rtol=1e-6, atol=0.0, what=f"step {t}: params")


def test_loss_scale_reads_the_state():
    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.dynamic_loss_scale(ft.sgd(0.1), init_scale=8.0))
    s = tx.init({"w": torch.zeros(2)})
    assert float(ft.loss_scale(s)) == 8.0
    with pytest.raises(ValueError, match="DynamicLossScaleState"):
        ft.loss_scale(ft.adamw().init({"w": torch.zeros(2)}))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(init_scale=0.0), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
    ],
)
def test_dynamic_loss_scale_rejects_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        ft.dynamic_loss_scale(ft.sgd(0.1), **bad)


def test_apply_if_finite_rejects_bad_arguments():
    with pytest.raises(TypeError, match="inner"):
        ft.apply_if_finite(lambda g: g, 1)
    with pytest.raises(ValueError, match="max_consecutive_errors"):
        ft.apply_if_finite(ft.sgd(0.1), -1)
    tx = ft.apply_if_finite(ft.sgd(0.1), 1)
    with pytest.raises(ValueError, match="ApplyIfFiniteState"):
        tx.update({"w": torch.zeros(2)}, ft.sgd(0.1).init({"w": torch.zeros(2)}))


# ---------------------------------------------------------------------------------------------
# multi_steps(should_skip_update_fn=...) against optax.MultiSteps
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["skip_not_finite", "skip_large_updates"])
def test_multi_steps_skip_functions_equal_optax(which, x64):
    import functools

    import jax.numpy as jnp
    import optax

    params, grads = _problem(steps=9)
    # on a 2**-10 grid the mean of two micro-gradients is exact on both sides (optax averages
    # incrementally, we sum then divide: otherwise 1-ulp differences of nearly cancelling
    # means, amplified by Adam's normalisation)
    grads = [{k: torch.round(v * 1024) / 1024 for k, v in g.items()} for g in grads]
    grads[2]["w"][1, 1], grads[5]["b"][0] = NAN, INF
    grads[6] = {k: v * 10 for k, v in grads[6].items()}  # a large one
    if which == "skip_not_finite":
        ours, theirs = ft.skip_not_finite, optax.skip_not_finite
    else:
        ours = functools.partial(ft.skip_large_updates, max_squared_norm=60.0)
        theirs = functools.partial(optax.skip_large_updates, max_squared_norm=60.0)
    tx = ft.multi_steps(ft.adamw(1e-2), 2, should_skip_update_fn=ours)
    ref = optax.MultiSteps(optax.adamw(1e-2, weight_decay=1e-2), 2, should_skip_update_fn=theirs)
    s, rs = tx.init(params), ref.init({k: jnp.asarray(v.numpy()) for k, v in params.items()})
    p, rp = dict(params), {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    skipped = 0
    for t, g in enumerate(grads):
        u, s = tx.update(g, s, p)
        p = ft.apply_updates(p, u)
        ru, rs = ref.update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, rs, rp)
        rp = optax.apply_updates(rp, ru)
        for k in p:
            np.testing.assert_allclose(
                p[k].numpy(), np.asarray(rp[k]), rtol=1e-12, atol=1e-14, err_msg=f"step {t}, {k}"
            )
        for k, v in s.skip_state.items():
            np.testing.assert_allclose(v.numpy(), np.asarray(rs.skip_state[k]), rtol=1e-12)
        skipped += bool(s.skip_state["should_skip"])
        assert int(s.gradient_step) == int(rs.gradient_step), t
    assert skipped >= 2


@pytest.mark.parametrize("which", ["skip_not_finite", "skip_large_updates"])
@pytest.mark.parametrize("data_axis", [None, "d0"])
def test_multi_steps_skip_functions_sharded_equal_unsharded(which, data_axis):
    """``multi_steps(adamw, 2, should_skip_update_fn=...)`` on a simulated 2 x 2 mesh (uneven
    shards, a NaN and an Inf in one rank's shard, a large gradient), with and without a data
    axis: the skip decisions, the parameters and the states equal one process's, on every
    rank (every rank sees the global gradient's finiteness / norm). Under the data axis the
    accumulator holds each replica's own contribution by design (no collective on non-final
    micro-steps), so it alone is not compared there."""
    import functools

    params, grads = _sharded_problem()
    grads = grads + [{k: v * 30 for k, v in grads[0].items()}]  # the large one
    fn = (
        ft.skip_not_finite
        if which == "skip_not_finite"
        else functools.partial(ft.skip_large_updates, max_squared_norm=400.0)
    )
    tx = ft.multi_steps(ft.adamw(1e-2), 2, should_skip_update_fn=fn)
    state, skipped = tx.init(params), 0  # the problem does make it skip (in one process)
    for g in grads:
        _, state = tx.update(g, state, params)
        skipped += bool(state.skip_state["should_skip"])
    assert skipped >= 2
    assert_sharded_equivalent(
        tx,
        params,
        grads,
        placements=_PLACEMENTS,
        mesh_shape=(2, 2),
        data_axis=data_axis,
        ignore_state=(lambda path: "acc_grads" in path) if data_axis else None,
    )
