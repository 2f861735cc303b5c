"""Single-process reference tests: ft.schedules against their closed forms (optax semantics).

``count`` is the number of previous updates (0 on the first update). Schedules accept a Python int
or a 0-dim integer tensor and return a 0-dim float64 tensor.
"""

from __future__ import annotations

import math

import pytest
import torch

import functional_train as ft

S = ft.schedules
COUNTS = list(range(0, 25))


def as_counts(c):
    """The same count as a Python int, an int64 0-dim tensor and an int32 0-dim tensor."""
    return [c, torch.tensor(c, dtype=torch.int64), torch.tensor(c, dtype=torch.int32)]


def check(schedule, closed_form, counts=COUNTS):
    for c in counts:
        expected = closed_form(c)
        for cc in as_counts(c):
            v = schedule(cc)
            assert isinstance(v, torch.Tensor) and v.dim() == 0, type(v)
            assert v.dtype == torch.float64
            assert float(v) == pytest.approx(expected, rel=1e-12, abs=1e-15), (c, cc)


# ---------------------------------------------------------------------------------------------
# closed forms
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0.0, 3e-4, -2.0])
def test_constant_schedule(value):
    check(S.constant_schedule(value), lambda c: value)


def linear_closed(init, end, steps, begin):
    def f(c):
        if steps == 0:
            return init
        frac = min(max((c - begin) / steps, 0.0), 1.0)
        return init + frac * (end - init)

    return f


@pytest.mark.parametrize(
    "init,end,steps,begin",
    [
        (0.0, 1.0, 10, 0),
        (1.0, 0.1, 7, 3),
        (2e-3, 2e-3, 5, 0),
        (1.0, 0.0, 0, 0),
        (-1.0, 1.0, 1, 2),
    ],
)
def test_linear_schedule(init, end, steps, begin):
    check(S.linear_schedule(init, end, steps, begin), linear_closed(init, end, steps, begin))


def test_linear_schedule_endpoints():
    s = S.linear_schedule(0.5, 0.1, 8, transition_begin=2)
    assert float(s(0)) == 0.5 and float(s(2)) == 0.5
    assert float(s(10)) == pytest.approx(0.1) and float(s(1000)) == pytest.approx(0.1)


def cosine_closed(init, decay_steps, alpha, exponent):
    def f(c):
        t = min(c, decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * t / decay_steps))
        return init * ((1.0 - alpha) * cosine**exponent + alpha)

    return f


@pytest.mark.parametrize(
    "init,decay_steps,alpha,exponent",
    [
        (1.0, 10, 0.0, 1.0),
        (3e-4, 7, 0.1, 1.0),
        (0.1, 20, 0.0, 2.0),
        (0.5, 1, 0.5, 1.0),
    ],
)
def test_cosine_decay_schedule(init, decay_steps, alpha, exponent):
    check(
        S.cosine_decay_schedule(init, decay_steps, alpha, exponent),
        cosine_closed(init, decay_steps, alpha, exponent),
    )


def test_cosine_decay_schedule_defaults_and_endpoints():
    s = S.cosine_decay_schedule(0.2, 10)
    assert float(s(0)) == pytest.approx(0.2)
    assert float(s(5)) == pytest.approx(0.1)
    assert float(s(10)) == pytest.approx(0.0, abs=1e-15)
    assert float(s(50)) == pytest.approx(0.0, abs=1e-15)


def test_cosine_decay_matches_torch_cosine_annealing():
    lr0, T, eta_min = 0.1, 12, 0.01
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=T, eta_min=eta_min)
    ours = S.cosine_decay_schedule(lr0, T, alpha=eta_min / lr0)
    for c in range(T + 1):
        assert float(ours(c)) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-12)
        opt.step()
        sched.step()


def warmup_cosine_closed(init, peak, warmup, decay, end, exponent):
    def f(c):
        if c < warmup:
            return init + (peak - init) * c / warmup
        t = min(c - warmup, decay - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * t / (decay - warmup)))
        return end + (peak - end) * cosine**exponent

    return f


@pytest.mark.parametrize(
    "init,peak,warmup,decay,end,exponent",
    [
        (0.0, 1.0, 5, 20, 0.0, 1.0),
        (1e-5, 3e-4, 3, 10, 1e-5, 1.0),
        (0.1, 0.5, 4, 15, 0.05, 2.0),
        (0.0, 1.0, 0, 10, 0.1, 1.0),  # no warmup
        (0.2, 1.0, 1, 2, 0.0, 1.0),  # shortest schedule
    ],
)
def test_warmup_cosine_decay_schedule(init, peak, warmup, decay, end, exponent):
    check(
        S.warmup_cosine_decay_schedule(init, peak, warmup, decay, end, exponent),
        warmup_cosine_closed(init, peak, warmup, decay, end, exponent),
    )


