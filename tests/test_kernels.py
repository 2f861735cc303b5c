"""The pure step's compiled out-of-place kernels (functional_train/engine/kernels.py): the
primitives' numbers, inputs untouched, compiled once per configuration, elementwise (a shard
computes what the whole tensor computes), and a clean fallback where compiling fails."""

import pytest
import torch

import functional_train as ft
from functional_train.engine import kernels


@pytest.fixture
def compiled(monkeypatch):
    """Every leaf of 64 elements or more on the compiled path, whatever the tree's size."""
    monkeypatch.setattr(kernels, "MIN_BYTES", 0)
    monkeypatch.setattr(kernels, "MIN_LEAF_NUMEL", 64)
    monkeypatch.setattr(kernels, "ENABLED", True)
    monkeypatch.setattr(kernels, "_failed", False)


def _tree(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (37, 20), "w": (20, 20), "w2": (13, 11), "bias": (20,), "scale": (3,),
              "tall": (65, 3)}  # uneven sizes; bias and scale stay on torch's kernel
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}


CONFIGS = {
    "clip+adamw": lambda: ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1)),
    "adam l2 amsgrad maximize": lambda: ft.adam(1e-2, b1=0.8, weight_decay=0.1, amsgrad=True,
                                                maximize=True),
    "adamw mask schedule": lambda: ft.adamw(
        ft.schedules.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1,
        mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
    "clip+sgd nesterov wd": lambda: ft.chain(
        ft.clip_by_global_norm(0.5), ft.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
}


def _gradients_and_inputs(i, p, s):
    """Step ``i``'s gradients (seeded, scaled by ``i + 1``), every tensor a step on them, ``p``
    and ``s`` receives, and copies of those (to check that a pure step modifies none)."""
    gen = torch.Generator().manual_seed(100 + i)
    g = {k: torch.randn(v.shape, generator=gen) * (i + 1) for k, v in p.items()}
    inputs = [x for x in torch.utils._pytree.tree_leaves((g, p, s)) if isinstance(x, torch.Tensor)]
    return g, inputs, [x.clone() for x in inputs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pure_step_equals_the_primitives(compiled, monkeypatch, name):
    """Five steps of ``ft.step(donate=False)`` through the compiled kernels equal
    ``tx.update`` + ``apply_updates`` (rtol 1e-5 on the parameter change, states to float
    rounding); gradients, parameters and state are not modified; no recompilation across
    steps; the large leaves do not go through torch's in-place kernels."""
    torch._dynamo.reset()
    kernels._compiled.clear()
    tx = CONFIGS[name]()
    p0 = _tree(torch.float32)
    p, s = p0, tx.init(p0)
    q, r = p0, tx.init(p0)
    sizes = []
    for kernel in ("_fused_adamw_", "_fused_adam_", "_fused_sgd_"):
        real = getattr(torch, kernel)
        monkeypatch.setattr(torch, kernel, lambda *a, _r=real, **k: sizes.extend(
            x.numel() for x in a[0]) or _r(*a, **k))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(5):
            g, inputs, before = _gradients_and_inputs(i, p, s)
            p, s = ft.step(tx, g, s, p)
            assert all(torch.equal(a, b) for a, b in zip(before, inputs))
            u, r = tx.update(g, r, q)
            q = ft.apply_updates(q, u)
    assert kernels._compiled, "the compiled path did not run"
    assert sizes and max(sizes) < 64  # only the small leaves went through torch's kernels
    for k in p0:
        change = (q[k] - p0[k]).abs().max()
        assert (p[k] - q[k]).abs().max() <= 1e-5 * change, k
    for a, b in zip(torch.utils._pytree.tree_leaves(s), torch.utils._pytree.tree_leaves(r)):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            # float rounding relative to the state's scale: a moment that cancels to near 0
            # (b1 m + (1 - b1) g of opposite signs) keeps the absolute rounding of its terms
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b)


def test_inputs_untouched_and_float64(compiled):
    """float64 trees (their own compiled configuration) agree with the primitives to 1e-12 of
    the change, and a pure step leaves every input as it was."""
    torch._dynamo.reset()
    tx = ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1))
    p0 = _tree(torch.float64)
    s0 = tx.init(p0)
    g = {k: torch.randn_like(v) for k, v in p0.items()}
    copies = [x.clone() for x in (*g.values(), *p0.values())]
    p1, s1 = ft.step(tx, g, s0, p0)
    p2, s2 = ft.step(tx, g, s1, p1)
    assert all(torch.equal(a, b) for a, b in zip(copies, (*g.values(), *p0.values())))
    u, r = tx.update(g, s0, p0)
    q1 = ft.apply_updates(p0, u)
    u, r = tx.update(g, r, q1)
    q2 = ft.apply_updates(q1, u)
    for k in p0:
        assert (p2[k] - q2[k]).abs().max() <= 1e-12 * (q2[k] - p0[k]).abs().max(), k
    assert any(key[-1] == torch.float64 for key in kernels._compiled)


