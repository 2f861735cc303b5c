"""Weight-decay masks: ``mask=`` on ``add_decayed_weights``, ``adamw``, ``lamb``, ``adafactor``
and ``came`` (optax's semantics) and ``ft.decay_mask``.

* ``adamw(mask=...)`` equals ``torch.optim.AdamW`` with two parameter groups (decayed and
  ``weight_decay=0``) over several steps, through ``update`` + ``apply_updates`` and through
  ``ft.step``'s fused kernel, pure and donated, with a tree mask and a callable mask;
* masked-out leaves are exactly the undecayed transform's (adamw, lamb, adafactor with and
  without ``beta1``, came), and ``ft.step``'s per-leaf adafactor and came paths equal the chain
  bit for bit with a mask;
* ``decay_mask`` excludes biases, norm gains, embeddings and every leaf under 2 dims by path;
* sharded (2 x 2 simulated mesh, uneven shards) equals unsharded;
* a mask of the wrong structure or with non-bool leaves raises, naming the leaf.
"""

from __future__ import annotations

import optree
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import functional_train as ft
from _layouts import check_fused_step
from functional_train.testing import assert_sharded_equivalent

STEPS = 5


def _params(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "embed": (11, 6),
        "layers": [{"wq": (6, 6), "attn_norm": (6,), "w1": (9, 6), "b1": (9,)}],
        "lm_head": (6, 11),
        "scale": (),
    }
    return optree.tree_map(
        lambda s: torch.randn(s, generator=gen, dtype=dtype),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x),
    )


def _grads(params, steps=STEPS):
    gen = torch.Generator().manual_seed(1)
    return [
        optree.tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=p.dtype), params)
        for _ in range(steps)
    ]


def test_decay_mask_by_path_and_dims():
    m = ft.decay_mask(_params())
    assert m == {
        "embed": False,
        "layers": [{"wq": True, "attn_norm": False, "w1": True, "b1": False}],
        "lm_head": True,
        "scale": False,
    }
    named = {
        "model.embed_tokens.weight": torch.ones(3, 2),
        "model.layers.0.mlp.up.weight": torch.ones(2, 2),
        "model.layers.0.input_layernorm.weight": torch.ones(2, 2),
        "transformer.wte.weight": torch.ones(3, 2),
        "h.0.ln_1.weight": torch.ones(2, 2),
        "h.0.attn.c_attn.bias": torch.ones(2, 2),
        "frozen": None,
    }
    assert ft.decay_mask(named) == {
        "model.embed_tokens.weight": False,
        "model.layers.0.mlp.up.weight": True,
        "model.layers.0.input_layernorm.weight": False,
        "transformer.wte.weight": False,
        "h.0.ln_1.weight": False,
        "h.0.attn.c_attn.bias": False,
        "frozen": False,
    }
    assert ft.decay_mask(named, exclude=("up",))["model.embed_tokens.weight"] is True


def _torch_adamw_groups(params, grads, mask, lr, wd):
    p_leaves, treedef = optree.tree_flatten(params)
    keep = optree.tree_leaves(mask)
    tp = [p.detach().clone().requires_grad_(True) for p in p_leaves]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p, k in zip(tp, keep) if k], "weight_decay": wd},
            {"params": [p for p, k in zip(tp, keep) if not k], "weight_decay": 0.0},
        ],
        lr=lr,
    )
    for g in grads:
        for p, gl in zip(tp, optree.tree_leaves(g)):
            p.grad = gl.clone()
        opt.step()
    return optree.tree_unflatten(treedef, [p.detach() for p in tp])


@pytest.mark.parametrize("how", ["update", "step", "step_donate"])
@pytest.mark.parametrize("as_callable", [False, True], ids=["tree", "callable"])
def test_adamw_mask_equals_torch_param_groups(how, as_callable):
    params, lr, wd = _params(), 1e-2, 0.3
    grads = _grads(params)
    mask = ft.decay_mask(params)
    want = _torch_adamw_groups(params, grads, mask, lr, wd)
    tx = ft.adamw(lr, weight_decay=wd, mask=ft.decay_mask if as_callable else mask)
    p = optree.tree_map(torch.clone, params)
    s = tx.init(p)
    for g in grads:
        if how == "update":
            u, s = tx.update(g, s, p)
            p = ft.apply_updates(p, u)
        else:
            p, s = ft.step(tx, optree.tree_map(torch.clone, g), s, p, donate=how == "step_donate")
    for a, b, p0 in zip(
        optree.tree_leaves(p), optree.tree_leaves(want), optree.tree_leaves(params)
    ):
        torch.testing.assert_close(a - p0, b - p0, rtol=1e-9, atol=1e-12)


