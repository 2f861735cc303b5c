"""``ft.differentially_private_aggregate`` (DP-SGD's aggregation, Abadi et al. 2016; optax's
``contrib.differentially_private_aggregate``): the clipped mean against Opacus' flat clipping,
the noise's distribution, determinism by seed, data-parallel replicas equal one process."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import functional_train as ft
from functional_train.testing import on_rank, simulate
from functional_train.testing.sim import per_rank

F64 = torch.float64


def _per_example(batch=6, seed=0, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(batch, 3, 4, generator=gen, dtype=F64) * scale,
        "b": torch.randn(batch, 5, generator=gen, dtype=F64) * scale,
    }


def _opacus_flat_clipping(grads: dict, max_grad_norm: float, expected_batch_size: int) -> dict:
    """Opacus' ``DPOptimizer`` with flat clipping and no noise, as its source computes it
    (``opacus/optimizers/optimizer.py``, ``clip_and_accumulate`` then ``add_noise`` and
    ``scale_grad`` with ``loss_reduction="mean"``, opacus 1.6): per-sample norms over every
    parameter, ``clip = (max_grad_norm / (norm + 1e-6)).clamp(max=1)``, ``einsum("i,i...")``,
    divided by ``expected_batch_size``. (``test_equals_opacus`` runs Opacus itself.)"""
    norms = torch.stack(
        [g.reshape(len(g), -1).norm(2, dim=-1) for g in grads.values()], dim=1
    ).norm(2, dim=1)
    clip = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.einsum("i,i...", clip, g) / expected_batch_size for k, g in grads.items()}


def _update(tx, grads, state=None, mesh=None):
    return tx.update(grads, tx.init(None) if state is None else state, mesh=mesh)


def test_noise_free_equals_opacus_flat_clipping():
    """Without noise: optax's clipped mean (``min(1, C / ||g_i||)``) exactly, and Opacus' flat
    clipping to its ``1e-6`` (which it adds to each norm), for examples above and below the
    bound, over 2 updates (the same each time)."""
    grads = _per_example()
    grads["w"][1] *= 0.01  # an example below the bound: not scaled
    grads["b"][1] *= 0.01
    tx = ft.differentially_private_aggregate(l2_norm_clip=5.0, noise_multiplier=0.0, seed=0)
    state = tx.init(None)
    norms = torch.sqrt(sum(g.reshape(6, -1).square().sum(1) for g in grads.values()))
    assert (norms > 5.0).sum() >= 3 and (norms < 5.0).sum() >= 1
    for _ in range(2):
        got, state = tx.update(grads, state)
        factor = torch.clamp(5.0 / norms, max=1.0)
        for k, g in grads.items():
            want = (g * factor.reshape(-1, *[1] * (g.ndim - 1))).sum(0) / 6
            torch.testing.assert_close(got[k], want, rtol=1e-13, atol=0)
        opacus = _opacus_flat_clipping(grads, 5.0, 6)
        for k in grads:
            assert got[k].shape == grads[k].shape[1:] and got[k].dtype == F64
            torch.testing.assert_close(got[k], opacus[k], rtol=1e-5, atol=1e-12)
    assert int(state.count) == 2


@pytest.mark.slow
def test_equals_opacus():
    """Opacus' own ``DPOptimizer`` (flat clipping, no noise, SGD with lr 1) moves the
    parameters by our aggregate, to Opacus' 1e-6 in its norms."""
    pytest.importorskip("opacus")
    from opacus.optimizers import DPOptimizer

    grads = _per_example()
    params = [torch.nn.Parameter(torch.zeros(g.shape[1:], dtype=F64)) for g in grads.values()]
    for p, g in zip(params, grads.values()):
        p.grad_sample = g.clone()
    opt = DPOptimizer(
        torch.optim.SGD(params, lr=1.0),
        noise_multiplier=0.0,
        max_grad_norm=5.0,
        expected_batch_size=6,
    )
    opt.step()
    got, _ = _update(ft.differentially_private_aggregate(5.0, 0.0, seed=0), grads)
    for (k, mine), p in zip(got.items(), params):
        torch.testing.assert_close(mine, -p.detach(), rtol=1e-5, atol=1e-12, msg=k)


