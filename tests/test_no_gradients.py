"""Steps where no leaf has a gradient: every ``None`` (a step that touched no trainable
parameter), a ``partition`` label that owns no leaf, a frozen group. torch.optim makes such a
step a no-op (a parameter whose ``.grad`` is ``None`` is skipped, its state untouched); here
every public transform (the sweep's registry, ``tests/_sweep_registry.py``) keeps the
parameters, and its state is what it is for a single ``None`` leaf, through ``update``, the
pure and the donated ``ft.step``."""

from __future__ import annotations

import copy

import optree
import pytest
import torch

import _sweep_registry as reg  # noqa: E402  (tests/ is on sys.path)
import functional_train as ft
from _layouts import close, step_by_mode  # noqa: E402

ENTRIES = reg.all_entries()
SHAPES = {"w": (4, 3), "m": (3, 5), "v": (5,), "t": (2, 3, 4)}
MODES = ["update", "pure", "donate"]


def _tree(seed: int, shapes: dict = SHAPES) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v, generator=gen) for k, v in shapes.items()}


def _clone(tree):
    return optree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True
    )


def _by_leaf(state) -> dict:
    """The state's tensor leaves under a params-tree key (moments, statistics, accumulators,
    per-leaf flags), ``(path, leaf key) -> tensor``."""
    paths, leaves, _ = optree.tree_flatten_with_path(state, none_is_leaf=True)
    return {
        (p, p[-1]): x
        for p, x in zip(paths, leaves)
        if isinstance(x, torch.Tensor) and p and p[-1] in SHAPES
    }


def _step(tx, grads, state, params, mode):
    """One step (``step_by_mode``) that also returns the updates of ``update``."""
    if mode == "update":
        u, state = tx.update(grads, state, params)
        return ft.apply_updates(params, u), state, u
    p, state = step_by_mode(tx, grads, state, params, mode)
    return p, state, None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_a_step_without_gradients_keeps_the_params(name, mode):
    """After two steps with gradients, a step whose gradients are all ``None`` does not raise,
    keeps every parameter bit for bit (``None`` updates), and leaves each leaf's state as a
    step where only that leaf's gradient is ``None`` leaves it (the library's rule for a
    ``None`` leaf: torch.optim's for a parameter without ``.grad``)."""
    tx = ENTRIES[name]()
    params = _tree(0)
    state = tx.init(params)
    for t in range(2):
        params, state = ft.step(tx, _tree(1 + t), state, params)
    none = dict.fromkeys(SHAPES)
    got_p, got_s, u = _step(tx, none, _clone(state), _clone(params), mode)
    for k in SHAPES:
        assert torch.equal(got_p[k], params[k]), f"params['{k}'] changed"
    if u is not None:
        assert all(u[k] is None for k in SHAPES), "an update that is not None"
    # the same leaf without a gradient in a step where another leaf has one
    g = _tree(9)
    only_w = {k: g[k] if k == "w" else None for k in SHAPES}
    only_m = {k: g[k] if k == "m" else None for k in SHAPES}
    _, ref_w = tx.update(only_w, _clone(state), params)  # (the reference for m, v, t)
    _, ref_m = tx.update(only_m, _clone(state), params)  # (for w)
    got, want_w, want_m = _by_leaf(got_s), _by_leaf(ref_w), _by_leaf(ref_m)
    assert got.keys() == want_w.keys()
    for (path, leaf), x in got.items():
        want = (want_m if leaf == "w" else want_w)[(path, leaf)]
        assert torch.equal(x, want), f"state {'.'.join(map(str, path))} differs"


# ---------------------------------------------------------------------------------------------
# the reported cases, against torch.optim
# ---------------------------------------------------------------------------------------------
def _torch_run(params, grads, make_opt, clip=None):
    """torch.optim over copies of ``params`` (``nn.Parameter``); a ``None`` gradient tree is a
    step with every ``.grad`` ``None``. Returns the params after each step."""
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = make_opt(list(ref.values()))
    out = []
    for g in grads:
        for k, p in ref.items():
            p.grad = None if g is None or g[k] is None else g[k].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(ref.values()), clip)
        opt.step()
        out.append({k: p.detach().clone() for k, p in ref.items()})
    return out


def _ft_run(tx, params, grads, mode):
    state, p, out = tx.init(params), _clone(params), []
    for g in grads:
        g = dict.fromkeys(params) if g is None else _clone(g)
        p, state, _ = _step(tx, g, state, p, mode)
        out.append(_clone(p))
    return out


def _assert_runs_equal(got, want, rtol, atol, what):
    for t, (a, b) in enumerate(zip(got, want)):
        for k in b:
            close(a[k], b[k], rtol, atol, f"{what}, step {t}, '{k}'")


