"""Single-process reference tests: multi_steps (gradient accumulation), plain tensors, mesh=None.

``multi_steps(adam, k)`` over ``k`` micro-batches must equal ``adam`` (ours and torch.optim.Adam)
over the concatenated batch for a mean loss, on a real small model driven through
``torch.func.functional_call`` + ``torch.func.grad``.
"""

from __future__ import annotations

import optree
import pytest
import torch
from torch.func import functional_call, grad

import functional_train as ft

BATCH = 8  # examples per optimizer step
OPT_STEPS = 3  # optimizer steps


# ---------------------------------------------------------------------------------------------
# the model and data
# ---------------------------------------------------------------------------------------------
def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 6),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 3),
    )


def make_data(steps=OPT_STEPS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, 5, generator=gen), torch.randn(BATCH, 3, generator=gen))
        for _ in range(steps)
    ]


def param_dict(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def make_loss(model):
    def loss(params, x, y):
        return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)  # mean

    return loss


def leaves(tree):
    return optree.tree_leaves(tree, none_is_leaf=True)


def clone(tree):
    return optree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True
    )


def assert_bitwise_equal(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


def ulp(x):
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x


def assert_change_close(ours, theirs, p0, rtol=1e-4, atol=1e-7, steps=OPT_STEPS):
    """Relative tolerance on the parameter change, plus the parameters' storage rounding."""
    for name in p0:
        a, b, p = ours[name], theirs[name], p0[name]
        da, db = (a - p).double(), (b - p).double()
        mag = torch.maximum(torch.maximum(a.abs(), b.abs()), p.abs())
        bound = rtol * db.abs() + atol + steps * ulp(mag).double()
        err = (da - db).abs()
        assert (err <= bound).all(), (
            f"{name}: change differs at {int((err > bound).sum())}/{err.numel()} elements, "
            f"max |diff| {float(err.max()):.3g}\nours   {da}\ntheirs {db}"
        )


def run_accumulated(tx, k, model, data, frozen=()):
    """``tx`` (a multi_steps transform) over ``k`` micro-batches per optimizer step.

    Checks the micro-step contract on the way; returns the final params and state."""
    loss = make_loss(model)
    params = param_dict(model)
    state = tx.init(params)
    mb = BATCH // k
    for step, (x, y) in enumerate(data):
        for j in range(k):
            g = grad(loss)(params, x[j * mb : (j + 1) * mb], y[j * mb : (j + 1) * mb])
            g = {n: (None if n in frozen else v) for n, v in g.items()}
            inner_before = clone(state.inner_state)
            updates, state = tx.update(g, state, params)
            final = j == k - 1
            assert bool(ft.has_updated(state)) is final
            assert int(state.mini_step) == (0 if final else j + 1)
            assert int(state.gradient_step) == step + 1 - (0 if final else 1)
            for n in frozen:
                assert updates[n] is None
            if not final:
                for n, u in updates.items():
                    if u is None:
                        continue
                    assert u.shape == params[n].shape and u.dtype == params[n].dtype
                    assert torch.equal(u, torch.zeros_like(u))
                assert_bitwise_equal(state.inner_state, inner_before)
            params = ft.apply_updates(params, updates)
    return params, state


def run_full(tx, model, data, frozen=()):
    loss = make_loss(model)
    params = param_dict(model)
    state = tx.init(params)
    for x, y in data:
        g = grad(loss)(params, x, y)
        g = {n: (None if n in frozen else v) for n, v in g.items()}
        updates, state = tx.update(g, state, params)
        params = ft.apply_updates(params, updates)
    return params, state


def run_torch_adam(model, data, **kw):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), **kw)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return param_dict(model), opt