def test_noise_distribution_and_seed():
    """Zero gradients: the update is the noise / B: mean 0 and standard deviation
    ``l2_norm_clip * noise_multiplier / B`` (20,000 draws: 5-sigma bounds), fresh at every
    update, the same for the same seed, different for another."""
    grads = {"w": torch.zeros(4, 100, 100, dtype=F64), "b": torch.zeros(4, 64, dtype=F32)}
    tx = ft.differentially_private_aggregate(l2_norm_clip=0.5, noise_multiplier=2.0, seed=7)
    u1, s = _update(tx, grads)
    u2, _ = tx.update(grads, s)
    noise = u1["w"].reshape(-1) * 4  # std 0.5 * 2.0 = 1
    n = noise.numel()
    assert abs(float(noise.mean())) < 5 / n**0.5
    assert abs(float(noise.std()) - 1.0) < 5 / (2 * n) ** 0.5
    assert u1["b"].dtype == F32 and abs(float(u1["b"].std()) * 4 - 1.0) < 0.3
    assert not torch.equal(u1["w"], u2["w"])  # a new draw per update
    again, _ = _update(ft.differentially_private_aggregate(0.5, 2.0, seed=7), grads)
    other, _ = _update(ft.differentially_private_aggregate(0.5, 2.0, seed=8), grads)
    assert torch.equal(again["w"], u1["w"]) and not torch.equal(other["w"], u1["w"])


F32 = torch.float32


def test_data_parallel_replicas_equal_one_process():
    """2 simulated data-parallel replicas, each with its own 3 examples: every replica gets
    the one-process result on the 6 examples with the same seed (the noise drawn once for the
    global batch, identical on the replicas), over 2 updates."""
    grads = _per_example(6)
    tx = ft.differentially_private_aggregate(1.0, 0.7, seed=3)
    want, state = _update(tx, grads)
    want2, _ = tx.update(grads, state)
    with simulate(2):
        dm = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        mesh = ft.Mesh(dm, data_axis="dp")
        local = {
            k: per_rank(2, lambda r, g=g: g[3 * r : 3 * r + 3].clone()) for k, g in grads.items()
        }
        got, state = _update(tx, local, mesh=mesh)
        got2, _ = tx.update(local, state, mesh=mesh)
        for r in range(2):
            for k in grads:
                torch.testing.assert_close(on_rank(got[k], r), want[k], rtol=1e-12, atol=1e-15)
                torch.testing.assert_close(on_rank(got2[k], r), want2[k], rtol=1e-12, atol=1e-15)


def test_per_example_clipping_of_vmap_grad():
    """``vmap(grad(loss))`` gives the per-example gradients the transform takes: DP-SGD on a
    linear model equals clipping each example's gradient by hand."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, generator=gen, dtype=F64), "b": torch.zeros(2, dtype=F64)}
    x = torch.randn(5, 3, generator=gen, dtype=F64)
    y = torch.randn(5, 2, generator=gen, dtype=F64)

    def loss(p, xi, yi):
        return ((xi @ p["w"] + p["b"] - yi) ** 2).sum()

    per_ex = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    got, _ = _update(ft.differentially_private_aggregate(0.8, 0.0, seed=0), per_ex)
    for k in params:
        want = torch.zeros_like(params[k])
        for i in range(5):
            gi = torch.func.grad(loss)(params, x[i], y[i])
            norm = torch.sqrt(sum((v**2).sum() for v in gi.values()))
            want += gi[k] * min(1.0, 0.8 / float(norm))
        torch.testing.assert_close(got[k], want / 5, rtol=1e-12, atol=1e-15)


def test_bad_input_names_the_leaf():
    tx = ft.differentially_private_aggregate(1.0, 1.0, seed=0)
    with pytest.raises(
        ValueError, match=r"update leaf 'b' has shape \(4,\).*the first leaf's is 3"
    ):
        _update(tx, {"a": torch.zeros(3, 2), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"l2_norm_clip must be > 0.0"):
        ft.differentially_private_aggregate(0.0, 1.0, seed=0)
    with pytest.raises(ValueError, match=r"noise_multiplier must be >= 0.0"):
        ft.differentially_private_aggregate(1.0, -1.0, seed=0)
    with pytest.raises(TypeError, match=r"seed must be an int"):
        ft.differentially_private_aggregate(1.0, 1.0, seed=0.5)