GRADS = [_tree(1), None, _tree(2), None, None, _tree(3)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_without_gradients_is_torch_no_op(mode, nesterov):
    """``sgd(momentum)`` on steps without any gradient: torch.optim.SGD's parameters at every
    step (the momentum buffers untouched by those steps)."""
    params = _tree(0)
    tx = ft.sgd(0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    got = _ft_run(tx, params, GRADS, mode)
    want = _torch_run(
        params,
        GRADS,
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01),
    )
    _assert_runs_equal(got, want, 1e-6, 1e-7, f"sgd, {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_clip_then_sgd_momentum_without_gradients_is_torch_no_op(mode):
    """``chain(clip_by_global_norm, sgd(momentum))`` fed all-``None`` gradients: torch's
    ``clip_grad_norm_`` + SGD (a step with no ``.grad`` is a no-op for both)."""
    params = _tree(0)
    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.sgd(0.1, momentum=0.9))
    got = _ft_run(tx, params, GRADS, mode)
    want = _torch_run(params, GRADS, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1.0)
    _assert_runs_equal(got, want, 1e-6, 1e-7, f"clip + sgd, {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_partition_label_that_owns_no_leaf(mode):
    """A label whose transform (sgd with momentum, adamw) owns no leaf: the partition is the
    other transform alone, bit for bit (its primitives: ``ft.step`` runs a partition's)."""
    params = _tree(0)
    grads = [_tree(1 + t) for t in range(3)]
    for unused in (ft.sgd(0.1, momentum=0.9), ft.adamw(1e-2)):
        tx = ft.partition({"used": ft.adam(1e-2), "unused": unused}, dict.fromkeys(SHAPES, "used"))
        got = _ft_run(tx, params, grads, mode)
        want = _ft_run(ft.adam(1e-2), params, grads, "update")  # (ft.step: the primitives)
        _assert_runs_equal(got, want, 0.0, 0.0, f"partition, {mode}")


@pytest.mark.parametrize("mode", MODES)
def test_frozen_group(mode):
    """A ``partition`` group whose leaves never get a gradient (frozen: sgd with momentum):
    its parameters stay as they were, bit for bit, and the trained group equals its transform
    on its own leaves."""
    params = _tree(0)
    trained = ("w", "t")
    labels = {k: "train" if k in trained else "frozen" for k in SHAPES}
    grads = [{k: v if k in trained else None for k, v in _tree(1 + t).items()} for t in range(3)]
    tx = ft.partition({"train": ft.adamw(1e-2), "frozen": ft.sgd(0.1, momentum=0.9)}, labels)
    got = _ft_run(tx, params, grads, mode)
    sub = {k: params[k] for k in trained}
    want = _ft_run(ft.adamw(1e-2), sub, [{k: g[k] for k in trained} for g in grads], "update")
    for t in range(3):
        for k in SHAPES:
            assert torch.equal(got[t][k], want[t][k] if k in trained else params[k]), (t, k)


def test_torch_optimizer_with_a_frozen_group():
    """``TorchOptimizer`` over a partition whose "frozen" group has no gradient (its module's
    parameters do not require one) and a momentum SGD: ``step()`` is torch.optim's with the
    frozen group skipped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m[0].requires_grad_(False)
    labels = {n: "frozen" if n.startswith("0.") else "train" for n, _ in model.named_parameters()}
    tx = ft.partition(
        {"train": ft.sgd(0.1, momentum=0.9), "frozen": ft.sgd(0.1, momentum=0.9)}, labels
    )
    opt = ft.TorchOptimizer(model.named_parameters(), tx)
    ref_opt = torch.optim.SGD(
        [{"params": list(ref[2].parameters())}, {"params": list(ref[0].parameters())}],
        lr=0.1,
        momentum=0.9,
    )
    frozen = [p.detach().clone() for p in model[0].parameters()]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 4, generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        close(p, q, 1e-6, 1e-7, "params")
    for p, f in zip(model[0].parameters(), frozen):
        assert torch.equal(p.detach(), f)


@pytest.mark.parametrize("mode", MODES)
def test_adafactor_with_a_mask_that_decays_no_leaf(mode):
    """A weight-decay mask that keeps no leaf: adafactor without the decay, bit for bit."""
    params = _tree(0)
    grads = [_tree(1 + t) for t in range(2)]
    none = ft.adafactor(weight_decay=0.1, mask=lambda p: dict.fromkeys(p, False))
    got = _ft_run(none, params, grads, mode)
    want = _ft_run(ft.adafactor(), params, grads, mode)
    _assert_runs_equal(got, want, 0.0, 0.0, f"adafactor, {mode}")