def test_a_shard_computes_what_the_whole_tensor_computes(compiled):
    """Elementwise to the bit: the kernel on slices of a leaf at any offset and length (the
    vectorised body and the tail of each differ) equals the kernel on the whole leaf, so
    sharded equals unsharded as for torch's kernels."""
    n = 1001
    gen = torch.Generator().manual_seed(1)
    p, g, m, v = (torch.randn(n, generator=gen) for _ in range(4))
    v = v.abs()
    kw = dict(coef=torch.tensor(0.7), lr=1e-2, weight_decay=0.1, b1=0.9, b2=0.999, eps=1e-8,
              count=torch.tensor(3), decoupled=True, amsgrad=False, maximize=False)
    whole = [torch.empty(n) for _ in range(3)]
    assert kernels.adam_pure([p], [g], [m], [v], None, *[[w] for w in whole], None, **kw)
    parts = [(0, 333), (333, 334), (334, 999), (999, 1001)]
    outs = [torch.full((n,), float("nan")) for _ in range(3)]
    sl = [[x[a:b] for a, b in parts] for x in (p, g, m, v, *outs)]
    assert kernels.adam_pure(*sl[:4], None, *sl[4:], None, **kw)
    for a, b in zip(whole, outs):
        assert torch.equal(a, b)


def test_fallback_when_compiling_fails(compiled, monkeypatch):
    """Where inductor cannot compile (no C++ compiler...), the step warns once and takes the
    copy + in-place path, with the same numbers."""
    kernels._compiled.clear()

    def broken(*a, **k):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(torch, "compile", broken)
    tx = ft.adamw(1e-2, weight_decay=0.1)
    p0 = _tree(torch.float32)
    g = {k: torch.randn_like(v) for k, v in p0.items()}
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        p1, _ = ft.step(tx, g, tx.init(p0), p0)
    assert kernels._failed
    u, _ = tx.update(g, tx.init(p0), p0)
    q1 = ft.apply_updates(p0, u)
    for k in p0:
        torch.testing.assert_close(p1[k], q1[k], rtol=1e-6, atol=1e-7)


def test_off_below_the_size_threshold():
    """Small trees (the default ``MIN_BYTES``: 16 MiB of large leaves) keep torch's kernels:
    nothing is compiled for them."""
    assert kernels.large_leaves([torch.zeros(1000, 1000)]) == []
    assert kernels.large_leaves([torch.zeros(100)]) == []


CONFIGS_8BIT = {
    "adamw": lambda: ft.adamw(1e-2, weight_decay=0.1, optim_bits=8),
    "adamw mask schedule": lambda: ft.adamw(
        ft.schedules.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1, optim_bits=8,
        mask=lambda p: {k: k != "v" for k in p}),
    "adam l2 maximize": lambda: ft.adam(1e-2, b1=0.8, weight_decay=0.1, optim_bits=8,
                                        maximize=True),
    "injected adamw": lambda: ft.inject_hyperparams(ft.adamw)(
        learning_rate=1e-2, b1=0.9, weight_decay=0.1, optim_bits=8),
}


@pytest.mark.parametrize("name,donate", [  # each configuration, pure and donated alternately
    ("adamw", False), ("adamw mask schedule", True), ("adam l2 maximize", False),
    ("injected adamw", True)])
