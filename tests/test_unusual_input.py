"""Unusual input gets the right answer or a clear error, never a silently wrong one: ``None``
gradients in accumulation, layouts that change, integer, complex and autograd-tracked leaves,
checkpoints read with plain ``torch.load``."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import functional_train as ft
from functional_train.testing.sim import on_rank, per_rank, replicated, simulate


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
    seq = [
        {"a": torch.ones(2, 3), "b": torch.full((2,), 100.0)},
        {"a": torch.ones(2, 3), "b": None},
        {"a": torch.ones(2, 3), "b": None},
        {"a": torch.ones(2, 3), "b": torch.full((2,), 2.0)},
    ]
    us, _ = _feed(ft.multi_steps(ft.sgd(1.0), 2), params, seq)
    torch.testing.assert_close(us[1]["b"], torch.full((2,), -50.0))  # mean of 100 and 0
    torch.testing.assert_close(us[3]["b"], torch.full((2,), -1.0))  # mean of 0 and 2, no leak
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
    seq = [
        {"a": torch.full((2, 3), 4.0), "b": torch.full((2,), 2.0)},
        {"a": None, "b": None},
        {"a": None, "b": None},
        {"a": None, "b": None},
        {"a": None, "b": None},
        {"a": torch.full((2, 3), 3.0), "b": None},
    ]
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
        g0 = {"w": DTensor.from_local(torch.ones(2, 3) * 0.5, dm, [Partial()], run_check=False)}
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


# ---------------------------------------------------------------------------------------------
# autograd: nothing recorded by default (torch.optim's differentiable=False); ft.differentiable()
# records the update for meta-learning
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_step", [False, True], ids=["update+apply", "step"])
def test_no_graph_in_states_or_params(use_step):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4))
    params = {"w": w}
    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(0.1, weight_decay=0.1))
    state = tx.init(params)
    for _ in range(3):
        loss = (params["w"] ** 3).sum()
        (g,) = torch.autograd.grad(loss, [params["w"]], create_graph=True)
        assert g.requires_grad
        if use_step:
            params, state = ft.step(tx, {"w": g}, state, params)
        else:
            u, state = tx.update({"w": g}, state, params)
            assert u["w"].grad_fn is None
            params = ft.apply_updates(params, u)
        for x in (state[1][0].mu["w"], state[1][0].nu["w"], state[0].global_norm):
            assert x.grad_fn is None and not x.requires_grad
        new = params["w"]
        assert new.is_leaf and new.requires_grad and new.grad_fn is None
    # a plain tensor that does not require grad stays so
    p2, _ = ft.step(
        ft.sgd(0.1),
        {"w": torch.ones(2)},
        ft.sgd(0.1).init({"w": torch.zeros(2)}),
        {"w": torch.zeros(2)},
    )
    assert not p2["w"].requires_grad


def test_multi_steps_accumulator_holds_no_graph():
    p = {"w": torch.nn.Parameter(torch.ones(3))}
    tx = ft.multi_steps(ft.sgd(0.1), 2)
    g = (p["w"] * 2).sum()
    (grad,) = torch.autograd.grad(g, [p["w"]], create_graph=True)
    _, state = tx.update({"w": grad * p["w"]}, tx.init(p), p)
    assert state.acc_grads["w"].grad_fn is None


@pytest.mark.parametrize("use_step", [False, True], ids=["update+apply", "step"])
def test_differentiable_meta_gradient(use_step):
    """d loss(p - lr * g) / d lr through one sgd step equals -g . grad loss(p_new)."""
    torch.manual_seed(0)
    p0 = torch.randn(3, 2)
    lr = torch.tensor(0.1, requires_grad=True)
    target = torch.randn(3, 2)

    def inner_loss(p):
        return ((p - target) ** 2).sum()

    params = {"w": p0.clone().requires_grad_(True)}
    (g,) = torch.autograd.grad(inner_loss(params["w"]), [params["w"]])
    tx = ft.sgd(lambda count: lr)
    with ft.differentiable():
        state = tx.init(params)
        if use_step:
            new, _ = ft.step(tx, {"w": g}, state, params)
        else:
            u, _ = tx.update({"w": g}, state, params)
            new = ft.apply_updates(params, u)
    outer = inner_loss(new["w"])
    (dlr,) = torch.autograd.grad(outer, [lr])
    p_new = (p0 - 0.1 * g).detach()
    want = (-g * 2 * (p_new - target)).sum()
    torch.testing.assert_close(dlr, want)
    # outside the block, the new parameters carry no graph (a leaf, as the parameter was)
    u, _ = tx.update({"w": g}, tx.init(params), params)
    new = ft.apply_updates(params, u)
    assert new["w"].grad_fn is None and new["w"].is_leaf and new["w"].requires_grad


# ---------------------------------------------------------------------------------------------
# layouts that do not match, integer leaves, None params, Partial params: clear errors naming
# the leaf and the tree
# ---------------------------------------------------------------------------------------------
def test_plain_state_with_sharded_params_raises():
    with simulate(2):
        dm = init_device_mesh("cpu", (2,))
        plain = {"w": torch.ones(4, 3)}
        tx = ft.adamw(0.1)
        state = tx.init(plain)
        p = {"w": distribute_tensor(torch.ones(4, 3), dm, [Shard(0)])}
        g = {"w": distribute_tensor(torch.ones(4, 3), dm, [Shard(0)])}
        with pytest.raises(
            ValueError,
            match=r"ScaleByAdamState.mu leaf 'w' is a plain tensor.*"
            r"update leaf is a DTensor \(Shard\(dim=0\),\)",
        ):
            tx.update(g, state, p, mesh=ft.Mesh(dm))
        with pytest.raises(ValueError, match=r"ScaleByAdamState.mu leaf 'w' is a plain tensor"):
            ft.step(
                ft.chain(ft.clip_by_global_norm(1.0), tx),
                g,
                ft.chain(ft.clip_by_global_norm(1.0), tx).init(plain),
                p,
                mesh=ft.Mesh(dm),
            )


def test_apply_updates_layout_mismatch_raises():
    with simulate(2):
        dm = init_device_mesh("cpu", (2,))
        p = {"w": distribute_tensor(torch.ones(4, 3), dm, [Shard(0)])}
        with pytest.raises(
            ValueError,
            match=r"update for 'w' is a plain tensor, but the "
            r"parameter is a DTensor",
        ):
            ft.apply_updates(p, {"w": torch.ones(4, 3)})
        with pytest.raises(ValueError, match=r"update for 'w' is a DTensor.*parameter is a plain"):
            ft.apply_updates({"w": torch.ones(4, 3)}, p)


def test_integer_params_and_gradients_raise():
    with pytest.raises(
        TypeError,
        match=r"params leaf 'n' has dtype torch.int64.*update is "
        r"torch.float32",
    ):
        ft.apply_updates({"n": torch.tensor(3)}, {"n": torch.tensor(0.7)})
    assert int(ft.apply_updates({"n": torch.tensor(3)}, {"n": torch.tensor(2)})["n"]) == 5
    p = {"a": torch.ones(2), "n": torch.zeros(3)}
    for tx in (ft.adamw(0.1), ft.clip_by_global_norm(1.0), ft.sgd(0.1)):
        for bad in (torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.bool)):
            with pytest.raises(TypeError, match=r"update leaf 'n' has dtype torch\.(int64|bool)"):
                tx.update({"a": torch.ones(2), "n": bad}, tx.init(p), p)
    with pytest.raises(TypeError, match=r"update leaf 'n' has dtype torch.int64"):
        ft.global_norm({"n": torch.ones(3, dtype=torch.int64)})


def test_none_param_with_gradient_raises():
    tx = ft.adamw(0.1)
    p = {"a": torch.ones(2), "b": torch.ones(3)}
    state = tx.init(p)
    with pytest.raises(ValueError, match=r"params leaf 'b' is None but its update leaf is not"):
        tx.update({"a": torch.ones(2), "b": torch.ones(3)}, state, {"a": torch.ones(2), "b": None})


def test_partial_params_raise():
    with simulate(2):
        dm = init_device_mesh("cpu", (2,))
        p = {"w": DTensor.from_local(torch.ones(2, 3), dm, [Partial()], run_check=False)}
        g = {"w": distribute_tensor(torch.ones(2, 3), dm, [Replicate()])}
        with pytest.raises(
            ValueError,
            match=r"params leaf 'w' has Partial placements.*"
            r"Shard or Replicate",
        ):
            ft.sgd(0.1).update(g, ft.sgd(0.1).init(p), p, mesh=ft.Mesh(dm))


def test_other_mesh_error_names_both_trees():
    # (meshes that differ: two meshes over the same ranks, layout and names are one mesh, as
    # torch's == says; tests/test_bad_input.py::test_dtensors_on_equal_meshes_are_on_one_mesh)
    with simulate(2):
        dm1 = init_device_mesh("cpu", (2,), mesh_dim_names=("a",))
        dm2 = init_device_mesh("cpu", (2,), mesh_dim_names=("b",))
        assert dm1 != dm2
        p = {"w": distribute_tensor(torch.ones(4, 3), dm1, [Shard(0)])}
        g = {"w": distribute_tensor(torch.ones(4, 3), dm2, [Shard(0)])}
        with pytest.raises(
            ValueError,
            match=r"update leaf 'w' is a DTensor on .*but params "
            r"leaf 'w' is on",
        ):
            ft.sgd(0.1).update(g, ft.sgd(0.1).init(p), p)


def test_zero_redundancy_without_mesh_reduces_over_its_axis():
    """zero_redundancy(sgd, "dp", device_mesh=dm) updated without mesh= on plain gradients
    that differ per rank: every rank gets the mean, never rows stitched from different ranks."""
    with simulate(2):
        dm = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        params = {"w": replicated(2, torch.zeros(4, 3))}
        tx = ft.zero_redundancy(ft.sgd(1.0), "dp", device_mesh=dm)
        state = tx.init(params)
        g = {"w": per_rank(2, lambda r: torch.full((4, 3), float(r + 1)))}
        u, _ = tx.update(g, state, params)
        for r in range(2):
            torch.testing.assert_close(on_rank(u["w"], r), torch.full((4, 3), -1.5))


# ---------------------------------------------------------------------------------------------
# a gradient None on some data-parallel ranks only: zero in the mean (DDP), never an abort
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_gloo_none_gradient_on_one_rank(ranks):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import _gloo_presence_worker as pw

    res = ranks.run(2, "_gloo_presence_worker:main")[0]
    params0, grads = pw.problem()
    makers = dict(pw.transforms(), zero_adamw=lambda: ft.adamw(1e-2))
    for key, got in res.items():
        name = key.split("/")[0]
        tx = makers[name]()
        p = {k: v.clone() for k, v in params0.items()}
        state = tx.init(p)
        for step, sg in enumerate(grads):
            g = {}
            for k in ("a", "b"):
                parts = [pw.grads_of(sg, step, r)[k] for r in range(2)]
                g[k] = sum(torch.zeros_like(p[k]) if x is None else x for x in parts) / 2
            g["c"] = None
            u, state = tx.update(g, state, p)
            p = ft.apply_updates(p, u)
        for rank in range(2):
            for k in pw.SHAPES:
                torch.testing.assert_close(
                    got[rank][k].reshape(p[k].shape),
                    p[k],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m: f"{key} rank {rank} {k}: {m}",
                )
        torch.testing.assert_close(got[0]["c"].reshape(2, 2), params0["c"], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# complex leaves: torch.optim's definition (view_as_real) or a clear error
# ---------------------------------------------------------------------------------------------
COMPLEX_REFS = {
    "adam": (lambda: ft.adam(0.1), lambda p: torch.optim.Adam([p], lr=0.1)),
    "adam_amsgrad": (
        lambda: ft.adam(0.1, amsgrad=True, weight_decay=0.1),
        lambda p: torch.optim.Adam([p], lr=0.1, amsgrad=True, weight_decay=0.1),
    ),
    "adamw": (
        lambda: ft.adamw(0.1, weight_decay=0.1),
        lambda p: torch.optim.AdamW([p], lr=0.1, weight_decay=0.1),
    ),
    "sgd_nesterov": (
        lambda: ft.sgd(0.1, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True),
    ),
}


@pytest.mark.parametrize("use_step", [False, True], ids=["update+apply", "step"])
@pytest.mark.parametrize("name", list(COMPLEX_REFS))
def test_complex_params_follow_torch_optim(name, use_step):
    make, ref = COMPLEX_REFS[name]
    torch.manual_seed(0)
    p0 = torch.randn(4, 3, dtype=torch.complex64)
    gs = [torch.randn(4, 3, dtype=torch.complex64) for _ in range(4)]
    tx = make()
    params = {"w": p0.clone()}
    state = tx.init(params)
    for g in gs:
        if use_step:
            params, state = ft.step(tx, {"w": g}, state, params)
        else:
            u, state = tx.update({"w": g}, state, params)
            params = ft.apply_updates(params, u)
    p = p0.clone().requires_grad_(True)
    opt = ref(p)
    for g in gs:
        p.grad = g.clone()
        opt.step()
    assert params["w"].dtype == torch.complex64
    change = (p.detach() - p0).abs().max()
    assert (params["w"] - p.detach()).abs().max() <= 1e-5 * change + 1e-6


@pytest.mark.parametrize(
    "make",
    [
        ft.adafactor,
        lambda: ft.came(1e-3),
        lambda: ft.galore_adamw(1e-3, rank=1),
        lambda: ft.adamw(1e-3, optim_bits=8, min_8bit_size=0),
    ],
    ids=["adafactor", "came", "galore_adamw", "adamw_8bit"],
)
def test_complex_params_without_a_definition_raise(make):
    p = {"z": torch.randn(4, 3, dtype=torch.complex64)}
    tx = make()
    with pytest.raises(TypeError, match=r"'z' is torch.complex64; this transform has no complex"):
        tx.update({"z": torch.randn(4, 3, dtype=torch.complex64)}, tx.init(p), p)


# ---------------------------------------------------------------------------------------------
# hyper-parameters and the testing harness: what is accepted, what is said
# ---------------------------------------------------------------------------------------------
def test_learning_rate_accepts_numpy_scalars_and_one_element_tensors():
    import numpy as np

    p = {"w": torch.ones(3)}
    g = {"w": torch.ones(3)}
    want, _ = ft.sgd(0.5).update(g, ft.sgd(0.5).init(p), p)
    for lr in (
        np.float32(0.5),
        np.float64(0.5),
        torch.tensor(0.5),
        torch.tensor(0.5).double(),
        torch.tensor([0.5]),  # (one element, not 0-dim: torch.optim takes it)
    ):
        tx = ft.adamw(lr)  # accepted
        tx = ft.sgd(lr)
        u, _ = tx.update(g, tx.init(p), p)
        torch.testing.assert_close(u["w"], want["w"])
    with pytest.raises(ValueError, match=r"learning_rate as a tensor must have one element"):
        ft.sgd(torch.ones(2))
    with pytest.raises(TypeError, match=r"real number"):
        ft.sgd("0.1")


@pytest.mark.parametrize(
    "make",
    [
        lambda: ft.sgd(math.inf),
        lambda: ft.adamw(math.inf),
        lambda: ft.clip_by_global_norm(math.inf),
    ],
    ids=["sgd_lr", "adamw_lr", "max_norm"],
)
def test_infinite_hyper_parameters_raise(make):
    with pytest.raises(ValueError, match=r"must be finite, got inf"):
        make()


def test_assert_sharded_equivalent_argument_errors():
    from functional_train.testing import assert_sharded_equivalent

    p = {"w": torch.ones(4, 2)}
    with pytest.raises(TypeError, match=r"tx must be a GradientTransformation, got function"):
        assert_sharded_equivalent(lambda g: g, p, [p], placements={"w": None}, mesh_shape=(2,))
    with pytest.raises(ValueError, match=r"grads_per_step is empty"):
        assert_sharded_equivalent(ft.sgd(0.1), p, [], placements={"w": None}, mesh_shape=(2,))


def test_complex_clip_clamps_real_and_imaginary_parts():
    z = torch.tensor([[3.0 + 0.05j, -0.2 - 4.0j]], dtype=torch.complex64)
    u, _ = ft.clip(0.1).update({"z": z}, ft.clip(0.1).init({"z": z}), {"z": z})
    torch.testing.assert_close(
        u["z"], torch.tensor([[0.1 + 0.05j, -0.1 - 0.1j]], dtype=torch.complex64)
    )
