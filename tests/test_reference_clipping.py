"""Single-process reference tests: clipping against torch.nn.utils (plain tensors, mesh=None)."""

from __future__ import annotations

import math

import optree
import pytest
import torch

import functional_train as ft

SHAPES = {"a": {"w": (4, 3), "t": (2, 3, 5)}, "v": (7,), "s": (), "q": (2, 1, 3, 2)}
NORM_TYPES = [2.0, 1.0, 3.0, 0.5, math.inf]


def _is_shape(x):
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_tree(seed=0, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return optree.tree_map(
        lambda s: (scale * torch.randn(s, generator=gen)).to(dtype), SHAPES, is_leaf=_is_shape
    )


def leaves(tree):
    return optree.tree_leaves(tree, none_is_leaf=True)


def clone(tree):
    return optree.tree_map(lambda x: None if x is None else x.clone(), tree, none_is_leaf=True)


def torch_clip_norm(grads, max_norm, norm_type):
    """torch.nn.utils.clip_grad_norm_ on parameters holding ``grads``: (clipped leaves, norm)."""
    ps = []
    for g in leaves(grads):
        p = (
            torch.zeros_like(g, requires_grad=True)
            if g is not None
            else torch.zeros(1, requires_grad=True)
        )
        p.grad = None if g is None else g.clone()
        ps.append(p)
    total = torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type)
    return [None if p.grad is None else p.grad for p in ps], total


def reference_norm(grads, norm_type):
    flat = torch.cat([g.double().reshape(-1) for g in leaves(grads) if g is not None])
    return torch.linalg.vector_norm(flat, norm_type)


