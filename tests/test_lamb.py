"""LAMB: ``ft.lamb`` / ``ft.scale_by_trust_ratio`` against the LAMB equations (You et al. 2019),
sharded vs unsharded, and one collective per update for all trust-ratio norms."""

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import functional_train as ft
from functional_train.testing import count_collectives, gather, on_rank, per_rank, simulate

SHAPES = {"w": (6, 5), "t": (3, 4, 5), "b": (7,), "s": ()}


def make(shapes=SHAPES, steps=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    grads = [
        {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
        for _ in range(steps)
    ]
    return params, grads


def reference_lamb(params, grads, lr, b1, b2, eps, wd, bias_correction):
    """The LAMB equations (You et al. 2019, as optax's lamb computes them), leaf by leaf, in
    float64."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    for t, g in enumerate(grads, start=1):
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            mh, vh = (m[k] / (1 - b1**t), v[k] / (1 - b2**t)) if bias_correction else (m[k], v[k])
            r = mh / (vh.sqrt() + eps) + wd * p[k]
            pn, rn = p[k].norm(), r.norm()
            trust = 1.0 if pn == 0 or rn == 0 else pn / rn
            p[k] = p[k] - lr * trust * r
    return p, m, v


def run(tx, params, grads, mesh=None):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params, mesh=mesh)
        params = ft.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"weight_decay": 0.1},
        {"bias_correction": False},
        {"learning_rate": 3e-2, "b1": 0.8, "b2": 0.99, "eps": 1e-4, "weight_decay": 0.01},
    ],
)
def test_matches_the_lamb_equations(kw):
    params, grads = make()
    args = dict(
        learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0, bias_correction=True
    )
    args.update(kw)
    ours, state = run(ft.lamb(**args), params, grads)
    ref, m, v = reference_lamb(
        params,
        grads,
        args["learning_rate"],
        args["b1"],
        args["b2"],
        args["eps"],
        args["weight_decay"],
        args["bias_correction"],
    )
    adam = state[0]
    for k in params:
        torch.testing.assert_close(ours[k] - params[k], ref[k] - params[k], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(adam.mu[k], m[k], rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(adam.nu[k], v[k], rtol=1e-10, atol=1e-14)
    assert int(adam.count) == len(grads)


def test_defaults_are_the_references():
    import inspect

    sig = inspect.signature(ft.lamb).parameters
    assert sig["learning_rate"].default == 1e-3 and sig["b1"].default == 0.9
    assert sig["b2"].default == 0.999 and sig["eps"].default == 1e-6
    assert sig["weight_decay"].default == 0.0 and sig["bias_correction"].default is True


def test_trust_ratio_is_one_for_zero_norms():
    tx = ft.scale_by_trust_ratio()
    p = {"zero": torch.zeros(3, 2), "w": torch.ones(3, 2)}
    g = {"zero": torch.ones(3, 2), "w": torch.zeros(3, 2)}
    u, _ = tx.update(g, tx.init(p), p)
    assert torch.equal(u["zero"], g["zero"]) and torch.equal(u["w"], g["w"])
    g = {"zero": torch.ones(3, 2), "w": torch.full((3, 2), 2.0)}
    u, _ = tx.update(g, tx.init(p), p)
    torch.testing.assert_close(u["w"], torch.full((3, 2), 1.0))  # g * ||p|| / ||g|| = 2 * 1/2


@pytest.mark.parametrize(
    "kw,exc",
    [
        ({"min_norm": -1.0}, ValueError),
        ({"trust_coefficient": 0.0}, ValueError),
        ({"eps": -1e-3}, ValueError),
    ],
)
def test_scale_by_trust_ratio_bad_hyper_parameters(kw, exc):
    with pytest.raises(exc, match=next(iter(kw))):
        ft.scale_by_trust_ratio(**kw)


def test_lamb_bad_hyper_parameters():
    with pytest.raises(ValueError, match="learning_rate"):
        ft.lamb(-1e-3)
    with pytest.raises(ValueError, match="weight_decay"):
        ft.lamb(weight_decay=-0.1)
    with pytest.raises(ValueError, match="b1"):
        ft.lamb(b1=1.0)


S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
MIXED = [
    ((5, 7), [S0, S1]),
    ((3, 5, 6), [R, S2]),
    ((9,), [S0, S0]),
    ((1, 3), [S1, R]),
    ((4, 6), [R, R]),
    ((7, 2), [S1, S0]),
]


def _f32(tree):
    return {k: v.to(torch.float32) for k, v in tree.items()}


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2,)])
def test_sharded_equals_unsharded(mesh_shape):
    shapes = {f"l{i}": s for i, (s, _) in enumerate(MIXED)}
    params, grads = make(shapes, steps=4)
    params, grads = _f32(params), [_f32(g) for g in grads]
    tx = ft.lamb(1e-2, weight_decay=0.1)
    expected, exp_state = run(tx, params, grads)
    n = math.prod(mesh_shape)
    with simulate(n):
        names = ("dp", "tp")[-len(mesh_shape) :]
        m = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        place = {f"l{i}": pl[-len(mesh_shape) :] for i, (_, pl) in enumerate(MIXED)}
        dparams = {k: distribute_tensor(v, m, place[k]) for k, v in params.items()}
        dgrads = [{k: distribute_tensor(v, m, place[k]) for k, v in g.items()} for g in grads]
        got, state = run(tx, dparams, dgrads, ft.Mesh(m))
        for k in params:
            assert got[k].placements == dparams[k].placements
        got, mu = gather(got), gather(state[0].mu)
    for k in params:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(mu[k], exp_state[0].mu[k], rtol=1e-5, atol=1e-7, msg=k)


def test_pipeline_stages_keep_their_own_trust_ratios():
    """Stages hold different leaves at the same path: their norms must not be mixed."""
    stages = [make({"w": (4, 3), "b": (5,)}, steps=3, seed=s) for s in (1, 2)]
    stages = [(_f32(p), [_f32(g) for g in gs]) for p, gs in stages]
    tx = ft.lamb(1e-2)
    expected = [run(tx, p, gs)[0] for p, gs in stages]
    with simulate(4):
        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        tp = m["tp"]

        def stage_leaf(get):
            return per_rank(4, lambda r: get(stages[r // 2]))

        dparams = {
            "w": distribute_tensor(stage_leaf(lambda s: s[0]["w"]), tp, [S0], src_data_rank=None),
            "b": stage_leaf(lambda s: s[0]["b"]),
        }
        dgrads = [
            {
                "w": distribute_tensor(
                    stage_leaf(lambda s, i=i: s[1][i]["w"]), tp, [S0], src_data_rank=None
                ),
                "b": stage_leaf(lambda s, i=i: s[1][i]["b"]),
            }
            for i in range(3)
        ]
        got, _ = run(tx, dparams, dgrads, ft.Mesh(m, pipeline_axis="pp"))
        for rank in range(4):
            stage, tp_rank = divmod(rank, 2)
            w = on_rank(got["w"]._local_tensor, rank)
            rows = expected[stage]["w"][2 * tp_rank : 2 * tp_rank + 2]
            torch.testing.assert_close(w, rows, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(
                on_rank(got["b"], rank), expected[stage]["b"], rtol=1e-5, atol=1e-6
            )


@pytest.mark.parametrize("n_leaves", [10, 40])
def test_one_collective_per_update(n_leaves):
    with simulate(4):
        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        gen = torch.Generator().manual_seed(0)
        spec = [MIXED[i % len(MIXED)] for i in range(n_leaves)]
        params = {
            f"l{i}": distribute_tensor(torch.randn(s, generator=gen), m, pl)
            for i, (s, pl) in enumerate(spec)
        }
        grads = {
            k: distribute_tensor(torch.randn(v.shape, generator=gen), m, list(v.placements))
            for k, v in params.items()
        }
        tx = ft.lamb(1e-3, weight_decay=0.01)
        state = tx.init(params)
        with count_collectives() as c:
            tx.update(grads, state, params, mesh=ft.Mesh(m))
    assert c.counts == {"all_reduce": 1}


@pytest.mark.parametrize("seed", range(4))
def test_leaves_are_independent_mixed_dtypes(seed):
    """lamb on a tree of float32 and float64 leaves equals lamb on each leaf, bit for bit: the
    trust ratio of a float32 leaf is computed in float32 whatever the other leaves' dtypes."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    params = {
        "a": torch.randn(6, 5, generator=g),
        "b": torch.randn(7, dtype=f64, generator=g),
        "c": torch.randn(3, 4, dtype=f64, generator=g),
        "d": torch.randn(5, generator=g),
    }
    grads = [
        {k: torch.randn(v.shape, dtype=v.dtype, generator=g) for k, v in params.items()}
        for _ in range(3)
    ]
    tx = lambda: ft.lamb(1e-2, weight_decay=0.1)  # noqa: E731
    whole = run(tx(), params, grads)[0]
    for k in params:
        alone = run(tx(), params[k], [x[k] for x in grads])[0]
        assert whole[k].dtype == params[k].dtype
        torch.testing.assert_close(whole[k], alone, rtol=0, atol=0, msg=k)
