"""Unusual input gets the right answer or a clear error, never a silently wrong one: ``None``
gradients in accumulation, layouts that change, integer, complex and autograd-tracked leaves,
checkpoints read with plain ``torch.load``."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

import functional_train as ft
from functional_train.testing import simulate


def _feed(tx, params, grads_seq):
    state = tx.init(params)
    out = []
    for g in grads_seq:
        u, state = tx.update(g, state, params)
        out.append(u)
    return out, state


# ---------------------------------------------------------------------------------------------
# multi_steps and None gradients (a None gradient is a zero contribution; the accumulators are
# cleared when a cycle ends)
# ---------------------------------------------------------------------------------------------
def test_multi_steps_none_on_the_final_micro_step():
    params = {"a": torch.zeros(2, 3), "b": torch.zeros(2)}
    seq = [{"a": torch.ones(2, 3), "b": torch.full((2,), 100.0)},
           {"a": torch.ones(2, 3), "b": None},
           {"a": torch.ones(2, 3), "b": None},
           {"a": torch.ones(2, 3), "b": torch.full((2,), 2.0)}]
    us, _ = _feed(ft.multi_steps(ft.sgd(1.0), 2), params, seq)
    torch.testing.assert_close(us[1]["b"], torch.full((2,), -50.0))  # mean of 100 and 0
    torch.testing.assert_close(us[3]["b"], torch.full((2,), -1.0))   # mean of 0 and 2, no leak
    torch.testing.assert_close(us[3]["a"], torch.full((2, 3), -1.0))
    assert us[2]["b"] is None


def test_multi_steps_leaf_without_gradient_in_a_cycle_stays_untouched():
    """A leaf whose gradient is None on every micro-step of a cycle gets a None gradient in the
    inner update (adamw's weight decay does not move it), not a zero one."""
    params = {"a": torch.ones(2, 3), "b": torch.ones(2)}
    seq = [{"a": torch.ones(2, 3), "b": None}] * 2
    us, state = _feed(ft.multi_steps(ft.adamw(0.1, weight_decay=0.5), 2), params, seq)
    assert us[1]["b"] is None
    assert [int(f) for f in state.seen] == [0, 0]


def test_multi_steps_all_none_after_the_first_micro_step():
    params = {"a": torch.zeros(2, 3), "b": torch.zeros(2)}
    seq = [{"a": torch.full((2, 3), 4.0), "b": torch.full((2,), 2.0)},
           {"a": None, "b": None},
           {"a": None, "b": None},
           {"a": None, "b": None},
           {"a": None, "b": None},
           {"a": torch.full((2, 3), 3.0), "b": None}]
    us, _ = _feed(ft.multi_steps(ft.sgd(1.0), 3), params, seq)
    torch.testing.assert_close(us[2]["a"], torch.full((2, 3), -4.0 / 3))
    torch.testing.assert_close(us[2]["b"], torch.full((2,), -2.0 / 3))
    assert us[4]["a"] is None and us[4]["b"] is None
    torch.testing.assert_close(us[5]["a"], torch.full((2, 3), -1.0))
    assert us[5]["b"] is None


def test_multi_steps_placements_change_between_micro_steps():
    """Partial, then Replicate: raise naming the leaf and both layouts (adding the local values
    would be off by the mesh size)."""
    with simulate(2):
        dm = init_device_mesh("cpu", (2,))
        p = {"w": distribute_tensor(torch.zeros(2, 3), dm, [Replicate()])}
        tx = ft.multi_steps(ft.sgd(1.0), 2)
        state = tx.init(p)
        g0 = {"w": DTensor.from_local(
            torch.ones(2, 3) * 0.5, dm, [Partial()], run_check=False)}
        _, state = tx.update(g0, state, p, mesh=ft.Mesh(dm))
        g1 = {"w": distribute_tensor(torch.ones(2, 3), dm, [Replicate()])}
        with pytest.raises(ValueError, match=r"'w'.*Replicate.*Partial|'w'.*Partial.*Replicate"):
            tx.update(g1, state, p, mesh=ft.Mesh(dm))


def test_multi_steps_integer_gradients_raise():
    params = {"n": torch.zeros(3)}
    tx = ft.multi_steps(ft.sgd(0.1), 2)
    with pytest.raises(TypeError, match=r"'n'.*torch.int64.*floating"):
        tx.update({"n": torch.ones(3, dtype=torch.int64)}, tx.init(params), params)


# ---------------------------------------------------------------------------------------------
# plain torch.load of every state type: tests/test_sweep.py::test_torch_load (every transform)
# ---------------------------------------------------------------------------------------------
def test_torch_load_multi_steps_state(tmp_path):
    params = {"a": torch.ones(2, 3)}
    tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(0.1)), 2)
    _, state = _feed(tx, params, [{"a": torch.ones(2, 3)}])
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt")  # weights_only=True, torch's default
    assert type(loaded) is ft.MultiStepsState and int(loaded.mini_step) == 1
    torch.testing.assert_close(loaded.acc_grads["a"], torch.ones(2, 3))