def test_warmup_cosine_decay_endpoints():
    s = S.warmup_cosine_decay_schedule(0.0, 1.0, 4, 12, end_value=0.1)
    assert float(s(0)) == 0.0  # init_value at count 0
    assert float(s(2)) == pytest.approx(0.5)
    assert float(s(4)) == pytest.approx(1.0)  # peak at warmup_steps
    assert float(s(8)) == pytest.approx(0.55)  # half way through the cosine
    assert float(s(12)) == pytest.approx(0.1)  # end_value at decay_steps
    assert float(s(100)) == pytest.approx(0.1)  # constant after


def test_schedules_vectorise_over_count_tensors():
    counts = torch.arange(0, 30)
    for s in (
        S.linear_schedule(0.0, 1.0, 10, 2),
        S.cosine_decay_schedule(1.0, 9, 0.1),
        S.warmup_cosine_decay_schedule(0.0, 1.0, 5, 20, 0.1),
    ):
        v = s(counts)
        assert v.shape == counts.shape
        for c in range(30):
            assert float(v[c]) == pytest.approx(float(s(c)), rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------------------------------------
# scale_by_learning_rate with a schedule
# ---------------------------------------------------------------------------------------------
def test_scale_by_learning_rate_schedule_uses_count_zero_first():
    received = []

    def schedule(count):
        received.append(count.clone())
        return 0.1 * (count + 1).to(torch.float64)

    tx = ft.scale_by_learning_rate(schedule)
    params = {"w": torch.ones(3, 2), "s": torch.ones(())}
    g = {"w": torch.full((3, 2), 2.0), "s": torch.tensor(-1.0)}
    state = tx.init(params)
    assert isinstance(state, ft.ScaleByScheduleState)
    assert int(state.count) == 0 and state.count.dtype == torch.int64 and state.count.dim() == 0
    for step in range(4):
        updates, state = tx.update(g, state, params)
        lr = 0.1 * (step + 1)
        for n in g:
            torch.testing.assert_close(updates[n], -lr * g[n])
        assert int(state.count) == step + 1
    assert [int(c) for c in received] == [0, 1, 2, 3]
    assert all(isinstance(c, torch.Tensor) and c.dtype == torch.int64 for c in received)


@pytest.mark.parametrize("flip_sign", [True, False])
def test_scale_by_learning_rate_with_library_schedule(flip_sign):
    sched = S.warmup_cosine_decay_schedule(0.0, 0.5, 2, 6, 0.05)
    tx = ft.scale_by_learning_rate(sched, flip_sign=flip_sign)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen)}
    state = tx.init(params)
    sign = -1.0 if flip_sign else 1.0
    for c in range(8):
        g = {"w": torch.randn(4, 3, generator=gen)}
        updates, state = tx.update(g, state, params)
        expected = sign * warmup_cosine_closed(0.0, 0.5, 2, 6, 0.05, 1.0)(c) * g["w"]
        torch.testing.assert_close(updates["w"], expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("flip_sign", [True, False])
def test_scale_by_learning_rate_constant(flip_sign):
    tx = ft.scale_by_learning_rate(0.3, flip_sign=flip_sign)
    g = {"w": torch.arange(6.0).reshape(2, 3)}
    state = tx.init(g)
    assert state == ft.EmptyState()
    updates, state = tx.update(g, state)
    torch.testing.assert_close(updates["w"], (-0.3 if flip_sign else 0.3) * g["w"])


def test_scale_by_learning_rate_schedule_state_on_bf16_updates():
    tx = ft.scale_by_learning_rate(S.constant_schedule(0.5))
    g = {"w": torch.ones(2, 2, dtype=torch.bfloat16)}
    updates, state = tx.update(g, tx.init(g))
    assert updates["w"].dtype == torch.bfloat16
    assert torch.equal(updates["w"], torch.full((2, 2), -0.5, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# every schedule against optax's own values (float64: jax_enable_x64 for this module's tests)
# ---------------------------------------------------------------------------------------------
_CASES = {  # name -> list of (args, kwargs), the same call for ft.schedules and optax
    "constant_schedule": [((0.3,), {})],
    "linear_schedule": [((1.0, 0.1, 7, 3), {}), ((0.0, 2.0, 1), {})],
    "polynomial_schedule": [
        ((1.0, 0.01, 2.0, 10), {}),
        ((1.0, 0.5, 0.5, 7), {"transition_begin": 4}),
        ((2.0, 0.0, 3, 0), {}),
    ],
    "piecewise_constant_schedule": [
        ((0.1, {5: 0.5, 12: 0.1}), {}),
        ((1.0,), {}),
        ((2.0, {0: 3.0, 4: 0.0}), {}),
    ],
    "piecewise_interpolate_schedule": [
        (("linear", 1.0, {5: 2.0, 15: 0.1}), {}),
        (("cosine", 0.5, {3: 4.0, 4: 0.5, 20: 0.01}), {}),
        (("linear", 0.7), {}),
    ],
    "exponential_decay": [
        ((1.0, 5, 0.5), {}),
        ((2.0, 3, 0.9), {"transition_begin": 4, "staircase": True}),
        ((1.0, 4, 0.5), {"end_value": 0.2}),
        ((0.1, 4, 1.5), {"end_value": 0.3}),
        ((1.0, 0, 0.5), {}),
        ((1.0, 5, 0.0), {}),
    ],
    "cosine_decay_schedule": [((1.0, 9, 0.1, 2.0), {})],
    "warmup_constant_schedule": [((0.0, 1.0, 6), {}), ((0.5, 1.0, 0), {})],
    "warmup_cosine_decay_schedule": [((0.0, 1.0, 5, 20, 0.1), {})],
    "warmup_exponential_decay_schedule": [
        ((0.0, 1.0, 4, 3, 0.5), {}),
        ((0.1, 1.0, 5, 2, 0.8), {"transition_begin": 3, "staircase": True, "end_value": 0.4}),
    ],
    "linear_onecycle_schedule": [
        ((20, 1.0), {}),
        ((33, 0.5, 0.2, 0.7, 10.0, 100.0), {}),
        ((1, 1.0), {}),
    ],
    "cosine_onecycle_schedule": [((20, 1.0), {}), ((31, 2.0, 0.4, 5.0, 50.0), {})],
    "sgdr_schedule": [
        (
            (
                [
                    dict(init_value=0.0, peak_value=1.0, warmup_steps=3, decay_steps=10),
                    dict(
                        init_value=0.1,
                        peak_value=0.5,
                        warmup_steps=0,
                        decay_steps=7,
                        end_value=0.05,
                    ),
                ],
            ),
            {},
        )
    ],
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_schedule_equals_optax(name, x64):
    import numpy as np
    import optax

    for args, kwargs in _CASES[name]:
        ours = getattr(S, name)(*args, **kwargs)
        theirs = getattr(optax.schedules, name)(*args, **kwargs)
        for c in range(0, 45):
            want = float(np.asarray(theirs(np.int64(c)), dtype=np.float64))
            for cc in as_counts(c):
                got = ours(cc)
                assert isinstance(got, torch.Tensor) and got.dim() == 0
                assert got.dtype == torch.float64
                assert float(got) == pytest.approx(want, rel=1e-12, abs=1e-15), (name, args, c)


def test_join_schedules_equals_optax_and_counts_from_each_start(x64):
    import numpy as np
    import optax

    seen = []

    def mine(count):
        seen.append(torch.as_tensor(count).clone())
        return 0.5 + 0.01 * torch.as_tensor(count).to(torch.float64)

    ours = S.join_schedules(
        [S.constant_schedule(1.0), mine, S.linear_schedule(1.0, 0.0, 4)], [3, 8]
    )
    theirs = optax.join_schedules(
        [
            optax.constant_schedule(1.0),
            lambda c: 0.5 + 0.01 * c,
            optax.linear_schedule(1.0, 0.0, 4),
        ],
        [3, 8],
    )
    for c in range(15):
        assert float(ours(torch.tensor(c))) == pytest.approx(
            float(np.asarray(theirs(c))), rel=1e-12
        )
    assert seen[5].dtype == torch.int64 and int(seen[5]) == 5 - 3  # counted from its start


@pytest.mark.parametrize("name", sorted(_CASES))
def test_every_schedule_vectorises_and_compiles_without_recompiling(name):
    """A tensor of counts gives the values of its shape; under ``torch.compile(fullgraph=True)``
    a 0-dim count tensor traces once (no host read) and later counts reuse the graph."""
    import torch._dynamo

    args, kwargs = _CASES[name][0]
    s = getattr(S, name)(*args, **kwargs)
    counts = torch.arange(0, 40)
    v = s(counts)
    assert v.shape == counts.shape
    for c in (0, 7, 23, 39):
        assert float(v[c]) == pytest.approx(float(s(c)), rel=1e-12, abs=1e-15)
    torch._dynamo.reset()
    compiled = torch.compile(s, fullgraph=True, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for c in (0, 5, 17, 30):
            assert float(compiled(torch.tensor(c))) == pytest.approx(
                float(s(c)), rel=1e-12, abs=1e-15
            )


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: S.polynomial_schedule(1.0, 0.0, 1.0, -1), ValueError, "transition_steps"),
        (lambda: S.piecewise_constant_schedule(1.0, {3: -0.5}), ValueError, "scale at step 3"),
        (lambda: S.piecewise_constant_schedule(1.0, [(3, 0.5)]), TypeError, "dict"),
        (
            lambda: S.piecewise_interpolate_schedule("quadratic", 1.0),
            ValueError,
            "interpolate_type",
        ),
        (lambda: S.exponential_decay(1.0, 5, -0.5), ValueError, "decay_rate"),
        (lambda: S.join_schedules([S.constant_schedule(1.0)], [3]), ValueError, "one boundary"),
        (lambda: S.join_schedules([S.constant_schedule(1.0), 2.0], [3]), TypeError, "callable"),
        (lambda: S.linear_onecycle_schedule(0, 1.0), ValueError, "transition_steps"),
        (lambda: S.cosine_onecycle_schedule(10, 1.0, div_factor=0.0), ValueError, "div_factor"),
        (lambda: S.sgdr_schedule([]), ValueError, "at least one"),
        (lambda: S.sgdr_schedule([(0.0, 1.0, 2, 5)]), TypeError, "dict"),
    ],
)
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()
