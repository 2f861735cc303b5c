"""partition / masked: optax semantics, no state for leaves a transform does not own, and one
reduction of unreduced gradients for all leaves."""

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import functional_train as ft
from functional_train import combine
from functional_train.testing import count_collectives, on_rank, per_rank, simulate
from functional_train.tree import tree_flatten, tree_map, tree_paths


def tree(seed, shapes=None):
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or {"w": (4, 3), "b": (3,), "emb": {"table": (5, 2)}}
    return {
        k: tree(seed + 1, v) if isinstance(v, dict) else torch.randn(v, generator=g)
        for k, v in shapes.items()
    }


LABELS = {"w": "adam", "b": "sgd", "emb": {"table": "adam"}}


def run(tx, params, grads, mesh=None):
    state = tx.init(params)
    for g in grads:
        u, state = tx.update(g, state, params, mesh=mesh)
        params = ft.apply_updates(params, u)
    return params, state


def test_partition_equals_each_transform_on_its_leaves():
    params = tree(0)
    grads = [tree(10 + i) for i in range(4)]
    tx = ft.partition(
        {"adam": ft.adamw(1e-2, weight_decay=0.1), "sgd": ft.sgd(0.1, momentum=0.9)}, LABELS
    )
    got, state = run(tx, params, grads)
    adam_p, _ = run(
        ft.adamw(1e-2, weight_decay=0.1),
        {"w": params["w"], "t": params["emb"]["table"]},
        [{"w": g["w"], "t": g["emb"]["table"]} for g in grads],
    )
    sgd_p, _ = run(ft.sgd(0.1, momentum=0.9), {"b": params["b"]}, [{"b": g["b"]} for g in grads])
    torch.testing.assert_close(got["w"], adam_p["w"], rtol=0, atol=0)
    torch.testing.assert_close(got["emb"]["table"], adam_p["t"], rtol=0, atol=0)
    torch.testing.assert_close(got["b"], sgd_p["b"], rtol=0, atol=0)
    # leaves a transform does not own hold no state in it
    adam_state = state.inner_states["adam"][0]
    assert adam_state.mu["b"] is None and adam_state.mu["w"] is not None
    assert state.inner_states["sgd"][0].trace["w"] is None


def test_partition_with_a_label_function():
    params = tree(0)
    labels = lambda p: {"w": "decay", "b": "no_decay", "emb": {"table": "no_decay"}}  # noqa: E731
    tx = ft.partition({"decay": ft.add_decayed_weights(0.5), "no_decay": ft.identity()}, labels)
    g = tree(1)
    u, _ = tx.update(g, tx.init(params), params)
    torch.testing.assert_close(u["w"], g["w"] + 0.5 * params["w"])
    assert torch.equal(u["b"], g["b"])


def test_masked_passes_the_others_through():
    params, g = tree(0), tree(1)
    tx = ft.masked(ft.scale_by_adam(), {"w": True, "b": False, "emb": {"table": False}})
    u, state = tx.update(g, tx.init(params), params)
    assert torch.equal(u["b"], g["b"]) and torch.equal(u["emb"]["table"], g["emb"]["table"])
    assert not torch.equal(u["w"], g["w"])
    assert state.inner_state.mu["b"] is None and state.inner_state.mu["emb"]["table"] is None


def test_bad_labels_and_masks():
    params = tree(0)
    tx = ft.partition({"adam": ft.adam()}, LABELS)
    with pytest.raises(ValueError, match=r"leaf 'b' has label 'sgd'"):
        tx.init(params)
    with pytest.raises(ValueError, match="param_labels does not have the structure of params"):
        ft.partition({"adam": ft.adam()}, {"w": "adam"}).init(params)
    with pytest.raises(TypeError, match=r"mask leaf 'b' must be a bool"):
        ft.masked(ft.scale(2.0), {"w": True, "b": 1, "emb": {"table": True}}).init(params)
    with pytest.raises(TypeError, match="GradientTransformation"):
        ft.partition({"a": "adam"}, LABELS)


