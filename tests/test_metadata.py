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


class _Counting:
    """TensorGuards that count their checks (a wrapper: the class takes no subclasses)."""

    checks = 0

    def __init__(self, *xs, **kw):
        self.guards = metadata._GUARDS_CLASS(*xs, **kw)

    def check(self, *xs):
        _Counting.checks += 1
        return self.guards.check(*xs)


@pytest.fixture
def counting(monkeypatch):
    """Guards that count their checks, every memo emptied first (their guards are others)."""
    import gc

    # (by exact type: isinstance of a dead weak proxy among gc's objects raises)
    def clear():
        for memo in [m for m in gc.get_objects() if type(m) is Memo]:
            memo.clear()

    clear()
    monkeypatch.setattr(metadata, "_CANONICAL", {})
    monkeypatch.setattr(metadata, "_GUARDS", _Counting)
    _Counting.checks = 0
    yield _Counting
    clear()


def test_lists_of_one_metadata_share_guards_and_are_checked_once_a_step(counting):
    xs, ys = _leaves(), _leaves()
    one, two = Memo(), Memo()
    one.put("k", [xs, ys], "both")
    two.put("k", [xs], "one")
    assert one.entries["k"][0][1][0] is one.entries["k"][0][1][1] is two.entries["k"][0][1][0]
    counting.checks = 0
    for _ in range(2):  # (outside a step: every list checked at every get)
        assert one.get("k", [xs, ys]) == "both" and two.get("k", [xs]) == "one"
    assert counting.checks == 6
    counting.checks = 0
    with metadata.verifying():  # (a step: each list of tensors once)
        for _ in range(2):
            assert one.get("k", [xs, ys]) == "both" and two.get("k", [list(xs)]) == "one"
        assert counting.checks == 2
        zs = [xs[0], xs[1], torch.randn(2, 3, 2)]  # (another tensor: checked)
        assert two.get("k", [zs]) == "one" and counting.checks == 3
        # (metadata changed in place, as requires_grad_like does, which forgets the checks)
        xs[2].requires_grad_()
        metadata.forget_verified()
        assert two.get("k", [xs]) is None
    assert metadata._VERIFIED.get() is None


def test_checks_in_a_scope_under_torch_func_and_inference_mode_are_not_remembered(counting):
    xs = _leaves()
    memo = Memo()
    memo.put("k", [xs], "answer")
    with metadata.verifying():
        assert memo.get("k", [xs]) == "answer"  # (remembered)
        with torch.inference_mode():
            assert memo.get("k", [xs]) is None  # (checked: other dispatch keys)

        def asked(y):
            # (checked again, and they fail there: the dispatch keys are vmap's; the
            # scope's record of them would have said they pass)
            assert memo.get("k", [xs]) is None
            return y

        counting.checks = 0
        torch.func.vmap(asked)(torch.randn(2, 3))
        assert counting.checks == 1


def test_a_multi_steps_micro_step_checks_each_list_once(counting):
    """A non-final micro-step asks four memos of its gradients, accumulators and parameters
    (all of one metadata here): one guards object, one check per list of tensors."""
    tx, params, grads = _problem()
    params, state = _run(tx, grads, params, 4, donate=True)  # (the answers remembered)
    counting.checks = 0
    g = {k: x.clone() for k, x in grads[4].items()}
    params, state = ft.step(tx, g, state, params, donate=True)
    assert 1 <= counting.checks <= 3
    assert int(state.mini_step) == 1


def test_shared_guards_are_bounded(counting, monkeypatch):
    """At most ``_CANONICAL_PER_LENGTH`` shared guards per list length and
    ``_CANONICAL_LENGTHS`` lengths (the oldest go; a memo keeps the guards it holds)."""
    monkeypatch.setattr(metadata, "_CANONICAL_LENGTHS", 3)
    memo = Memo(per_key=64, keys=64)
    for n in range(1, 6):
        for m in range(1, 11):
            memo.put((n, m), [[torch.randn(m) for _ in range(n)]], (n, m))
    assert list(metadata._CANONICAL) == [3, 4, 5]
    assert all(len(v) == metadata._CANONICAL_PER_LENGTH for v in metadata._CANONICAL.values())
    assert memo.get((1, 1), [[torch.randn(1)]]) == (1, 1)  # (its own guards still)