def assert_norm_close(ours, ref):
    torch.testing.assert_close(ours.double(), ref.double(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# global_norm
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_global_norm_matches_vector_norm_of_concatenation(norm_type):
    g = make_tree()
    n = ft.global_norm(g, norm_type=norm_type)
    assert n.dim() == 0 and n.dtype == torch.float32
    assert_norm_close(n, reference_norm(g, norm_type))


def test_global_norm_default_is_l2():
    g = make_tree()
    assert_norm_close(ft.global_norm(g), reference_norm(g, 2.0))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_global_norm_skips_none_leaves(norm_type):
    g = make_tree()
    g["v"] = None
    assert_norm_close(ft.global_norm(g, norm_type=norm_type), reference_norm(g, norm_type))


def test_global_norm_bf16_leaves():
    g = make_tree(dtype=torch.bfloat16)
    n = ft.global_norm(g)
    assert n.dtype == torch.float32
    torch.testing.assert_close(n.double(), reference_norm(g, 2.0), rtol=1e-2, atol=0.0)


def test_global_norm_is_pure():
    g = make_tree()
    c = clone(g)
    ft.global_norm(g, norm_type=3.0)
    for a, b in zip(leaves(g), leaves(c)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# clip_by_global_norm
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("active", [False, True], ids=["inactive", "active"])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clip_by_global_norm_matches_torch(norm_type, active):
    params = make_tree(seed=0)
    state = None  # one state carried across steps; max_norm is chosen per step from the norm
    for step in range(3):
        grads = make_tree(seed=10 + step, scale=1.0 + step)
        norm = float(reference_norm(grads, norm_type))
        max_norm = 10.0 * norm if not active else 0.3 * norm
        tx = ft.clip_by_global_norm(max_norm, norm_type)
        if state is None:
            state = tx.init(params)
            assert isinstance(state, ft.ClipByGlobalNormState)
            assert state.global_norm.dim() == 0 and state.global_norm.dtype == torch.float32
        updates, state = tx.update(grads, state, params)
        theirs, total = torch_clip_norm(grads, max_norm, norm_type)
        assert_norm_close(state.global_norm, total)
        for u, t, g in zip(leaves(updates), theirs, leaves(grads)):
            assert u.shape == g.shape and u.dtype == g.dtype
            torch.testing.assert_close(u, t, rtol=1e-5, atol=1e-7)
            if not active:
                assert torch.equal(u, g)  # coefficient exactly 1
        out_norm = float(ft.global_norm(updates, norm_type=norm_type))
        if active:
            assert out_norm == pytest.approx(max_norm, rel=1e-4)
        else:
            assert out_norm == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clip_by_global_norm_in_chain_keeps_pre_clip_norm(norm_type):
    params = make_tree(seed=0)
    tx = ft.chain(ft.clip_by_global_norm(0.5, norm_type), ft.sgd(0.1, momentum=0.9))
    state = tx.init(params)
    for step in range(3):
        grads = make_tree(seed=20 + step)
        _, state = tx.update(grads, state, params)
        _, total = torch_clip_norm(grads, 0.5, norm_type)
        assert_norm_close(ft.tree_get(state, "global_norm"), total)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clip_by_global_norm_none_leaves_pass_through(norm_type):
    params = make_tree(seed=0)
    grads = make_tree(seed=1)
    grads["a"]["t"] = None
    tx = ft.clip_by_global_norm(0.1, norm_type)
    updates, state = tx.update(grads, tx.init(params), params)
    assert updates["a"]["t"] is None
    theirs, total = torch_clip_norm(grads, 0.1, norm_type)
    assert_norm_close(state.global_norm, total)
    for u, t in zip(leaves(updates), theirs):
        if t is None:
            assert u is None
        else:
            torch.testing.assert_close(u, t, rtol=1e-5, atol=1e-7)


def test_clip_by_global_norm_zero_gradients():
    params = make_tree(seed=0)
    grads = optree.tree_map(torch.zeros_like, params)
    tx = ft.clip_by_global_norm(1.0)
    updates, state = tx.update(grads, tx.init(params), params)
    assert float(state.global_norm) == 0.0
    for u in leaves(updates):
        assert torch.equal(u, torch.zeros_like(u)) and torch.isfinite(u).all()


def test_clip_by_global_norm_default_norm_type_is_2():
    params = make_tree(seed=0)
    grads = make_tree(seed=3)
    tx = ft.clip_by_global_norm(0.2)
    updates, state = tx.update(grads, tx.init(params), params)
    theirs, total = torch_clip_norm(grads, 0.2, 2.0)
    assert_norm_close(state.global_norm, total)
    for u, t in zip(leaves(updates), theirs):
        torch.testing.assert_close(u, t, rtol=1e-5, atol=1e-7)


def test_clip_by_global_norm_works_without_params():
    grads = make_tree(seed=3)
    tx = ft.clip_by_global_norm(0.2)
    updates, state = tx.update(grads, tx.init(grads))
    theirs, total = torch_clip_norm(grads, 0.2, 2.0)
    assert_norm_close(state.global_norm, total)
    for u, t in zip(leaves(updates), theirs):
        torch.testing.assert_close(u, t, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_by_global_norm_is_pure(norm_type):
    params = make_tree(seed=0)
    grads = make_tree(seed=1)
    tx = ft.clip_by_global_norm(0.1, norm_type)
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    p_c, g_c, s_c = clone(params), clone(grads), clone(state)
    tx.update(grads, state, params)
    for a, b in zip(leaves((params, grads, state)), leaves((p_c, g_c, s_c))):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# clip (by value)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_delta", [0.05, 0.5, 1.0, 100.0])
def test_clip_matches_clip_grad_value(max_delta):
    params = make_tree(seed=0)
    grads = make_tree(seed=5, scale=2.0)
    tx = ft.clip(max_delta)
    state = tx.init(params)
    assert state == ft.EmptyState()
    g_c = clone(grads)
    updates, state = tx.update(grads, state, params)
    assert state == ft.EmptyState()
    ps = []
    for g in leaves(grads):
        p = torch.zeros_like(g, requires_grad=True)
        p.grad = g.clone()
        ps.append(p)
    torch.nn.utils.clip_grad_value_(ps, max_delta)
    for u, p in zip(leaves(updates), ps):
        assert u.dtype == p.grad.dtype
        assert torch.equal(u, p.grad)
    for a, b in zip(leaves(grads), leaves(g_c)):
        assert torch.equal(a, b)  # pure


def test_clip_none_leaves_and_bf16():
    grads = make_tree(seed=5, scale=2.0, dtype=torch.bfloat16)
    grads["v"] = None
    tx = ft.clip(0.5)
    updates, _ = tx.update(grads, tx.init(grads))
    assert updates["v"] is None
    for u, g in zip(leaves(updates), leaves(grads)):
        if g is None:
            continue
        assert u.dtype == torch.bfloat16
        assert torch.equal(u, g.clamp(-0.5, 0.5))