def test_partition_reduces_unreduced_gradients_once():
    """Per-replica gradients over the data axis: one bucketed all-reduce for every leaf, then
    the inner transforms (here two clipping norms, local: every leaf is whole on every rank)."""
    params = tree(0)
    per_replica = [[tree(100 + 10 * s + r) for r in range(2)] for s in range(3)]
    mean = [
        {
            k: (
                torch.stack([g[r][k] for r in range(2)]).mean(0)
                if k != "emb"
                else {"table": (g[0]["emb"]["table"] + g[1]["emb"]["table"]) / 2}
            )
            for k in params
        }
        for g in per_replica
    ]
    tx = ft.partition(
        {
            "adam": ft.chain(ft.clip_by_global_norm(0.5), ft.adam(1e-2)),
            "sgd": ft.chain(ft.clip_by_global_norm(0.5), ft.sgd(0.1)),
        },
        LABELS,
    )
    expected, _ = run(tx, params, mean)
    with simulate(2):
        m = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

        def leaf(get):
            return per_rank(2, lambda r: get(r))

        dparams = {
            "w": leaf(lambda r: params["w"]),
            "b": leaf(lambda r: params["b"]),
            "emb": {"table": leaf(lambda r: params["emb"]["table"])},
        }
        mesh = ft.Mesh(m, data_axis="dp")
        state = tx.init(dparams)
        counts = []
        for g in per_replica:
            dg = {
                "w": leaf(lambda r: g[r]["w"]),
                "b": leaf(lambda r: g[r]["b"]),
                "emb": {"table": leaf(lambda r: g[r]["emb"]["table"])},
            }
            with count_collectives() as c:
                u, state = tx.update(dg, state, dparams, mesh=mesh)
            counts.append(c.counts)
            dparams = ft.apply_updates(dparams, u)
        for rank in range(2):
            torch.testing.assert_close(on_rank(dparams["w"], rank), expected["w"])
            torch.testing.assert_close(on_rank(dparams["b"], rank), expected["b"])
            torch.testing.assert_close(
                on_rank(dparams["emb"]["table"], rank), expected["emb"]["table"]
            )
    # the presence agreement over dp (which ranks have which gradient), then the one mean
    assert counts == [{"all_reduce": 2}] * 3


@pytest.mark.slow
def test_partition_and_masked_compile():
    """Under torch.compile the labels / mask come from the eager init (dynamo cannot flatten
    trees of strings built in traced code); results equal eager. Two param trees of the same
    shapes with different labels make the lookup ambiguous: a clear error under compile."""
    import torch._dynamo

    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    for tx in (
        ft.partition(
            {"a": ft.adamw(1e-2), "s": ft.sgd(0.1)},
            lambda p: {k: "a" if v.ndim == 2 else "s" for k, v in p.items()},
        ),
        ft.masked(ft.adamw(1e-2), {"w": True, "b": False}),
    ):
        torch._dynamo.reset()
        state = tx.init(params)
        want, _ = tx.update(grads, state, params)
        got, _ = torch.compile(tx.update, backend="eager", fullgraph=True)(grads, state, params)
        for k in params:
            torch.testing.assert_close(got[k], want[k])
    torch._dynamo.reset()
    tx = ft.partition(
        {"a": ft.adamw(1e-2), "s": ft.sgd(0.1)}, lambda p: {k: "a" if k == "w" else "s" for k in p}
    )
    tx.init({"w": torch.zeros(3), "z": torch.zeros(3)})  # leaves (w, z): labels (a, s)
    other = {"b": torch.zeros(3), "w": torch.zeros(3)}  # leaves (b, w): labels (s, a)
    state = tx.init(other)
    with pytest.raises(Exception, match="different labels"):
        torch.compile(tx.update, backend="eager", fullgraph=True)(other, state, other)


# ---------------------------------------------------------------------------------------------
# masks and labels: NumPy bools, prefix trees (optax's semantics), one resolution everywhere
# ---------------------------------------------------------------------------------------------
DEEP = {
    "encoder": {"a": (4, 3), "b": (3,), "c": {"d": (2, 3)}},
    "decoder": {"w": (3, 5), "b": (5,)},
}
PREFIX_MASK = {"encoder": False, "decoder": {"w": True, "b": np.bool_(False)}}
FULL_MASK = {
    "encoder": {"a": False, "b": False, "c": {"d": False}},
    "decoder": {"w": True, "b": False},
}
PREFIX_LABELS = {"encoder": "sgd", "decoder": {"w": "adam", "b": "sgd"}}
FULL_LABELS = {
    "encoder": {"a": "sgd", "b": "sgd", "c": {"d": "sgd"}},
    "decoder": {"w": "adam", "b": "sgd"},
}