# ---------------------------------------------------------------------------------------------
# equivalence with the big batch
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 4])
def test_multi_steps_adam_equals_big_batch_adam_and_torch(k):
    model = make_model()
    data = make_data()
    p0 = param_dict(model)
    acc, state = run_accumulated(ft.multi_steps(ft.adam(0.01), k), k, model, data)
    full, full_state = run_full(ft.adam(0.01), model, data)
    theirs, opt = run_torch_adam(model, data, lr=0.01)
    assert_change_close(acc, full, p0)
    assert_change_close(acc, theirs, p0)
    assert int(state.gradient_step) == OPT_STEPS and int(state.mini_step) == 0
    adam_state = state.inner_state[0]
    assert isinstance(adam_state, ft.ScaleByAdamState)
    assert int(adam_state.count) == OPT_STEPS
    torch_states = [opt.state[p] for p in opt.param_groups[0]["params"]]
    for name, ts in zip(p0, torch_states):
        torch.testing.assert_close(adam_state.mu[name], ts["exp_avg"], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(adam_state.nu[name], ts["exp_avg_sq"], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("k", [2, 4])
def test_multi_steps_chain_equals_big_batch_chain(k):
    def make():
        return ft.chain(ft.clip_by_global_norm(0.05), ft.adamw(0.01, weight_decay=0.1))

    model = make_model()
    data = make_data()
    p0 = param_dict(model)
    acc, state = run_accumulated(ft.multi_steps(make(), k), k, model, data)
    full, full_state = run_full(make(), model, data)
    assert_change_close(acc, full, p0)
    torch.testing.assert_close(
        ft.tree_get(state, "global_norm"),
        ft.tree_get(full_state, "global_norm"),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.parametrize("k", [1, 3])
def test_final_micro_step_feeds_the_mean(k):
    params = {"w": torch.zeros(4, 3), "s": torch.zeros(())}
    gen = torch.Generator().manual_seed(0)
    grads = [{n: torch.randn(p.shape, generator=gen) for n, p in params.items()} for _ in range(k)]
    tx = ft.multi_steps(ft.identity(), k)
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
    for n in params:
        torch.testing.assert_close(updates[n], sum(g[n] for g in grads) / k)


# ---------------------------------------------------------------------------------------------
# counters and has_updated
# ---------------------------------------------------------------------------------------------
def test_counters_over_many_micro_steps():
    params = {"w": torch.ones(2, 3)}
    tx = ft.multi_steps(ft.sgd(0.1), 3)
    state = tx.init(params)
    assert int(state.mini_step) == 0 and int(state.gradient_step) == 0
    assert state.mini_step.dtype == torch.int64 and state.mini_step.dim() == 0
    assert state.gradient_step.dtype == torch.int64 and state.gradient_step.dim() == 0
    assert not bool(ft.has_updated(state))
    seen = []
    for i in range(7):
        _, state = tx.update({"w": torch.full((2, 3), float(i))}, state, params)
        seen.append((int(state.mini_step), int(state.gradient_step), bool(ft.has_updated(state))))
    assert seen == [
        (1, 0, False),
        (2, 0, False),
        (0, 1, True),
        (1, 1, False),
        (2, 1, False),
        (0, 2, True),
        (1, 2, False),
    ]


def test_has_updated_finds_nested_state_and_rejects_others():
    params = {"w": torch.ones(2, 2)}
    tx = ft.chain(ft.clip(1.0), ft.multi_steps(ft.sgd(0.1), 1))
    state = tx.init(params)
    _, state = tx.update({"w": torch.ones(2, 2)}, state, params)
    assert bool(ft.has_updated(state))
    with pytest.raises(ValueError, match="MultiStepsState"):
        ft.has_updated(ft.sgd(0.1).init(params))


def test_accumulator_float32_for_bf16_params():
    params = {"w": torch.ones(3, 2, dtype=torch.bfloat16)}
    tx = ft.multi_steps(ft.adam(0.01), 2)
    state = tx.init(params)
    assert state.acc_grads["w"].dtype == torch.float32
    updates, state = tx.update({"w": torch.ones(3, 2, dtype=torch.bfloat16)}, state, params)
    assert updates["w"].dtype == torch.bfloat16
    assert state.acc_grads["w"].dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# None gradient leaves (frozen parameters)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 4])
def test_none_gradient_leaves_pass_through(k):
    model = make_model()
    data = make_data()
    p0 = param_dict(model)
    frozen = ("2.weight", "4.bias")
    acc, state = run_accumulated(ft.multi_steps(ft.adam(0.01), k), k, model, data, frozen)
    full, _ = run_full(ft.adam(0.01), model, data, frozen)
    for n in frozen:
        assert torch.equal(acc[n], p0[n])
    assert not torch.equal(acc["0.weight"], p0["0.weight"])
    assert_change_close(acc, full, p0)


# ---------------------------------------------------------------------------------------------
# purity
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3])
def test_update_is_pure(k):
    model = make_model()
    loss = make_loss(model)
    params = param_dict(model)
    tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.1), ft.adamw(0.01)), k)
    state = tx.init(params)
    for x, y in make_data(steps=2):
        for _j in range(k):
            g = grad(loss)(params, x, y)
            p_c, g_c, s_c = clone(params), clone(g), clone(state)
            updates, new_state = tx.update(g, state, params)
            assert_bitwise_equal(params, p_c)
            assert_bitwise_equal(g, g_c)
            assert_bitwise_equal(state, s_c)
            params = ft.apply_updates(params, updates)
            state = new_state


def test_state_does_not_alias_input_gradients():
    """A torch training loop that reuses its ``.grad`` buffers (``zero_grad(set_to_none=False)``,
    then ``backward`` accumulating into the same tensors) must still get the mean of the k
    micro-batch gradients: the accumulator may not share memory with a gradient passed in."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = param_dict(model)
    tx = ft.multi_steps(ft.identity(), 2)
    state = tx.init(params)
    seen = []
    for x in (torch.randn(4, 3), torch.randn(4, 3)):
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        seen.append(clone(grads))
        updates, state = tx.update(grads, state, params)
    for n in params:
        torch.testing.assert_close(updates[n], (seen[0][n] + seen[1][n]) / 2)
