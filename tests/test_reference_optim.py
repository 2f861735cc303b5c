"""Single-process reference tests: ft.sgd / ft.adam / ft.adamw against torch.optim.

Plain tensors, ``mesh=None``. Several steps on a nested params dict of non-rank-1 leaves (a matrix,
a rank-3 tensor, a vector and a 0-dim scalar), random gradients with a fixed seed. We compare the
parameter *change* with a relative tolerance and assert on the optimizer states.
"""

from __future__ import annotations

import optree
import pytest
import torch

import functional_train as ft

STEPS = 6
SHAPES = {"layer": {"w": (4, 3), "t": (2, 3, 5)}, "v": (7,), "s": ()}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _is_shape(x):
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return optree.tree_map(
        lambda s: torch.randn(s, generator=gen).to(dtype), SHAPES, is_leaf=_is_shape
    )


def make_grads(params, steps=STEPS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        optree.tree_map(lambda p: torch.randn(p.shape, generator=gen).to(p.dtype), params)
        for _ in range(steps)
    ]


def leaves(tree):
    return optree.tree_leaves(tree, none_is_leaf=True)


def find_states(tree, cls):
    """Every NamedTuple state of type ``cls`` nested in ``tree``."""
    out = []

    def visit(node):
        if isinstance(node, cls):
            out.append(node)
        elif isinstance(node, (tuple, list)):
            for c in node:
                visit(c)
        elif isinstance(node, dict):
            for c in node.values():
                visit(c)

    visit(tree)
    return out


def one_state(tree, cls):
    found = find_states(tree, cls)
    assert len(found) == 1, f"expected exactly one {cls.__name__}, found {len(found)}"
    return found[0]


def run_ours(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = ft.apply_updates(params, updates)
    return params, state


def run_torch(opt_cls, params, grads, opt_kwargs, lr_per_step=None, lambda_lr=None):
    """Run ``opt_cls`` on clones of ``params``; returns (params tree, {leaf index: state})."""
    p_leaves, treedef = optree.tree_flatten(params)
    tp = [p.detach().clone().requires_grad_(True) for p in p_leaves]
    opt = opt_cls(tp, **opt_kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_lr) if lambda_lr is not None else None
    for i, g in enumerate(grads):
        for p, gl in zip(tp, optree.tree_leaves(g)):
            p.grad = gl.detach().clone()
        if lr_per_step is not None:
            for group in opt.param_groups:
                group["lr"] = lr_per_step(i)
        opt.step()
        if sched is not None:
            sched.step()
    states = [opt.state[p] for p in tp]
    return optree.tree_unflatten(treedef, [p.detach() for p in tp]), states


def ulp(x):
    """Spacing of floating point numbers at ``|x|`` (elementwise)."""
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def assert_change_close(ours, theirs, p0, rtol=1e-5, atol=1e-7, steps=STEPS):
    """Relative tolerance on the parameter change ``p_after - p0``.

    Both runs store their parameters in the parameters' dtype after every step, which rounds each
    by up to half an ulp of the parameter (not of the change); that unavoidable storage rounding,
    ``steps`` ulps of the largest magnitude the element took, is allowed on top of
    ``rtol * |change| + atol``.
    """
    for a, b, p in zip(leaves(ours), leaves(theirs), leaves(p0)):
        assert a.dtype == b.dtype == p.dtype and a.shape == b.shape == p.shape
        da, db = (a - p).double(), (b - p).double()
        mag = torch.maximum(torch.maximum(a.abs(), b.abs()), p.abs())
        bound = rtol * db.abs() + atol + steps * ulp(mag).double()
        err = (da - db).abs()
        bad = err > bound
        assert not bad.any(), (
            f"parameter change differs from torch at {int(bad.sum())}/{bad.numel()} elements: "
            f"max |diff| {float(err.max()):.3g}, max |diff|/|change| "
            f"{float((err / db.abs().clamp_min(1e-30)).max()):.3g}\nours  {da}\ntheirs {db}"
        )


def assert_leaves_close(ours_tree, theirs_list, rtol=1e-5, atol=1e-7):
    ours = leaves(ours_tree)
    assert len(ours) == len(theirs_list)
    for a, b in zip(ours, theirs_list):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=rtol, atol=atol)


