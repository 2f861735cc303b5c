"""torch.func through the library (issue 30): derivatives with respect to tensor hyper-parameters
(``grad``, ``vjp``, ``jvp``, and plain autograd inside ``ft.differentiable()``) equal central
finite differences in float64; ``vmap`` over a vector of hyper-parameters equals a loop; the
clear errors (GaLore's refresh, 8-bit moments, host-read injected values, DTensors); ``ft.vmap``.

The sweep (``tests/test_sweep.py``'s ``vmap`` and ``grad`` properties) runs every public
transform through vmap and through grad / jvp with respect to params, gradients and state.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

import functional_train as ft
from _layouts import step_by_mode  # noqa: E402  (tests/ is on sys.path)
from functional_train.testing import simulate

F64 = torch.float64


def _problem(seed=0, steps=3):
    gen = torch.Generator().manual_seed(seed)

    def tree():
        return {
            "w": torch.randn(3, 4, generator=gen, dtype=F64),
            "b": torch.randn(5, generator=gen, dtype=F64),
        }

    return tree(), [tree() for _ in range(steps)], tree()


PARAMS, GRADS, TARGET = _problem()

# (builder of a transform from ONE tensor hyper-parameter, its value)
HYPER = {
    "sgd lr": (lambda h: ft.sgd(h, momentum=0.9), 0.1),
    "sgd momentum": (lambda h: ft.sgd(0.1, momentum=h, nesterov=True), 0.9),
    "sgd dampening": (lambda h: ft.sgd(0.1, momentum=0.9, dampening=h), 0.3),
    "sgd weight_decay": (lambda h: ft.sgd(0.1, weight_decay=h), 0.1),
    "adam lr": (lambda h: ft.adam(h), 0.1),
    "adam b1": (lambda h: ft.adam(0.1, b1=h), 0.9),
    "adam b2": (lambda h: ft.adam(0.1, b2=h), 0.99),
    "adam eps": (lambda h: ft.adam(0.1, eps=h), 0.1),
    "adamw weight_decay": (lambda h: ft.adamw(0.1, weight_decay=h), 0.1),
    "clip+sgd max_norm": (lambda h: ft.chain(ft.clip_by_global_norm(h), ft.sgd(0.1)), 2.0),
    "clip+adamw lr": (lambda h: ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(h)), 0.1),
    "lamb lr": (lambda h: ft.lamb(h, weight_decay=0.1), 0.1),
    "adafactor lr": (lambda h: ft.adafactor(h, relative_step=False), 0.1),
    "came weight_decay": (lambda h: ft.came(0.1, weight_decay=h), 0.1),
    "muon lr": (lambda h: ft.muon(h, ns_dtype=F64), 0.1),
    "schedule lr": (lambda h: ft.sgd(lambda c: h * 0.5 ** c.to(F64)), 0.1),
    "inject_hyperparams lr": (lambda h: ft.inject_hyperparams(ft.adam)(learning_rate=h), 0.1),
    "inject_hyperparams b1": (lambda h: ft.inject_hyperparams(ft.adam)(0.1, b1=h), 0.9),
    "multi_steps lr": (lambda h: ft.multi_steps(ft.adam(h), 2), 0.1),
}


def _loss_after(make, h, *, use_step=False):
    """The loss of the parameters after ``len(GRADS)`` steps of ``make(h)``."""
    tx = make(h)
    state, p = tx.init(PARAMS), PARAMS
    for g in GRADS:
        p, state = step_by_mode(tx, g, state, p, "pure" if use_step else "update")
    return sum(((p[k] - TARGET[k]) ** 2).sum() for k in p)


def _central(make, h0, use_step=False, eps=1e-6):
    f = lambda h: _loss_after(make, torch.tensor(h, dtype=F64), use_step=use_step)  # noqa: E731
    return float((f(h0 + eps) - f(h0 - eps)) / (2 * eps))


def _close(got, want):
    assert abs(float(got) - want) <= 1e-6 * max(1.0, abs(want)), (float(got), want)


@pytest.mark.parametrize("name", list(HYPER))
def test_grad_vjp_jvp_wrt_a_tensor_hyperparameter(name):
    """d loss / d h through 3 updates (and 3 ``ft.step``) equals central differences, by
    ``grad``, ``vjp`` and ``jvp``; it is not zero (the hyper-parameter was read as a number)."""
    make, h0 = HYPER[name]
    h = torch.tensor(h0, dtype=F64)
    want = _central(make, h0)
    assert abs(want) > 1e-3  # (a meaningful derivative)
    _close(torch.func.grad(lambda x: _loss_after(make, x))(h), want)
    _close(torch.func.grad(lambda x: _loss_after(make, x, use_step=True))(h), want)
    _, vjp = torch.func.vjp(lambda x: _loss_after(make, x), h)
    _close(vjp(torch.tensor(1.0, dtype=F64))[0], want)
    _, tangent = torch.func.jvp(lambda x: _loss_after(make, x, use_step=True), (h,), (h * 0 + 1,))
    _close(tangent, want)


@pytest.mark.parametrize("name", ["sgd lr", "adam lr", "adamw weight_decay", "clip+adamw lr"])
def test_autograd_wrt_a_hyperparameter_inside_differentiable(name):
    """Plain autograd (``torch.autograd.grad``) inside ``ft.differentiable()``: a learning rate
    that requires grad gives the finite-difference derivative (it was 0.0 for adam)."""
    make, h0 = HYPER[name]
    h = torch.tensor(h0, dtype=F64, requires_grad=True)
    with ft.differentiable():
        (got,) = torch.autograd.grad(_loss_after(make, h), [h])
    _close(got, _central(make, h0))


@pytest.mark.parametrize("name", ["sgd lr", "adam b1", "adamw weight_decay", "lamb lr", "muon lr"])
def test_vmap_over_a_vector_of_hyperparameters(name):
    """``vmap`` over a vector of values (a sweep in one call) equals the loop over them."""
    make, h0 = HYPER[name]
    hs = torch.tensor([h0, 0.5 * h0, 0.8 * h0], dtype=F64)
    got = torch.func.vmap(lambda h: _loss_after(make, h))(hs)
    want = torch.stack([_loss_after(make, h) for h in hs])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_a_traced_hyperparameter_is_still_checked():
    """Kept a tensor, a traced hyper-parameter's value (every batch element) is still range
    checked."""
    with pytest.raises(ValueError, match=r"sgd: momentum must be >= 0.0, got -0.5"):
        torch.func.vmap(lambda m: ft.sgd(0.1, momentum=m).init(PARAMS)["b"])(
            torch.tensor([0.5, -0.5], dtype=F64)
        )


def test_galore_refresh_and_8bit_moments_refuse_derivatives():
    """A derivative through GaLore's SVD refresh or 8-bit moments raises (naming the
    transform); between refreshes, or with respect to a value the refresh does not read, it
    is taken."""
    p = {"w": PARAMS["w"]}
    g = {"w": GRADS[0]["w"]}
    galore = ft.galore_adamw(0.1, rank=2, update_proj_gap=10)

    def loss(grads, lr=0.1):
        tx = ft.galore_adamw(lr, rank=2, update_proj_gap=10)
        u, _ = tx.update(grads, tx.init(p), p)
        return (u["w"] ** 2).sum()

    with pytest.raises(NotImplementedError, match=r"galore: the projector refresh"):
        torch.func.grad(loss)(g)
    # the refresh reads the gradient, not the learning rate: d / d lr is taken
    got = torch.func.grad(lambda lr: loss(g, lr))(torch.tensor(0.1, dtype=F64))
    eps = 1e-6
    want = (loss(g, 0.1 + eps) - loss(g, 0.1 - eps)) / (2 * eps)
    _close(got, float(want))
    # vmap alone takes no derivative: the refresh runs per batch element
    gb = {"w": torch.stack([g["w"], 2 * g["w"]])}
    pb = {"w": torch.stack([p["w"], p["w"]])}
    ft.vmap(lambda gg, pp: galore.update(gg, galore.init(pp), pp)[0])(gb, pb)
    tx8 = ft.adamw(0.1, optim_bits=8, min_8bit_size=0, block_size=4)
    with pytest.raises(NotImplementedError, match=r"scale_by_adam with optim_bits=8"):
        torch.func.grad(lambda gg: tx8.update(gg, tx8.init(p), p)[0]["w"].sum())(g)


def test_host_read_injected_hyperparameter_refuses_tracing():
    make = ft.inject_hyperparams(ft.trace)  # (trace declares no tensor hyper-parameters)
    with pytest.raises(TypeError, match=r"'decay' of trace is read on the host"):
        torch.func.grad(lambda d: make(decay=d).init(PARAMS)["b"].sum())(torch.tensor(0.9))


def test_dtensors_under_torch_func_raise():
    with simulate(2):
        dm = init_device_mesh("cpu", (2,))
        p = {"w": distribute_tensor(torch.ones(2, 3, 4), dm, [Replicate()])}
        tx = ft.adamw(0.1)
        with pytest.raises(TypeError, match=r"leaf 'w' is a DTensor; torch.func transforms"):
            ft.vmap(lambda g, pp: tx.update(g, tx.init(pp), pp))(p, p)


def test_ft_vmap_passes_none_leaves_through():
    """``ft.vmap`` is ``torch.func.vmap`` with ``None`` leaves (a frozen parameter's update,
    the leaves a ``partition`` part does not own) passed through, in and out."""
    tx = ft.partition({"a": ft.adamw(0.1), "b": ft.sgd(0.1)}, {"w": "a", "b": "b"})
    pb = {k: torch.stack([v, 2 * v]) for k, v in PARAMS.items()}
    gb = {"w": torch.stack([GRADS[0]["w"]] * 2), "b": None}
    state = ft.vmap(tx.init)(pb)
    u, state = ft.vmap(tx.update)(gb, state, pb)
    assert u["b"] is None and u["w"].shape == (2, 3, 4)
    for i in range(2):
        p = {k: v[i] for k, v in pb.items()}
        want, _ = tx.update({"w": GRADS[0]["w"], "b": None}, tx.init(p), p)
        torch.testing.assert_close(u["w"][i], want["w"], rtol=1e-12, atol=0)
    with pytest.raises(TypeError, match=r"out_dims must be an int"):
        ft.vmap(tx.init, out_dims=(0,))
    with pytest.raises(TypeError, match=r"each in_dims entry must be an int or None"):
        ft.vmap(tx.init, in_dims=({"w": 0},))(pb)


def test_host_read_counters_under_vmap():
    """The CPU counters read on the host (``multi_steps``' micro-step) work under ``vmap``
    when every batch element holds the same value (``ft.vmap(tx.init)``), and raise naming
    the counter when they differ (the decision they drive cannot differ per element)."""
    tx = ft.multi_steps(ft.sgd(0.1), every_k=2)
    pb = {k: torch.stack([v, 2 * v]) for k, v in PARAMS.items()}
    gb = {k: torch.stack([v, -v]) for k, v in GRADS[0].items()}
    state = ft.vmap(tx.init)(pb)
    for _ in range(2):
        u, state = ft.vmap(tx.update)(gb, state, pb)
    torch.testing.assert_close(u["w"][1], 0.1 * GRADS[0]["w"], rtol=1e-12, atol=0)
    mixed = state._replace(mini_step=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"MultiStepsState.mini_step is read on the host"):
        ft.vmap(tx.update)(gb, mixed, pb)
