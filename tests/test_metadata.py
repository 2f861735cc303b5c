"""The engine's answers remembered by exact metadata (functional_train.engine.metadata): a hit
only for lists whose every tensor has the metadata of a list that was asked, a miss for
anything else -- and the steps that use them raise and compute as they did without them."""

import pytest
import torch

import functional_train as ft
from functional_train.engine import metadata
from functional_train.engine.metadata import Memo, guards_of

pytestmark = pytest.mark.skipif(not metadata.ENABLED, reason="this torch has no TensorGuards")


def _leaves():
    return [torch.randn(3, 4), torch.randn(5), torch.randn(2, 3, 2)]


def _remembered():
    memo = Memo()
    memo.put("k", [_leaves()], "answer")
    return memo


def test_a_list_with_the_same_metadata_hits():
    memo = _remembered()
    assert memo.get("k", [_leaves()]) == "answer"
    # (the key only narrows the candidates; a list of other tensors of the same metadata hits)
    assert memo.get("other key", [_leaves()]) is None


@pytest.mark.parametrize(
    "change",
    [
        lambda xs: xs.__setitem__(0, torch.randn(4, 3)),  # shape
        lambda xs: xs.__setitem__(0, torch.randn(4, 3).t()),  # strides
        lambda xs: xs.__setitem__(1, torch.randn(5, dtype=torch.float64)),  # dtype
        lambda xs: xs.__setitem__(1, torch.randn(5, dtype=torch.bfloat16)),
        lambda xs: xs.__setitem__(2, torch.randn(2, 3, 2, requires_grad=True)),
        lambda xs: xs.__setitem__(2, torch.nn.Parameter(torch.randn(2, 3, 2))),  # type
        lambda xs: xs.__setitem__(2, torch.randn(2, 3, 2, dtype=torch.complex64).conj()),
        lambda xs: xs.__setitem__(1, None),
        lambda xs: xs.__setitem__(1, xs[0]),  # the same tensor twice
        lambda xs: xs.pop(),  # length
        lambda xs: setattr(xs[0], "data", torch.randn(4, 3)),  # metadata changed in place
        lambda xs: setattr(xs[1], "data", torch.randn(5, dtype=torch.float64)),
        lambda xs: xs[2].requires_grad_(),
        lambda xs: xs[0].t_(),
    ],
    ids=[
        "shape",
        "strides",
        "float64",
        "bfloat16",
        "requires_grad",
        "parameter",
        "conjugate",
        "none",
        "twice",
        "length",
        "data_shape",
        "data_dtype",
        "requires_grad_",
        "t_",
    ],
)
def test_any_other_metadata_misses(change):
    memo = _remembered()
    xs = _leaves()
    change(xs)
    assert memo.get("k", [xs]) is None


def test_misses_under_inference_mode_and_torch_func():
    memo = _remembered()
    with torch.inference_mode():
        assert memo.get("k", [_leaves()]) is None

    def asked(x):
        assert memo.get("k", [[x[:12].reshape(3, 4), x[12:17], x[17:].reshape(2, 3, 2)]]) is None
        return x

    torch.func.vmap(asked)(torch.randn(2, 29))
    torch.func.grad(lambda x: asked(x).sum())(torch.randn(29))


def test_only_plain_tensors_and_parameters_are_remembered():
    assert guards_of(_leaves()) is not None
    assert guards_of([torch.nn.Parameter(torch.randn(2))]) is not None
    x = torch.randn(2)
    assert guards_of([x, x]) is None  # (the guards would never pass)
    assert guards_of([x, None]) is None
    assert guards_of([]) is None

    class Sub(torch.Tensor):
        pass

    assert guards_of([torch.randn(2).as_subclass(Sub)]) is None
    memo = Memo()
    memo.put("k", [[x, x]], "answer")
    memo.put("k", [_leaves()], None)  # (None is "not known")
    with torch.inference_mode():  # (guards made there would fail outside it)
        memo.put("k", [_leaves()], "answer")
    torch.func.vmap(lambda y: memo.put("k", [[y]], "answer") or y)(torch.randn(2, 3))
    assert memo.entries == {}


def test_bounded_and_latest_first():
    memo = Memo(per_key=2, keys=2)
    lists = [[torch.randn(n)] for n in (1, 2, 3)]
    for n, xs in enumerate(lists):
        memo.put("k", [xs], n)
    assert memo.get("k", [[torch.randn(1)]]) is None  # (the oldest went)
    assert memo.get("k", [[torch.randn(2)]]) == 1
    assert [e[2] for e in memo.entries["k"]] == [1, 2]  # (a hit moves to the front)
    memo.put("j", [lists[0]], 0)
    memo.put("i", [lists[0]], 0)
    assert list(memo.entries) == ["j", "i"]


def _run(tx, grads, params, n, donate=False):
    state = tx.init(params)
    for g in grads[:n]:  # (copies: a donated step may write into its gradients)
        g = {k: x.detach().clone().requires_grad_(x.requires_grad) for k, x in g.items()}
        params, state = ft.step(tx, g, state, params, donate=donate)
    return params, state


def _problem():
    torch.manual_seed(0)
    shapes = {"w": (6, 4), "b": (4,), "k": (2, 3, 5)}
    params = {k: torch.randn(s) for k, s in shapes.items()}
    grads = [{k: torch.randn(s) for k, s in shapes.items()} for _ in range(8)]
    tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2)), every_k=2)
    return tx, params, grads


@pytest.mark.parametrize("donate", [False, True])
def test_a_step_after_in_place_metadata_changes(donate):
    """Answers remembered by earlier steps are not given for tensors whose metadata changed
    in place (``.data =``): the step checks them again and raises, as the first step would."""
    tx, params, grads = _problem()
    params, state = _run(tx, grads, params, 3, donate)  # (the answers remembered)
    state.acc_grads["w"].data = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="'w' has shape"):
        ft.step(tx, grads[3], state, params, donate=donate)


@pytest.mark.parametrize("donate", [False, True])
def test_other_layouts_after_remembered_ones(donate):
    """Gradients of the remembered shapes in other layouts (transposed, float64) or requiring
    grad take their own path and give what a step that never saw the others gives."""
    tx, params, grads = _problem()
    _run(tx, grads, {k: v.clone() for k, v in params.items()}, 4, donate)  # (remembered)
    odd = [
        {"w": g["w"].t().contiguous().t(), "b": g["b"], "k": g["k"]}
        if i % 2
        else {**g, "b": g["b"].clone().requires_grad_()}
        for i, g in enumerate(grads)
    ]
    got, _ = _run(tx, odd, {k: v.clone() for k, v in params.items()}, 6, donate)
    metadata_off = {k: v.clone() for k, v in params.items()}
    saved = metadata._GUARDS
    metadata._GUARDS = None  # (nothing remembered: every check by its attributes)
    try:
        want, _ = _run(tx, odd, metadata_off, 6, donate)
    finally:
        metadata._GUARDS = saved
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
        assert not torch.equal(got[k], params[k])