MASK_CASES = {
    "masked": lambda m: ft.masked(ft.adamw(1e-2), m),
    "add_decayed_weights": lambda m: ft.chain(ft.add_decayed_weights(0.5, mask=m), ft.sgd(0.1)),
    "adamw": lambda m: ft.adamw(1e-2, weight_decay=0.5, mask=m),
    "lamb": lambda m: ft.lamb(1e-2, weight_decay=0.5, mask=m),
    "adafactor": lambda m: ft.adafactor(weight_decay=0.5, mask=m),
    "came": lambda m: ft.came(1e-2, weight_decay=0.5, mask=m),
    "partition": lambda labels: ft.partition(
        {"adam": ft.adamw(1e-2, weight_decay=0.5), "sgd": ft.sgd(0.1, momentum=0.9)}, labels
    ),
}


def _steps(tx, params, grads, mode):
    state = tx.init(params)
    p = tree_map(lambda x: x.clone(), params)
    for g in grads:
        g = tree_map(lambda x: x.clone(), g)
        if mode == "update":
            u, state = tx.update(g, state, p)
            p = ft.apply_updates(p, u)
        else:
            p, state = ft.step(tx, g, state, p, donate=mode == "donate")
    return p, state


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("as_callable", [False, True], ids=["tree", "callable"])
@pytest.mark.parametrize("name", sorted(MASK_CASES))
def test_prefix_and_numpy_bool_masks_equal_the_full_mask(name, as_callable, mode):
    """A mask (or labels) tree that is a prefix of the params tree, with a NumPy bool among
    its leaves, gives what the full tree of Python bools gives, bit for bit, over 3 steps
    (optax's semantics: a value for a subtree applies to each of its leaves), through
    ``update``, the pure and the donated ``ft.step`` (their fused and per-leaf paths read the
    mask too)."""
    params = tree(0, DEEP)
    grads = [tree(10 + t, DEEP) for t in range(3)]
    prefix, full = (PREFIX_LABELS, FULL_LABELS) if name == "partition" else (PREFIX_MASK, FULL_MASK)
    make = MASK_CASES[name]
    spec = (lambda p: prefix) if as_callable else prefix
    got, got_state = _steps(make(spec), params, grads, mode)
    want, want_state = _steps(make(full), params, grads, mode)
    for path, x, y, p0 in zip(
        tree_paths(got), tree_flatten(got)[0], tree_flatten(want)[0], tree_flatten(params)[0]
    ):
        assert torch.equal(x, y), path
        assert not torch.equal(x, p0), f"{path}: not updated"
    for x, y in zip(tree_flatten(got_state)[0], tree_flatten(want_state)[0]):
        assert (x is None and y is None) or torch.equal(x, y)


def test_numpy_bool_mask_leaves_are_python_bools():
    keep_of = combine.mask_of({"w": np.bool_(True), "b": np.False_}, "masked")
    keep = keep_of({"w": torch.zeros(2, 2), "b": torch.zeros(2)})
    assert keep == [False, True] and all(type(k) is bool for k in keep)


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            {"encoder": False, "decoder": {"w": True}},
            r"masked: mask does not have the structure of params nor of a prefix of it: "
            r"'decoder\.b' is missing",
        ),
        (
            {"encoder": {"a": True, "b": True, "c": True, "x": False}, "decoder": True},
            r"'encoder\.x' is not in params",
        ),
        ({"encoder": [True, False, True], "decoder": True}, r"'encoder' is a list where params"),
        (
            {"encoder": False, "decoder": {"w": {"x": True}, "b": False}},
            r"'decoder\.w' is a dict where params have a leaf",
        ),
    ],
)
def test_a_mask_neither_full_nor_a_prefix_names_the_path(bad, match):
    params = tree(0, DEEP)
    with pytest.raises(ValueError, match=match):
        ft.masked(ft.sgd(0.1), bad).init(params)
    where = match.replace("masked: ", "add_decayed_weights: ")
    with pytest.raises(ValueError, match=where):
        ft.add_decayed_weights(0.1, mask=bad).init(params)
    labels = tree_map(lambda b: "a", bad)
    with pytest.raises(ValueError, match=match.replace("masked: mask", "partition: param_labels")):
        ft.partition({"a": ft.sgd(0.1)}, labels).init(params)
    with pytest.raises(TypeError, match=r"mask leaf 'decoder\.b' must be a bool"):
        ft.masked(ft.sgd(0.1), {"encoder": True, "decoder": {"w": True, "b": 1}}).init(params)