def assert_count(count, n):
    assert isinstance(count, torch.Tensor) and count.dim() == 0
    assert count.dtype == torch.int64
    assert int(count) == n


def torch_adam_kwargs(kw):
    """ft keyword arguments -> torch.optim keyword arguments (b1, b2 -> betas)."""
    kw = dict(kw)
    out = {}
    if "learning_rate" in kw:
        out["lr"] = kw.pop("learning_rate")
    if "b1" in kw or "b2" in kw:
        out["betas"] = (kw.pop("b1", 0.9), kw.pop("b2", 0.999))
    out.update(kw)
    return out


def torch_sgd_kwargs(kw):
    kw = dict(kw)
    if "learning_rate" in kw:
        kw["lr"] = kw.pop("learning_rate")
    return kw


# ---------------------------------------------------------------------------------------------
# SGD
# ---------------------------------------------------------------------------------------------
SGD_CASES = [
    {},  # torch defaults: lr=1e-3, no momentum
    {"learning_rate": 0.1},
    {"learning_rate": 0.1, "momentum": 0.9},
    {"learning_rate": 0.1, "momentum": 0.9, "dampening": 0.5},
    {"learning_rate": 0.1, "momentum": 0.9, "dampening": 1.0},
    {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
    {"learning_rate": 0.1, "weight_decay": 0.1},
    {"learning_rate": 0.1, "maximize": True},
    {"momentum": 0.5},  # default lr with momentum
    {
        "learning_rate": 0.05,
        "momentum": 0.8,
        "weight_decay": 0.2,
        "nesterov": True,
        "maximize": True,
    },
    {
        "learning_rate": 0.05,
        "momentum": 0.7,
        "dampening": 0.3,
        "weight_decay": 0.05,
        "maximize": True,
    },
]


@pytest.mark.parametrize(
    "kw", SGD_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults"
)
def test_sgd_matches_torch(kw):
    params = make_params()
    grads = make_grads(params)
    ours, state = run_ours(ft.sgd(**kw), params, grads)
    theirs, tstates = run_torch(torch.optim.SGD, params, grads, torch_sgd_kwargs(kw))
    assert_change_close(ours, theirs, params)
    traces = find_states(state, ft.TraceState)
    if kw.get("momentum", 0.0):
        (tr,) = traces
        assert_count(tr.count, STEPS)
        assert_leaves_close(tr.trace, [s["momentum_buffer"] for s in tstates])
        assert all(x.dtype == torch.float32 for x in leaves(tr.trace))
    else:
        assert traces == []
        assert all(s.get("momentum_buffer") is None for s in tstates)


def test_sgd_defaults_equal_torch_defaults():
    import inspect

    sig = inspect.signature(torch.optim.SGD.__init__).parameters
    ours = inspect.signature(ft.sgd).parameters
    assert ours["learning_rate"].default == sig["lr"].default
    for name in ("momentum", "dampening", "weight_decay", "nesterov", "maximize"):
        assert ours[name].default == sig[name].default, name


# ---------------------------------------------------------------------------------------------
# Adam
# ---------------------------------------------------------------------------------------------
ADAM_CASES = [
    {},  # torch defaults
    {"learning_rate": 0.01},
    {"learning_rate": 0.01, "b1": 0.8, "b2": 0.99},
    {"learning_rate": 0.01, "b1": 0.0, "b2": 0.9},
    {"learning_rate": 0.01, "eps": 1e-3},
    {"learning_rate": 0.01, "weight_decay": 0.1},
    {"learning_rate": 0.01, "amsgrad": True},
    {"learning_rate": 0.01, "maximize": True},
    {"learning_rate": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True},
    {
        "learning_rate": 0.02,
        "b1": 0.85,
        "b2": 0.95,
        "eps": 1e-6,
        "weight_decay": 0.05,
        "amsgrad": True,
        "maximize": True,
    },
    {
        "learning_rate": 0.02,
        "weight_decay": 0.3,
        "amsgrad": True,
        "maximize": True,
        "decoupled_weight_decay": True,
    },
]


def _ids(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults"


def _check_adam_state(state, tstates, amsgrad):
    cls = ft.ScaleByAmsgradState if amsgrad else ft.ScaleByAdamState
    st = one_state(state, cls)
    assert_count(st.count, STEPS)
    assert_leaves_close(st.mu, [s["exp_avg"] for s in tstates])
    assert_leaves_close(st.nu, [s["exp_avg_sq"] for s in tstates])
    if amsgrad:
        assert_leaves_close(st.nu_max, [s["max_exp_avg_sq"] for s in tstates])
    for s in tstates:
        assert float(s["step"]) == STEPS


@pytest.mark.parametrize("kw", ADAM_CASES, ids=_ids)
def test_adam_matches_torch(kw):
    params = make_params()
    grads = make_grads(params)
    ours, state = run_ours(ft.adam(**kw), params, grads)
    theirs, tstates = run_torch(torch.optim.Adam, params, grads, torch_adam_kwargs(kw))
    assert_change_close(ours, theirs, params)
    _check_adam_state(state, tstates, kw.get("amsgrad", False))


def test_adam_defaults_equal_torch_defaults():
    import inspect

    sig = inspect.signature(torch.optim.Adam.__init__).parameters
    ours = inspect.signature(ft.adam).parameters
    assert ours["learning_rate"].default == sig["lr"].default
    assert (ours["b1"].default, ours["b2"].default) == sig["betas"].default
    for name in ("eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"):
        assert ours[name].default == sig[name].default, name


# ---------------------------------------------------------------------------------------------
# AdamW
# ---------------------------------------------------------------------------------------------
ADAMW_CASES = [
    {},  # torch defaults (weight_decay=1e-2)
    {"learning_rate": 0.01},
    {"learning_rate": 0.01, "b1": 0.8, "b2": 0.99},
    {"learning_rate": 0.01, "eps": 1e-3},
    {"learning_rate": 0.01, "weight_decay": 0.0},
    {"learning_rate": 0.01, "weight_decay": 0.5},
    {"learning_rate": 0.01, "amsgrad": True},
    {"learning_rate": 0.01, "maximize": True},
    {
        "learning_rate": 0.02,
        "b1": 0.85,
        "b2": 0.95,
        "eps": 1e-6,
        "weight_decay": 0.2,
        "amsgrad": True,
        "maximize": True,
    },
]


@pytest.mark.parametrize("kw", ADAMW_CASES, ids=_ids)
def test_adamw_matches_torch(kw):
    params = make_params()
    grads = make_grads(params)
    ours, state = run_ours(ft.adamw(**kw), params, grads)
    theirs, tstates = run_torch(torch.optim.AdamW, params, grads, torch_adam_kwargs(kw))
    assert_change_close(ours, theirs, params)
    _check_adam_state(state, tstates, kw.get("amsgrad", False))


def test_adamw_defaults_equal_torch_defaults():
    import inspect

    sig = inspect.signature(torch.optim.AdamW.__init__).parameters
    ours = inspect.signature(ft.adamw).parameters
    assert ours["learning_rate"].default == sig["lr"].default
    assert (ours["b1"].default, ours["b2"].default) == sig["betas"].default
    for name in ("eps", "weight_decay", "amsgrad", "maximize"):
        assert ours[name].default == sig[name].default, name


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_decoupled_equals_adamw(wd):
    params = make_params()
    grads = make_grads(params)
    a, _ = run_ours(ft.adam(0.01, weight_decay=wd, decoupled_weight_decay=True), params, grads)
    b, _ = run_ours(ft.adamw(0.01, weight_decay=wd), params, grads)
    for x, y in zip(leaves(a), leaves(b)):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# schedules as learning rates
# ---------------------------------------------------------------------------------------------
SCHEDULE = ft.schedules.warmup_cosine_decay_schedule(0.0, 0.05, 2, STEPS, end_value=0.005)

SCHEDULED = [
    ("sgd", ft.sgd, torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
    ("sgd_nesterov", ft.sgd, torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    ("adam", ft.adam, torch.optim.Adam, {"weight_decay": 0.1}),
    (
        "adam_decoupled",
        ft.adam,
        torch.optim.Adam,
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
    ),
    ("adamw", ft.adamw, torch.optim.AdamW, {"weight_decay": 0.3, "amsgrad": True}),
]


@pytest.mark.parametrize("how", ["lambda_lr", "set_lr"])
@pytest.mark.parametrize("name,ours_fn,torch_cls,kw", SCHEDULED, ids=[s[0] for s in SCHEDULED])
def test_schedule_learning_rate_matches_torch(name, ours_fn, torch_cls, kw, how):
    params = make_params()
    grads = make_grads(params)
    ours, state = run_ours(ours_fn(SCHEDULE, **kw), params, grads)
    tkw = torch_sgd_kwargs(kw) if torch_cls is torch.optim.SGD else torch_adam_kwargs(kw)
    if how == "lambda_lr":
        # LambdaLR sets lr = base_lr * lambda(epoch), epoch 0 before the first step
        theirs, _ = run_torch(
            torch_cls, params, grads, dict(tkw, lr=1.0), lambda_lr=lambda i: float(SCHEDULE(i))
        )
    else:
        theirs, _ = run_torch(
            torch_cls, params, grads, dict(tkw, lr=1.0), lr_per_step=lambda i: float(SCHEDULE(i))
        )
    assert_change_close(ours, theirs, params)
    sched_state = one_state(state, ft.ScaleByScheduleState)
    assert_count(sched_state.count, STEPS)


def test_schedule_first_step_uses_count_zero():
    # init_value 0 at count 0: the first update must not move the parameters at all
    params = make_params()
    grads = make_grads(params, steps=1)
    sched = ft.schedules.linear_schedule(0.0, 1.0, 4)
    for tx in (ft.sgd(sched), ft.adam(sched), ft.adamw(sched, weight_decay=0.5)):
        new, _ = run_ours(tx, params, grads)
        for a, b in zip(leaves(new), leaves(params)):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# low precision parameters: float32 states by default
# ---------------------------------------------------------------------------------------------
def test_bf16_adam_states_float32_and_match_torch_fp32():
    params = make_params(torch.bfloat16)
    grads = make_grads(params)
    tx = ft.adam(0.01)
    state = tx.init(params)
    st0 = one_state(state, ft.ScaleByAdamState)
    assert all(x.dtype == torch.float32 for x in leaves(st0.mu) + leaves(st0.nu))
    f32 = optree.tree_map(lambda p: p.float(), params)
    f32_grads = [optree.tree_map(lambda g: g.float(), g) for g in grads]
    ref_tx = ft.adam(0.01)
    ref_state = ref_tx.init(f32)
    for g, g32 in zip(grads, f32_grads):
        updates, state = tx.update(g, state, params)
        ref_updates, ref_state = ref_tx.update(g32, ref_state, f32)
        assert all(u.dtype == torch.bfloat16 for u in leaves(updates))
        for u, r in zip(leaves(updates), leaves(ref_updates)):
            torch.testing.assert_close(u.float(), r, rtol=1.6e-2, atol=1e-5)
        params = ft.apply_updates(params, updates)
        f32 = ft.apply_updates(f32, ref_updates)
        assert all(p.dtype == torch.bfloat16 for p in leaves(params))
    st = one_state(state, ft.ScaleByAdamState)
    assert all(x.dtype == torch.float32 for x in leaves(st.mu) + leaves(st.nu))
    # the moments only depend on the gradients (no weight decay): torch.optim.Adam in float32 on
    # the same (exactly upcast) gradients has the same moments
    _, tstates = run_torch(torch.optim.Adam, f32, f32_grads, {"lr": 0.01})
    assert_leaves_close(st.mu, [s["exp_avg"] for s in tstates])
    assert_leaves_close(st.nu, [s["exp_avg_sq"] for s in tstates])
    assert_count(st.count, STEPS)


def test_bf16_sgd_momentum_trace_float32_matches_torch_fp32():
    params = make_params(torch.bfloat16)
    grads = make_grads(params)
    tx = ft.sgd(0.1, momentum=0.9, dampening=0.1)
    _, state = run_ours(tx, params, grads)
    tr = one_state(state, ft.TraceState)
    assert all(x.dtype == torch.float32 for x in leaves(tr.trace))
    f32 = optree.tree_map(lambda p: p.float(), params)
    f32_grads = [optree.tree_map(lambda g: g.float(), g) for g in grads]
    _, tstates = run_torch(
        torch.optim.SGD, f32, f32_grads, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}
    )
    assert_leaves_close(tr.trace, [s["momentum_buffer"] for s in tstates])


@pytest.mark.parametrize(
    "make",
    [
        lambda: ft.adam(mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16),
        lambda: ft.adamw(mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16),
    ],
)
def test_lowered_state_dtypes(make):
    params = make_params(torch.bfloat16)
    grads = make_grads(params, steps=2)
    _, state = run_ours(make(), params, grads)
    st = one_state(state, ft.ScaleByAdamState)
    assert all(x.dtype == torch.bfloat16 for x in leaves(st.mu) + leaves(st.nu))


@pytest.mark.parametrize(
    "param_dtype, state_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_default_state_dtype_is_float32_or_wider(param_dtype, state_dtype):
    params = make_params(param_dtype)
    grads = make_grads(params, steps=2)
    _, state = run_ours(ft.adam(), params, grads)
    st = one_state(state, ft.ScaleByAdamState)
    assert all(x.dtype == state_dtype for x in leaves(st.mu) + leaves(st.nu))


# ---------------------------------------------------------------------------------------------
# purity: update modifies none of its inputs
# ---------------------------------------------------------------------------------------------
def _clone(tree):
    return optree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True
    )


def _assert_bitwise_equal(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


PURITY = [
    ("sgd", lambda: ft.sgd(0.1)),
    (
        "sgd_momentum",
        lambda: ft.sgd(0.1, momentum=0.9, dampening=0.2, weight_decay=0.1, maximize=True),
    ),
    ("sgd_nesterov", lambda: ft.sgd(0.1, momentum=0.9, nesterov=True)),
    ("adam", lambda: ft.adam(0.01, weight_decay=0.1)),
    ("adam_amsgrad", lambda: ft.adam(0.01, amsgrad=True, maximize=True)),
    ("adamw", lambda: ft.adamw(0.01, weight_decay=0.1)),
    ("adamw_schedule", lambda: ft.adamw(SCHEDULE, amsgrad=True)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,make", PURITY, ids=[p[0] for p in PURITY])
def test_update_is_pure(name, make, dtype):
    tx = make()
    params = make_params(dtype)
    grads = make_grads(params, steps=3)
    state = tx.init(params)
    for g in grads:
        p_c, g_c, s_c = _clone(params), _clone(g), _clone(state)
        updates, new_state = tx.update(g, state, params)
        _assert_bitwise_equal(params, p_c)
        _assert_bitwise_equal(g, g_c)
        _assert_bitwise_equal(state, s_c)
        # the same inputs give the same outputs (no hidden state)
        updates2, new_state2 = tx.update(g, state, params)
        _assert_bitwise_equal(updates, updates2)
        _assert_bitwise_equal(new_state, new_state2)
        p_before = _clone(params)
        u_before = _clone(updates)
        params_next = ft.apply_updates(params, updates)
        _assert_bitwise_equal(params, p_before)
        _assert_bitwise_equal(updates, u_before)
        params, state = params_next, new_state


def test_none_gradient_leaf_passes_through():
    params = make_params()
    grads = make_grads(params)
    for tx in (
        ft.sgd(0.1, momentum=0.9, weight_decay=0.1),
        ft.adam(0.01, weight_decay=0.1),
        ft.adamw(0.01, amsgrad=True),
    ):
        state = tx.init(params)
        p = params
        for g in grads:
            g = dict(g, v=None)
            updates, state = tx.update(g, state, p)
            assert updates["v"] is None
            p = ft.apply_updates(p, updates)
        assert torch.equal(p["v"], params["v"])
        assert not torch.equal(p["layer"]["w"], params["layer"]["w"])
