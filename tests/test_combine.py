"""partition / masked: optax semantics, no state for leaves a transform does not own, and one
reduction of unreduced gradients for all leaves."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import functional_train as ft
from functional_train.testing import count_collectives, on_rank, per_rank, simulate


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