@pytest.mark.usefixtures("recognised_path")
def test_adamw_fused_path_is_taken_with_a_mask(monkeypatch):
    """The fused kernel runs (two calls: decayed leaves, then the others; torch's in place for
    a donated step, on copies for a pure step: the path CUDA takes) and equals the chain to
    float rounding in float32."""
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(
        torch,
        "_fused_adamw_",
        lambda *a, **k: calls.append((len(a[0]), k["weight_decay"])) or real(*a, **k),
    )
    params = _params(torch.float32)
    tx = ft.adamw(1e-2, weight_decay=0.3, mask=ft.decay_mask)
    s = tx.init(params)
    g = _grads(params, 1)[0]
    u, _ = tx.update(g, s, params)
    want = ft.apply_updates(params, u)
    for donate in (False, True):
        calls.clear()
        p, _ = ft.step(tx, g, s, optree.tree_map(torch.clone, params), donate=donate)
        assert calls == [(3, 0.3), (4, 0.0)], donate
        for a, b in zip(optree.tree_leaves(p), optree.tree_leaves(want)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "make",
    [
        lambda wd, mask: ft.adamw(1e-2, weight_decay=wd, mask=mask),
        lambda wd, mask: ft.lamb(1e-2, weight_decay=wd, mask=mask),
        lambda wd, mask: ft.chain(ft.add_decayed_weights(wd, mask=mask), ft.sgd(0.1)),
    ],
    ids=["adamw", "lamb", "add_decayed_weights"],
)
def test_masked_out_leaves_are_the_undecayed_transform(make):
    """Leaf by leaf: masked-in leaves equal the decayed transform, masked-out ones the transform
    with ``weight_decay=0`` (every transform here is per leaf), over several steps, states too."""
    params = _params()
    grads = _grads(params)
    mask = ft.decay_mask(params)

    def run(tx):
        p, s = params, tx.init(params)
        for g in grads:
            u, s = tx.update(g, s, p)
            p = ft.apply_updates(p, u)
        return p, s

    got, s_got = run(make(0.2, mask))
    dec, s_dec = run(make(0.2, None))
    plain, s_plain = run(make(0.0, None))
    for a, b, c, k in zip(
        optree.tree_leaves(got),
        optree.tree_leaves(dec),
        optree.tree_leaves(plain),
        optree.tree_leaves(mask),
    ):
        torch.testing.assert_close(a, b if k else c, rtol=0, atol=0)
        if not k and a.ndim:  # the decay mattered for this leaf (LAMB's trust ratio makes a
            assert not torch.equal(b, c)  # scalar's step size independent of it)
    assert optree.tree_structure(s_got) == optree.tree_structure(s_dec)


def test_mask_sharded_equals_unsharded():
    params = {
        "w": torch.randn(7, 6, dtype=torch.float64),
        "norm": torch.randn(6, dtype=torch.float64),
        "embed": torch.randn(9, 6, dtype=torch.float64),
    }
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(3)]
    placements = {
        "w": [Shard(0), Shard(1)],
        "norm": [Replicate(), Shard(0)],
        "embed": [Shard(1), Replicate()],
    }
    for tx in (
        ft.adamw(1e-2, weight_decay=0.3, mask=ft.decay_mask),
        ft.lamb(1e-2, weight_decay=0.3, mask=ft.decay_mask),
    ):
        assert_sharded_equivalent(
            tx, params, grads, mesh_shape=(2, 2), placements=placements, rtol=1e-9, atol=1e-12
        )


def test_bad_masks_name_the_leaf():
    params = _params()
    g = _grads(params, 1)[0]
    with pytest.raises(ValueError):
        ft.adamw(weight_decay=0.1, mask={"embed": True}).init(params)
    bad = ft.decay_mask(params)
    bad["layers"][0]["wq"] = 1
    with pytest.raises(TypeError, match="layers.0.wq"):
        ft.adamw(weight_decay=0.1, mask=bad).init(params)
    tx = ft.add_decayed_weights(0.1, mask=lambda p: {"embed": True})
    with pytest.raises(ValueError):
        tx.update(g, ft.EmptyState(), params)  # the callable's tree lacks most leaves


_FACTORED = [
    lambda wd, mask: ft.adafactor(weight_decay=wd, mask=mask),
    lambda wd, mask: ft.adafactor(1e-2, beta1=0.9, weight_decay=wd, relative_step=False, mask=mask),
    lambda wd, mask: ft.came(1e-2, weight_decay=wd, mask=mask),
]


@pytest.mark.parametrize("make", _FACTORED, ids=["adafactor", "adafactor_beta1", "came"])
def test_factored_masked_out_leaves_are_the_undecayed_transform(make):
    test_masked_out_leaves_are_the_undecayed_transform(make)


@pytest.mark.parametrize("make", [_FACTORED[0], _FACTORED[2]], ids=["adafactor", "came"])
def test_factored_per_leaf_step_with_a_mask_equals_the_chain(make, monkeypatch):
    """``ft.step``'s per-leaf paths decay only the masked-in leaves: bit for bit the chain."""
    name = "fused_came_step" if make is _FACTORED[2] else "fused_adafactor_step"
    shapes = {
        "w": (6, 5),
        "b": (7,),
        "embed": (300, 260),
        "big": (260, 300),
        "vec": (40000,),
        "frozen": (40, 30),
    }
    check_fused_step(
        lambda: make(0.1, ft.decay_mask), torch.float32, monkeypatch, name, shapes=shapes
    )