def test_8bit_step_through_the_compiled_kernel(monkeypatch, name, donate):
    """``ft.step`` of 8-bit Adam / AdamW: the quantised leaves whose last dim is a multiple of
    the block size, or below it (96: each row one block), go through the compiled kernel (one
    call each, leaves of four sizes, no recompilation), the others (float moments, a
    300-wide leaf) through the chain. Over 4
    steps the codes, block maxima and float moments equal ``update`` + ``apply_updates`` bit
    for bit; the parameters to an ulp per step (the kernel's square root is correctly rounded,
    torch's vectorised one on AVX-512 is not); a pure step leaves its inputs alone."""
    from functional_train.engine import kernels

    monkeypatch.setattr(kernels, "ENABLED", True)
    monkeypatch.setattr(kernels, "_failed", False)
    calls = []
    real = kernels.adam8bit
    monkeypatch.setattr(kernels, "adam8bit", lambda ins, *a, **k: calls.append(
        [tuple(x[0].shape) for x in ins]) or real(ins, *a, **k))
    gen = torch.Generator().manual_seed(3)
    p0 = {"w": torch.randn(40, 512, generator=gen), "v": torch.randn(24, 256, generator=gen),
          "u": torch.randn(5120, generator=gen), "b": torch.randn(300, generator=gen),
          "narrow": torch.randn(50, 96, generator=gen), "odd": torch.randn(15, 300, generator=gen)}
    tx = CONFIGS_8BIT[name]()
    p, s = {k: v.clone() for k, v in p0.items()}, tx.init(p0)
    q, r = p0, tx.init(p0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(4):
            g = {k: torch.randn(v.shape, generator=gen) * (i + 1) for k, v in p0.items()}
            inputs = [x for x in torch.utils._pytree.tree_leaves((g, p, s))
                      if isinstance(x, torch.Tensor)]
            before = [x.clone() for x in inputs]
            p, s = ft.step(tx, g, s, p, donate=donate)
            if not donate:
                assert all(torch.equal(a, b) for a, b in zip(before, inputs))
            u, r = tx.update(g, r, q)
            q = ft.apply_updates(q, u)
    assert not kernels._failed
    assert [sorted(c) for c in calls] == [[(24, 256), (40, 512), (50, 96), (5120,)]] * 4
    for a, b in zip(torch.utils._pytree.tree_leaves(s), torch.utils._pytree.tree_leaves(r)):
        assert (a is None and b is None) or torch.equal(a, b)
    for k in p0:
        # an ulp of the largest operand of the 4 additions, per step
        ulp = torch.finfo(torch.float32).eps * torch.maximum(q[k].abs(), p0[k].abs())
        assert ((p[k] - q[k]).abs() <= 4 * ulp).all(), k
        if k in ("b", "odd"):  # the chain's own leaves
            assert torch.equal(p[k], q[k]), k


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_step_runs_the_eager_kernels(compiled, monkeypatch, name):
    """``torch.compile(ft.step, fullgraph=True)`` of sgd / adam / adamw (after a clip, with a
    mask and a schedule) calls the eager pure step through one operator
    (``functional_train::pure_fused_step``): four steps equal the eager pure step bit for bit,
    parameters and state; the inputs are untouched; the schedule's changing learning rate
    recompiles nothing, neither the step nor the kernels inside the operator."""
    torch._dynamo.reset()
    kernels._compiled.clear()
    import sys
    mod = sys.modules["functional_train.step"]
    calls = []
    real = mod._pure
    monkeypatch.setattr(mod, "_pure", lambda *a, **k: calls.append(1) or real(*a, **k))
    tx = CONFIGS[name]()
    p0 = _tree(torch.float32)
    fn = torch.compile(lambda g, s, p: ft.step(tx, g, s, p), fullgraph=True)
    p, s = p0, tx.init(p0)
    q, r = p0, tx.init(p0)
    for i in range(4):
        g, inputs, before = _gradients_and_inputs(i, p, s)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            p, s = fn(g, s, p)
        assert all(torch.equal(a, b) for a, b in zip(before, inputs))
        q, r = ft.step(tx, g, r, q)
    assert len(calls) == 8  # 4 compiled, 4 eager
    assert kernels._compiled, "the compiled kernels did not run"
    for k in p0:
        assert torch.equal(p[k], q[k]), k
    for a, b in zip(torch.utils._pytree.tree_leaves(s), torch.utils._pytree.tree_leaves(r)):
        assert torch.equal(a, b)
    torch._dynamo.reset()
